"""The prefill side of a KV transfer: PrefillKVManager (one per scheduler rank) and KVSender.

Threads: the transport's listener files the decode side's DstInfo / AbortMsg messages; the IO
runner gathers KV from the pool and sends the frames; the scheduler thread only creates senders,
polls them and hands over finished prefills (`send`), and never waits on the network.

A room becomes WaitingForInput once every decode rank that needs it sent its destination (then
the scheduler may prefill it: back-pressure from decode memory reaches the prefill), and Success
once all frames, the metadata row and the status went out. A DstInfo may arrive before the
request reaches this server (the router sends both halves at once): it is kept until the sender
appears or the bootstrap timeout passes. A failure here is reported to the decode side when its
destination is known, and remembered for a while so a destination that arrives later is answered
with the failure instead of waiting for a timeout.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections import OrderedDict
from typing import Dict, List, Optional, Tuple

import msgspec
import torch

from engine.disaggregation import protocol
from engine.disaggregation.base import FailureCause, KVPoll, StatusTable
from engine.disaggregation.bootstrap import BootstrapClient
from engine.disaggregation.conn_common import (
    KVArgs,
    KVSender,
    TransferConfig,
    TransferTimes,
    now,
    registration_info,
)
from engine.disaggregation.kv_io import checksum, frame_payload, frame_token_count, gather_kv
from engine.disaggregation.metrics import DisaggMetrics
from engine.disaggregation.protocol import AbortMsg, AuxFrame, DstInfo, KVFrame, StatusMsg
from engine.disaggregation.transport import JobRunner, Transport, TransportError

logger = logging.getLogger(__name__)

# How many failed rooms are remembered to answer late destinations.
FAILED_ROOMS_KEPT = 4096
# Destinations kept for requests that have not reached this server yet: the oldest go first, so
# a flood of made-up rooms costs a bounded amount of memory (each is ~200 bytes).
MAX_ORPHAN_ROOMS = 4096
# A bound on the TP size a destination may claim (it sizes a per-room table).
MAX_DECODE_TP_SIZE = 4096
MAX_ENDPOINT_CHARS = 512


class PrefillKVManager:
    def __init__(self, kv_args: KVArgs, transport: Transport, io_runner: JobRunner,
                 bootstrap_client: BootstrapClient, bootstrap_addr: str, config: TransferConfig,
                 metrics: DisaggMetrics) -> None:
        self.kv_args = kv_args
        self.transport = transport
        self.io_runner = io_runner
        self.bootstrap_client = bootstrap_client
        self.bootstrap_addr = bootstrap_addr
        self.config = config
        self.metrics = metrics
        self.status = StatusTable()
        self._lock = threading.Lock()
        self._dsts: Dict[int, Dict[int, DstInfo]] = {}
        self._orphan_since: Dict[int, float] = {}  # destinations that arrived before their request
        self._failed: "OrderedDict[int, Tuple[str, FailureCause]]" = OrderedDict()
        self.late_messages = 0
        self.transport.start(self._on_message)

    def register(self) -> None:
        """Publish this rank's endpoint on the bootstrap server (blocking; at start-up)."""
        self.bootstrap_client.register(self.bootstrap_addr, registration_info(self.kv_args, self.transport.endpoint))

    # ------------------------------------------------------------------ listener thread
    def _on_message(self, frames: List[object]) -> None:
        try:
            header, _ = protocol.decode(frames)
        except (msgspec.DecodeError, IndexError):
            logger.warning("Dropped an undecodable KV transfer message")
            return
        if isinstance(header, DstInfo):
            self._on_dst(header)
        elif isinstance(header, AbortMsg):
            self._on_abort(header)
        else:
            logger.warning("Prefill got an unexpected %s", type(header).__name__)

    def _on_dst(self, dst: DstInfo) -> None:
        if not (0 <= dst.decode_tp_rank < MAX_DECODE_TP_SIZE and 1 <= dst.required_dst_num <= MAX_DECODE_TP_SIZE
                and dst.num_tokens >= 0
                and 0 <= dst.head_start and 1 <= dst.num_heads and len(dst.endpoint) <= MAX_ENDPOINT_CHARS):
            logger.warning("Dropped a malformed destination for room %d", dst.room)
            return
        with self._lock:
            failed = self._failed.get(dst.room)
            if failed is None:
                rooms = self._dsts.setdefault(dst.room, {})
                known = rooms.get(dst.decode_tp_rank)
                if known is None and rooms and len(rooms) >= next(iter(rooms.values())).required_dst_num:
                    logger.warning("Dropped an extra destination of room %d from %s", dst.room, dst.endpoint[:200])
                    return
                if known is not None and known.endpoint != dst.endpoint:
                    # First come, first served: a second sender cannot redirect a room's KV.
                    logger.warning("Dropped a destination of room %d from %s: %s sent one first",
                                   dst.room, dst.endpoint[:200], known.endpoint)
                    return
                rooms[dst.decode_tp_rank] = dst
                if dst.room not in self.status:
                    self._orphan_since.setdefault(dst.room, now())
                    self._evict_orphans()
                ready = _all_destinations(rooms)
        if failed is not None:
            self._notify_failure([dst], failed[0], failed[1])
        elif ready:
            self.status.update(dst.room, KVPoll.WaitingForInput)

    def _evict_orphans(self) -> None:
        """Keep at most MAX_ORPHAN_ROOMS orphan destinations (the oldest go; caller holds the lock)."""
        while len(self._orphan_since) > MAX_ORPHAN_ROOMS:
            room = next(iter(self._orphan_since))  # insertion order: the oldest
            self._orphan_since.pop(room)
            self._dsts.pop(room, None)

    def _on_abort(self, msg: AbortMsg) -> None:
        with self._lock:
            dsts = self._dsts.get(msg.room, {})
            foreign = bool(dsts) and all(d.endpoint != msg.endpoint for d in dsts.values())
        if foreign:
            # Only a decode rank that sent this room's destination may abort it.
            logger.warning("Dropped an abort of room %d from %s, which is not its decode server",
                           msg.room, msg.endpoint[:200])
            return
        # The decode side fenced its writes; stopping here only saves work.
        self._remember_failure(msg.room, msg.reason, FailureCause.ABORTED)
        self.status.fail(msg.room, msg.reason, FailureCause.ABORTED)
        with self._lock:
            if msg.room not in self.status:
                self._dsts.pop(msg.room, None)
                self._orphan_since.pop(msg.room, None)

    # ------------------------------------------------------------------ scheduler thread
    def add_sender(self, room: int) -> None:
        self.status.register(room, KVPoll.Bootstrapping)
        with self._lock:
            failed = self._failed.get(room)
            self._orphan_since.pop(room, None)
            ready = _all_destinations(self._dsts.get(room))
        if failed is not None:
            self.status.fail(room, failed[0], failed[1])
        elif ready:
            self.status.update(room, KVPoll.WaitingForInput)

    def destinations(self, room: int) -> List[DstInfo]:
        with self._lock:
            return list(self._dsts.get(room, {}).values())

    def send(self, room: int, slots: torch.Tensor, aux: bytes, aux_crc: int) -> None:
        dsts = self.destinations(room)
        self.status.update(room, KVPoll.Transferring)
        slots = slots.to("cpu", dtype=torch.int64).clone()  # the row may change after we return
        self.io_runner.submit(lambda: self._send_job(room, slots, aux, aux_crc, dsts))

    def fail_room(self, room: int, reason: str, cause: FailureCause) -> None:
        """This side gave up on `room`: mark it and tell the decode side (now or when it asks)."""
        self._remember_failure(room, reason, cause)
        if self.status.fail(room, reason, cause):
            dsts = self.destinations(room)
            if dsts:
                self._notify_failure(dsts, reason, cause)

    def clear(self, room: int) -> None:
        self.status.clear(room)
        with self._lock:
            self._dsts.pop(room, None)
            self._orphan_since.pop(room, None)

    def prune(self) -> None:
        """Forget destinations whose request never arrived (bootstrap timeout)."""
        deadline = now() - self.config.bootstrap_timeout
        with self._lock:
            stale = [room for room, t in self._orphan_since.items() if t < deadline]
            for room in stale:
                self._orphan_since.pop(room, None)
                self._dsts.pop(room, None)

    def idle_state(self) -> Dict[str, int]:
        with self._lock:
            return {"rooms": len(self.status), "destinations": len(self._dsts)}

    def close(self) -> None:
        self.io_runner.close()
        self.transport.close()

    # ------------------------------------------------------------------ IO runner thread
    def _send_job(self, room: int, slots: torch.Tensor, aux: bytes, aux_crc: int, dsts: List[DstInfo]) -> None:
        start = time.perf_counter()
        sent_bytes = 0
        try:
            for dst in dsts:
                sent = self._send_to(room, slots, aux, aux_crc, dst)
                if sent < 0:
                    return
                sent_bytes += sent
        except TransportError as e:
            self.fail_room(room, f"KV transfer to the decode server failed: {e}", FailureCause.PEER_DEAD)
            return
        seconds = time.perf_counter() - start
        self.metrics.observe_sent(sent_bytes, seconds)
        self.status.update(room, KVPoll.Success)
        logger.debug("KV of room %d sent to %d decode rank(s): %d bytes in %.1f ms", room, len(dsts), sent_bytes,
                     seconds * 1e3)

    def _send_to(self, room: int, slots: torch.Tensor, aux: bytes, aux_crc: int, dst: DstInfo) -> int:
        """All frames of `room` for one decode rank (bytes sent); -1 when the room failed meanwhile."""
        start = dst.decode_prefix_len
        if len(slots) - start != dst.num_tokens:
            self.fail_room(room, f"the decode side expects {dst.num_tokens} tokens, the prefill has "
                                 f"{len(slots) - start}", FailureCause.CORRUPT)
            return -1
        pool = self.kv_args.pool
        per_token = self.kv_args.layout.bytes_per_token(dst.num_heads)
        step = frame_token_count(per_token)
        sent = 0
        for offset in range(0, dst.num_tokens, step):
            if self.status.get(room) == KVPoll.Failed:
                return -1  # aborted: the decode side drops whatever is still in flight
            if self.config.frame_delay_s > 0:
                time.sleep(self.config.frame_delay_s)
            count = min(step, dst.num_tokens - offset)
            frame_slots = slots[start + offset:start + offset + count]
            data = gather_kv(pool, frame_slots, dst.head_start, dst.num_heads)
            features = self.kv_args.features
            payload = frame_payload(data, None if features is None else features.gather_features(frame_slots))
            header = KVFrame(room=room, token_offset=offset, num_tokens=count, crc=checksum(payload))
            self.transport.send(dst.endpoint, protocol.encode(header, payload))
            sent += payload.nbytes
        if self.status.get(room) == KVPoll.Failed:
            return -1
        self.transport.send(dst.endpoint, protocol.encode(AuxFrame(room=room, aux_index=dst.aux_index, crc=aux_crc),
                                                          aux))
        self.transport.send(dst.endpoint, protocol.encode(StatusMsg(room=room, success=True,
                                                                    prefill_rank=self.kv_args.layout.tp_rank)))
        return sent

    def _notify_failure(self, dsts: List[DstInfo], reason: str, cause: FailureCause) -> None:
        rank = self.kv_args.layout.tp_rank

        def job() -> None:
            for dst in dsts:
                try:
                    self.transport.send(dst.endpoint, protocol.encode(StatusMsg(
                        room=dst.room, success=False, prefill_rank=rank, reason=reason, cause=cause.value)))
                except TransportError:
                    pass  # the decode side is gone too; its own timeout ends the request

        self.io_runner.submit(job)

    def _remember_failure(self, room: int, reason: str, cause: FailureCause) -> None:
        with self._lock:
            self._failed[room] = (reason, cause)
            self._failed.move_to_end(room)
            while len(self._failed) > FAILED_ROOMS_KEPT:
                self._failed.popitem(last=False)


class PrefillKVSender(KVSender):
    def __init__(self, manager: PrefillKVManager, room: int) -> None:
        self.manager = manager
        self.room = room
        self.times = TransferTimes(created=now())
        manager.add_sender(room)

    def poll(self) -> KVPoll:
        status = self.manager.status.get(self.room)
        config = self.manager.config
        if status == KVPoll.Bootstrapping and now() - self.times.created > config.bootstrap_timeout:
            self.manager.fail_room(self.room, f"the decode side did not reserve memory for this request within "
                                              f"{config.bootstrap_timeout:g} s (bootstrap timeout)",
                                   FailureCause.TIMEOUT)
            return KVPoll.Failed
        if status not in (KVPoll.Failed, KVPoll.Success) and config.failure_prob > 0 \
                and random.random() < config.failure_prob:
            self.manager.fail_room(self.room, "injected transfer failure", FailureCause.INJECTED)
            return KVPoll.Failed
        if status >= KVPoll.WaitingForInput and self.times.bootstrapped is None:
            self.times.bootstrapped = now()
        return status

    def send(self, slots: torch.Tensor, aux: bytes) -> None:
        self.manager.send(self.room, slots, aux, checksum(aux))

    def abort(self, reason: str, cause: FailureCause = FailureCause.ABORTED) -> None:
        self.manager.fail_room(self.room, reason, cause)

    def failure(self) -> Optional[Tuple[str, FailureCause]]:
        return self.manager.status.failure(self.room)

    def clear(self) -> None:
        self.manager.clear(self.room)


def _all_destinations(dsts: Optional[Dict[int, DstInfo]]) -> bool:
    """Every decode rank that needs this prefill rank's KV sent its destination."""
    return bool(dsts and len(dsts) >= next(iter(dsts.values())).required_dst_num)
