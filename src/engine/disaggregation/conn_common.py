"""What both transfer managers share: their arguments, settings and the per-request handle API."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import torch

from engine.disaggregation.base import FailureCause, KVPoll
from engine.disaggregation.kv_io import FeatureStore, KVLayout
from engine.disaggregation.metadata import METADATA_SCHEMA_VERSION, MetadataBuffers
from engine.mem_cache.memory_pool import MHATokenToKVPool

if TYPE_CHECKING:
    from engine.disaggregation.recompute import RecomputeReq


@dataclass
class KVArgs:
    """The memory a transfer manager reads from (prefill) or writes into (decode)."""

    pool: MHATokenToKVPool
    metadata: MetadataBuffers
    layout: KVLayout
    page_size: int
    # The per-slot features sent with the KV (EAGLE / EAGLE3), or None (kv_io.py).
    features: Optional[FeatureStore] = None


@dataclass
class TransferConfig:
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    heartbeat_interval: float = 5.0
    heartbeat_max_failures: int = 2
    # Decode: attempts (one per interval) to read a prefill's bootstrap information.
    ensure_info_retries: int = 15
    ensure_info_interval: float = 1.0
    # Test aids: a failure probability per poll, a delay before every KV frame (seconds).
    failure_prob: float = 0.0
    frame_delay_s: float = 0.0

    @classmethod
    def from_server_args(cls, args: Any) -> "TransferConfig":
        return cls(bootstrap_timeout=args.disaggregation_bootstrap_timeout,
                   waiting_timeout=args.disaggregation_waiting_timeout,
                   heartbeat_interval=args.disaggregation_heartbeat_interval,
                   heartbeat_max_failures=args.disaggregation_heartbeat_max_failures)


def registration_info(kv_args: KVArgs, endpoint: str) -> Dict[str, Any]:
    """What a prefill rank PUTs on its bootstrap server (SGLang's field names, plus ours)."""
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return {
        "role": "Prefill",
        "attn_tp_size": kv_args.layout.tp_size,
        "attn_tp_rank": kv_args.layout.tp_rank,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "rank_ip": host.strip("[]") or endpoint,
        "rank_port": int(port) if port.isdigit() else 0,
        "page_size": kv_args.page_size,
        "kv_cache_dtype": kv_args.layout.dtype,
        "endpoint": endpoint,
        "kv_layout": kv_args.layout.to_dict(),
        "metadata_schema_version": METADATA_SCHEMA_VERSION,
    }


@dataclass
class TransferTimes:
    """Per-request stage timestamps (monotonic seconds) for the stage metrics."""

    created: float
    bootstrapped: Optional[float] = None  # the other side was found (WaitingForInput)
    dst_sent: Optional[float] = None  # decode: destination published (memory reserved)
    done: Optional[float] = None


class KVHandle(ABC):
    """A per-request transfer state machine (a KVSender on prefill, a KVReceiver on decode)."""

    room: int
    times: TransferTimes
    is_fake: bool = False

    @abstractmethod
    def poll(self) -> KVPoll: ...

    @abstractmethod
    def abort(self, reason: str, cause: FailureCause = FailureCause.ABORTED) -> None: ...

    @abstractmethod
    def failure(self) -> Optional[Tuple[str, FailureCause]]: ...

    @abstractmethod
    def clear(self) -> None: ...


class KVSender(KVHandle):
    @abstractmethod
    def send(self, slots: torch.Tensor, aux: bytes) -> None:
        """Start sending the KV of `slots` (from decode_prefix_len on) and then the metadata row."""

    def decode_prefix_len(self) -> int:
        return 0  # v1: the decode side never has a prefix of its own; the whole prompt is sent


class KVReceiver(KVHandle):
    @abstractmethod
    def send_metadata(self, slots: torch.Tensor, aux_index: int) -> None:
        """Publish the reserved destination (slots of the prompt, a metadata row) to the prefill."""

    def request_recompute(self, req: "RecomputeReq") -> None:
        """Ask the prefill to recompute a re-bootstrapped request's KV into the published
        destination (after send_metadata). A fake transfer has no prefill to ask."""

    def received_bytes(self) -> int:
        return 0


def now() -> float:
    return time.monotonic()
