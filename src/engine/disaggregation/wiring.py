"""Building a scheduler rank's transfer manager for the chosen backend.

  tcp       ZmqTransport on this machine's advertised address, background thread runners, the
            HTTP bootstrap client, and (decode) a heartbeat thread;
  loopback  the LoopbackNetwork the test passes in (everything runs when the test pumps it);
  fake      no manager at all: every request of the server is a fake transfer.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from enum import Enum
from typing import TYPE_CHECKING, Any, Optional

from engine.disaggregation.auth import resolve_secret
from engine.disaggregation.base import bootstrap_addr
from engine.disaggregation.conn_common import KVArgs, TransferConfig
from engine.disaggregation.kv_io import TARGET_FRAME_BYTES, KVLayout
from engine.disaggregation.metadata import MetadataBuffers

if TYPE_CHECKING:
    from engine.disaggregation.host import RoleHost
    from engine.disaggregation.conn_decode import DecodeKVManager
    from engine.disaggregation.conn_prefill import PrefillKVManager
    from engine.disaggregation.loopback import LoopbackNetwork
    from engine.disaggregation.metrics import DisaggMetrics

logger = logging.getLogger(__name__)

# Room for a message's header frame and the metadata row (both a few hundred bytes).
CONTROL_FRAME_BYTES = 64 << 10


class TransferBackend(str, Enum):
    TCP = "tcp"
    LOOPBACK = "loopback"
    FAKE = "fake"


def kv_args_for(host: RoleHost, metadata: MetadataBuffers) -> KVArgs:
    pool = host.kv.token_to_kv_pool_allocator.get_kvcache()
    if pool is None:
        raise RuntimeError("PD disaggregation needs the worker's KV pool (the allocator has none)")
    tp_size = host.server_args.tp_size
    total_kv_heads = host.total_kv_heads or pool.head_num * tp_size
    layout = KVLayout.of_pool(pool, total_kv_heads, tp_size, host.tp_rank, host.features)
    return KVArgs(pool=pool, metadata=metadata, layout=layout, page_size=host.page_size, features=host.features)


def own_bootstrap_addr(args: Any) -> str:
    """Where this prefill's ranks reach its bootstrap server (it runs in the main process)."""
    host = args.host if args.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return bootstrap_addr(host, args.disaggregation_bootstrap_port)


def max_frame_bytes(kv_args: KVArgs, role: str) -> int:
    """The largest frame this rank's transfer socket accepts (ZMQ MAXMSGSIZE).

    A decode rank receives KV frames, at most TARGET_FRAME_BYTES or one token of all its heads
    (frame_token_count never splits a token); a prefill rank receives destinations and aborts only.
    """
    if role == "prefill":
        return CONTROL_FRAME_BYTES
    return max(TARGET_FRAME_BYTES, kv_args.layout.bytes_per_token()) + CONTROL_FRAME_BYTES


def _parts(args: Any, network: Optional["LoopbackNetwork"], role: str, kv_args: KVArgs):
    backend = TransferBackend(args.disaggregation_transfer_backend)
    if backend == TransferBackend.LOOPBACK:
        if network is None:
            raise RuntimeError("--disaggregation-transfer-backend loopback runs in-process only "
                               "(tests pass a LoopbackNetwork); use tcp between processes")
        return network.transport(role), network.runner(), network.runner(), network.bootstrap_client()
    from engine.disaggregation.bootstrap import HttpBootstrapClient
    from engine.disaggregation.transport import ThreadJobRunner, ZmqTransport, advertised_host

    secret = resolve_secret(args.disaggregation_secret)
    transport = ZmqTransport(advertised_host(args.disaggregation_host, args.host), secret=secret,
                             max_frame_bytes=max_frame_bytes(kv_args, role), known_senders_only=role == "decode")
    return (transport, ThreadJobRunner(f"kv-transfer-io-{role}"), ThreadJobRunner(f"kv-transfer-control-{role}"),
            HttpBootstrapClient(secret=secret))


def build_prefill_manager(args: Any, kv_args: KVArgs, config: TransferConfig, metrics: "DisaggMetrics",
                          network: Optional["LoopbackNetwork"]) -> "PrefillKVManager":
    from engine.disaggregation.conn_prefill import PrefillKVManager

    transport, io_runner, _, client = _parts(args, network, "prefill", kv_args)
    addr = own_bootstrap_addr(args)
    if network is not None and kv_args.layout.tp_rank == 0:
        client.serve(addr, args.tp_size, uuid.uuid4().hex)  # stands in for the HTTP bootstrap server
    manager = PrefillKVManager(kv_args, transport, io_runner, client, addr, config, metrics)
    manager.register()
    logger.info("Prefill rank %d: KV transfer endpoint %s registered at bootstrap server %s",
                kv_args.layout.tp_rank, transport.endpoint, addr)
    return manager


def build_decode_manager(args: Any, kv_args: KVArgs, config: TransferConfig,
                         network: Optional["LoopbackNetwork"], tp_rank: int) -> "DecodeKVManager":
    from engine.disaggregation.conn_decode import DecodeKVManager

    from engine.disaggregation.allowlist import PrefillAllowlist

    transport, io_runner, control_runner, client = _parts(args, network, "decode", kv_args)
    allowlist = PrefillAllowlist.parse(args.disaggregation_prefill_allowlist,
                                       (args.host, args.disaggregation_host))
    manager = DecodeKVManager(kv_args, transport, io_runner, control_runner, client, config, allowlist)
    if network is None:
        _start_heartbeat(manager, config.heartbeat_interval)
    logger.info("Decode rank %d: KV transfer endpoint %s", tp_rank, transport.endpoint)
    return manager


def _start_heartbeat(manager: "DecodeKVManager", interval: float) -> None:
    def run() -> None:
        while True:
            time.sleep(interval)
            try:
                manager.heartbeat_once()
            except Exception:  # noqa: BLE001 - the heartbeat must outlive one bad probe
                logger.exception("PD heartbeat failed")

    threading.Thread(target=run, name="kv-transfer-heartbeat", daemon=True).start()
