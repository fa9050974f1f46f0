"""The vocabulary of PD disaggregation: modes, the transfer state `KVPoll`, the status table
that background threads write and the scheduler reads, and the poll reduction across TP ranks.

A request's transfer progress on either side is one `KVPoll` value per bootstrap room. The values
are ordered on purpose (Failed < Bootstrapping < WaitingForInput < Transferring < Success) so that
the minimum over TP ranks is the most conservative state: every rank moves a request to its next
queue in the same iteration, and one failed rank fails it everywhere.
"""

from __future__ import annotations

import threading
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Optional, Protocol, Tuple, TypeVar

from engine.distributed.parallel_state import all_gather_objects, all_reduce_min_small_ints

if TYPE_CHECKING:
    from engine.scheduler.req import Req

# A request whose bootstrap_host is this address skips the prefill server altogether (SGLang's
# fake transfer: warm-up, health probes, decode-only benchmarks).
FAKE_BOOTSTRAP_HOST = "2.2.2.2"
# Rooms are 63-bit ids drawn by the router; 0 means "metadata not written yet" in a metadata row.
MAX_BOOTSTRAP_ROOM = 2**63


class DisaggregationMode(str, Enum):
    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class KVPoll(IntEnum):
    Failed = 0
    Bootstrapping = 1
    WaitingForInput = 2
    Transferring = 3
    Success = 4


class FailureCause(str, Enum):
    """Why a transfer failed: the `cause` label of the failure counter."""

    BOOTSTRAP = "bootstrap"  # the prefill's bootstrap server could not be reached / is not ready
    TIMEOUT = "timeout"  # a peer did not act within the bootstrap or waiting timeout
    PEER_DEAD = "peer_dead"  # heartbeat lost: the prefill server died
    ABORTED = "aborted"  # the client, the router or the other side aborted the request
    PEER_FAILED = "peer_failed"  # the other side reported a failure
    CORRUPT = "corrupt"  # checksum, byte count or metadata room mismatch
    CONFIG = "config"  # the two sides' KV layouts or TP sizes cannot be paired
    INJECTED = "injected"  # test fault injection
    BAD_REQUEST = "bad_request"  # the request cannot run here (its grammar did not compile): a 400


T = TypeVar("T")


def take_matching(items: List[T], match: Callable[[T], bool]) -> Tuple[List[T], List[T]]:
    """(the items that match, the others), both in their order (a queue sweep)."""
    taken: List[T] = []
    kept: List[T] = []
    for item in items:
        (taken if match(item) else kept).append(item)
    return taken, kept


class PollSource(Protocol):
    def poll(self) -> KVPoll: ...


class FailureSource(Protocol):
    def failure(self) -> Optional[Tuple[str, FailureCause]]: ...


# A reduced poll says Failed, but no rank recorded why: the room's state was already gone.
UNKNOWN_FAILURE = ("the transfer state was cleared", FailureCause.ABORTED)


class StatusTable:
    """room -> KVPoll, with SGLang's rules, safe to update from any thread.

    - Progress only moves forward (an update takes the max of old and new).
    - Failed is sticky and always wins.
    - Rooms must be registered before they are updated: an update for a room that was cleared
      (or never existed) is ignored, so a late message cannot resurrect a finished request or
      poison a later one that reuses the room number.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._status: Dict[int, KVPoll] = {}
        self._failures: Dict[int, Tuple[str, FailureCause]] = {}

    def register(self, room: int, status: KVPoll = KVPoll.Bootstrapping) -> None:
        with self._lock:
            self._status[room] = status
            self._failures.pop(room, None)

    def update(self, room: int, status: KVPoll) -> bool:
        """Apply a progress update; True when it changed the state."""
        if status == KVPoll.Failed:
            raise ValueError("use fail(room, reason, cause) to record a failure")
        with self._lock:
            old = self._status.get(room)
            if old is None or old == KVPoll.Failed or status <= old:
                return False
            self._status[room] = status
            return True

    def fail(self, room: int, reason: str, cause: FailureCause) -> bool:
        """Mark `room` Failed (the first reason is kept); True when the room was live."""
        with self._lock:
            old = self._status.get(room)
            if old is None:
                return False
            if old != KVPoll.Failed:
                self._status[room] = KVPoll.Failed
                self._failures[room] = (reason, cause)
            return True

    def get(self, room: int) -> KVPoll:
        with self._lock:
            return self._status.get(room, KVPoll.Failed)

    def failure(self, room: int) -> Optional[Tuple[str, FailureCause]]:
        """Why `room` failed, or None when this table recorded no failure for it."""
        with self._lock:
            return self._failures.get(room)

    def clear(self, room: int) -> None:
        with self._lock:
            self._status.pop(room, None)
            self._failures.pop(room, None)

    def rooms(self) -> List[int]:
        with self._lock:
            return list(self._status)

    def __contains__(self, room: int) -> bool:
        with self._lock:
            return room in self._status

    def __len__(self) -> int:
        with self._lock:
            return len(self._status)


def poll_and_all_reduce(sources: Iterable[PollSource]) -> List[KVPoll]:
    """Poll every source locally, then take the MIN over the TP group.

    Every rank holds the same queues in the same order (requests are broadcast from rank 0 and
    moved by the reduced result only), so the i-th entry is the same request on every rank.
    With one rank the reduction is the identity.
    """
    local = [int(s.poll()) for s in sources]
    return [KVPoll(v) for v in all_reduce_min_small_ints(local)]


def agreed_failures(failed: Iterable[FailureSource]) -> List[Tuple[str, FailureCause]]:
    """Why each of `failed` failed, the same answer on every TP rank.

    The polls are reduced, so a rank moves a request to failed when any rank saw it fail: the
    rank that lost the prefill's heartbeat first may not be the one whose message reaches the
    client. Each failure takes the reason of the lowest rank that recorded one. Call it on every
    rank with the same requests (the reduced polls' failed entries); it costs one collective
    when the list is not empty and none otherwise.
    """
    local = [source.failure() for source in failed]
    if not local:
        return []
    per_rank = all_gather_objects(local)
    return [next((rank[i] for rank in per_rank if rank[i] is not None), UNKNOWN_FAILURE) for i in range(len(local))]


def bootstrap_addr(host: str, port: int) -> str:
    """How a prefill's bootstrap server is named in tables and logs: host:port (IPv6 bracketed)."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def validate_bootstrap_fields(host: Optional[str], port: Optional[int], room: Optional[int]) -> Optional[str]:
    """An error message for bootstrap fields a PD server cannot use, or None."""
    if host is None or port is None or room is None:
        missing = [n for n, v in (("bootstrap_host", host), ("bootstrap_port", port), ("bootstrap_room", room))
                   if v is None]
        return (f"This server runs with --disaggregation-mode and needs {', '.join(missing)}: send requests "
                "through sglang-router in PD mode (--pd-disaggregation).")
    if not host:
        return "bootstrap_host must not be empty."
    if not 1 <= port <= 65535:
        return f"bootstrap_port must be in [1, 65535], got {port}."
    if not 0 < room < MAX_BOOTSTRAP_ROOM:
        # 0 is reserved: a metadata row whose room stamp is 0 has not been written yet.
        return f"bootstrap_room must be in [1, 2^63), got {room}."
    return None


def validate_pd_request(req: "Req", server_is_fake: bool) -> Optional[str]:
    """Why a PD server cannot take `req` (a 400), or None.

    A server with the fake backend takes requests without bootstrap fields (nothing to pair with).
    """
    if req.return_hidden_states or req.token_ids_logprob:
        # The first token's hidden state and chosen-id logprobs would have to travel with the KV.
        return "return_hidden_states and token_ids_logprob are not supported with PD disaggregation."
    if req.bootstrap_host is None and server_is_fake:
        return None
    return validate_bootstrap_fields(req.bootstrap_host, req.bootstrap_port, req.bootstrap_room)
