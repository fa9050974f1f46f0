"""The start-up checks of --disaggregation-mode and its flags (ServerArgs.check calls
`check_disaggregation_server_args`; kept here, as speculative/server_args_check.py is, so the PD flag rules
live beside the PD code they configure)."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Protocol

from engine.disaggregation.allowlist import PrefillAllowlist
from engine.disaggregation.auth import SECRET_ENV, is_loopback, resolve_secret

logger = logging.getLogger(__name__)

DISAGGREGATION_MODES = ("null", "prefill", "decode")
# tcp: ZMQ between processes and machines; loopback: in-process (tests); fake: no prefill at all.
DISAGGREGATION_TRANSFER_BACKENDS = ("tcp", "loopback", "fake")


class DisaggregationFlags(Protocol):
    """The ServerArgs fields the check reads (a protocol: server_args.py imports this module, not the other
    way round)."""

    host: str
    port: int
    dp_size: int
    is_embedding: bool
    disaggregation_mode: str
    disaggregation_transfer_backend: str
    disaggregation_bootstrap_port: int
    disaggregation_decode_polling_interval: int
    num_reserved_decode_tokens: int
    disaggregation_prealloc_reqs: Optional[int]
    disaggregation_bootstrap_timeout: float
    disaggregation_waiting_timeout: float
    disaggregation_heartbeat_interval: float
    disaggregation_heartbeat_max_failures: int
    disaggregation_prefill_allowlist: Optional[str]
    disaggregation_secret: Optional[str]
    disaggregation_host: Optional[str]


def check_disaggregation_server_args(args: DisaggregationFlags, need: Callable[[bool, str], None]) -> None:
    need(args.disaggregation_mode in DISAGGREGATION_MODES,
         f"--disaggregation-mode must be one of {', '.join(DISAGGREGATION_MODES)}, got {args.disaggregation_mode!r}")
    need(args.disaggregation_transfer_backend in DISAGGREGATION_TRANSFER_BACKENDS,
         f"--disaggregation-transfer-backend must be one of {', '.join(DISAGGREGATION_TRANSFER_BACKENDS)}, "
         f"got {args.disaggregation_transfer_backend!r}")
    need(1 <= args.disaggregation_bootstrap_port <= 65535,
         f"--disaggregation-bootstrap-port must be in [1, 65535], got {args.disaggregation_bootstrap_port}")
    need(args.disaggregation_decode_polling_interval >= 1,
         f"--disaggregation-decode-polling-interval must be >= 1, got {args.disaggregation_decode_polling_interval}")
    need(args.num_reserved_decode_tokens >= 0,
         f"--num-reserved-decode-tokens must be >= 0, got {args.num_reserved_decode_tokens}")
    need(args.disaggregation_prealloc_reqs is None or args.disaggregation_prealloc_reqs >= 1,
         f"--disaggregation-prealloc-reqs must be >= 1, got {args.disaggregation_prealloc_reqs}")
    for name in ("bootstrap_timeout", "waiting_timeout", "heartbeat_interval"):
        value = getattr(args, "disaggregation_" + name)
        need(value > 0, f"--disaggregation-{name.replace('_', '-')} must be > 0, got {value}")
    need(args.disaggregation_heartbeat_max_failures >= 1,
         f"--disaggregation-heartbeat-max-failures must be >= 1, got {args.disaggregation_heartbeat_max_failures}")
    try:
        PrefillAllowlist.parse(args.disaggregation_prefill_allowlist)
    except ValueError as e:
        need(False, str(e))
    if args.disaggregation_mode != "null":
        _warn_open_pd_planes(args)
        need(args.dp_size == 1, "--disaggregation-mode prefill|decode supports --dp-size 1 only")
        need(not args.is_embedding, "--disaggregation-mode prefill|decode serves generative models only, "
                                    "not --is-embedding")
        need(not (args.disaggregation_mode == "prefill" and args.port == args.disaggregation_bootstrap_port),
             "--disaggregation-bootstrap-port must differ from --port")


def _warn_open_pd_planes(args: DisaggregationFlags) -> None:
    """Without a secret the PD planes are open: fine on loopback, loud beyond it (docs/security.md)."""
    if resolve_secret(args.disaggregation_secret) is not None or args.disaggregation_transfer_backend != "tcp":
        return
    exposed = [h for h in (args.host, args.disaggregation_host) if h is not None and not is_loopback(h)]
    if exposed:
        logger.warning("SECURITY: --disaggregation-mode %s listens on %s without --disaggregation-secret (or %s): "
                       "anyone who reaches its bootstrap and KV transfer ports can redirect, fail or forge KV "
                       "transfers. Set the same secret on every PD server (docs/security.md).",
                       args.disaggregation_mode, ", ".join(exposed), SECRET_ENV)
