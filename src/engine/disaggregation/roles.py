"""The PD role a scheduler takes for its --disaggregation-mode."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

if TYPE_CHECKING:
    from engine.disaggregation.decode_scheduler import DecodeDisaggregation
    from engine.disaggregation.prefill import PrefillDisaggregation
    from engine.scheduler.scheduler import Scheduler


def make_role(scheduler: "Scheduler", network: Any) -> Optional[Union["PrefillDisaggregation",
                                                                      "DecodeDisaggregation"]]:
    """The prefill or decode role collaborator, or None for a unified server.

    `network`: the LoopbackNetwork of an in-process pair (tests); None otherwise.
    """
    mode = scheduler.server_args.disaggregation_mode
    if mode == "prefill":
        from engine.disaggregation.prefill import PrefillDisaggregation

        return PrefillDisaggregation(scheduler, network)
    if mode == "decode":
        from engine.disaggregation.decode_scheduler import DecodeDisaggregation

        return DecodeDisaggregation(scheduler, network)
    return None
