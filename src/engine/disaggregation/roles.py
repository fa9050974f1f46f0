"""The PD role a scheduler takes for its --disaggregation-mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from engine.disaggregation.decode_scheduler import DecodeDisaggregation
    from engine.disaggregation.host import RoleHost
    from engine.disaggregation.prefill import PrefillDisaggregation


def make_role(host: "RoleHost", network: Any) -> Optional[Union["PrefillDisaggregation",
                                                                      "DecodeDisaggregation"]]:
    """The prefill or decode role collaborator, or None for a unified server.

    `network`: the LoopbackNetwork of an in-process pair (tests); None otherwise.
    """
    mode = host.server_args.disaggregation_mode
    if mode == "prefill":
        from engine.disaggregation.prefill import PrefillDisaggregation

        return PrefillDisaggregation(host, network)
    if mode == "decode":
        from engine.disaggregation.decode_scheduler import DecodeDisaggregation

        return DecodeDisaggregation(host, network)
    return None
