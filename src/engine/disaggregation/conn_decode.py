"""The decode side of a KV transfer: DecodeKVManager (one per scheduler rank) and KVReceiver.

Threads: the transport's listener copies arriving KV frames into the destination slots (receiver-
side scatter) and the metadata row into its table; the control runner reads prefill bootstrap
information (never on the scheduler thread); the IO runner sends destinations and aborts; the
heartbeat (tcp) watches every prefill this server talks to. The scheduler thread creates
receivers, polls them and publishes destinations, and never waits on the network.

Write fence: a room's frames are copied under the room's lock, and abort/clear take the same lock
and mark the room dead first. So once a request is aborted or cleared here, no frame can write its
slots any more, and they can be freed at once (no deferred release, unlike one-sided RDMA).
"""

from __future__ import annotations

import logging
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import msgspec
import torch

from engine.disaggregation import protocol
from engine.disaggregation.allowlist import PrefillAllowlist
from engine.disaggregation.base import FailureCause, KVPoll, StatusTable
from engine.disaggregation.bootstrap import BootstrapClient, BootstrapUnavailable
from engine.disaggregation.conn_common import KVArgs, KVReceiver, TransferConfig, TransferTimes, now
from engine.disaggregation.kv_io import KVLayout, checksum, pair_ranks, scatter_kv, split_payload
from engine.disaggregation.metadata import METADATA_SCHEMA_VERSION
from engine.disaggregation.protocol import AbortMsg, AuxFrame, DstInfo, KVFrame, StatusMsg
from engine.disaggregation.recompute import RecomputeReq
from engine.disaggregation.transport import JobRunner, Transport, TransportError

logger = logging.getLogger(__name__)

# What a client learns when its prefill cannot be used: the same words whether the address is
# refused, closed, filtered, unreachable or answers something that is not a bootstrap server, so
# the decode server cannot be used to map a network (the detail goes to this server's log).
UNREACHABLE = "the prefill's bootstrap server at {addr} is not reachable"
# A bound on what a bootstrap answer may claim (pairing loops over the prefill's ranks).
MAX_PREFILL_TP_SIZE = 4096


@dataclass
class PrefillPeer:
    """What this decode rank knows of one prefill server (by bootstrap address)."""

    addr: str
    session_id: str
    endpoint: str  # the prefill rank this decode rank pulls from
    prefill_rank: int
    head_start: int
    num_heads: int
    required_dst_num: int  # decode ranks served by that prefill rank


@dataclass
class _Room:
    room: int
    addr: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    alive: bool = True
    peer: Optional[PrefillPeer] = None
    slots: Optional[torch.Tensor] = None
    aux_index: int = -1
    expected: int = 0
    received: int = 0
    received_bytes: int = 0
    dst_sent: bool = False


class DecodeKVManager:
    def __init__(self, kv_args: KVArgs, transport: Transport, io_runner: JobRunner, control_runner: JobRunner,
                 bootstrap_client: BootstrapClient, config: TransferConfig,
                 allowlist: Optional[PrefillAllowlist] = None) -> None:
        self.kv_args = kv_args
        # The loopback backend's tests name in-process prefills; every real server passes one.
        self.allowlist = allowlist or PrefillAllowlist.parse(None)
        self.transport = transport
        self.io_runner = io_runner
        self.control_runner = control_runner
        self.bootstrap_client = bootstrap_client
        self.config = config
        self.status = StatusTable()
        self._lock = threading.Lock()
        self._rooms: Dict[int, _Room] = {}
        self._peers: Dict[str, PrefillPeer] = {}
        self._peer_errors: Dict[str, Tuple[str, float]] = {}  # addr -> (why given up, when)
        self._fetching: Dict[str, bool] = {}
        self._attempts: Dict[str, int] = {}
        self._last_attempt: Dict[str, float] = {}
        self._misses: Dict[str, int] = {}
        self.late_frames = 0  # frames for rooms that were aborted or cleared (dropped)
        self.transport.start(self._on_message)

    # ------------------------------------------------------------------ prefill discovery
    def refusal(self, host: str, port: int) -> Optional[str]:
        """Why a request may not name this prefill (a 400 before anything is fetched), or None."""
        if self.allowlist.allows(host, port):
            return None
        return (f"bootstrap_host {host}:{port} is not an allowed prefill server of this decode server "
                "(--disaggregation-prefill-allowlist)")

    def peer(self, addr: str, since: float) -> Optional[PrefillPeer]:
        """The prefill at `addr` if known; starts (at most once per interval) a lookup if not.

        Raises BootstrapUnavailable for a request created at `since` when the lookups for `addr`
        gave up after it arrived; a newer request starts a fresh series of attempts (the prefill
        may be back).
        """
        host, _, port = addr.rpartition(":")
        refusal = self.refusal(host, int(port) if port.isdigit() else 0)
        if refusal is not None:  # the scheduler refuses such requests first; this guards every path
            raise BootstrapUnavailable(refusal)
        with self._lock:
            peer = self._peers.get(addr)
            if peer is not None:
                return peer
            error = self._peer_errors.get(addr)
            if error is not None:
                if error[1] >= since:
                    raise BootstrapUnavailable(error[0])
                del self._peer_errors[addr]
                self._attempts[addr] = 0
            due = now() - self._last_attempt.get(addr, -1e9) >= self.config.ensure_info_interval
            if self._fetching.get(addr) or not due:
                return None
            self._fetching[addr] = True
            self._last_attempt[addr] = now()
        self.control_runner.submit(lambda: self._fetch(addr))
        return None

    def _fetch(self, addr: str) -> None:
        attempts_left = True
        try:
            info = self.bootstrap_client.fetch(addr)
            peer = self._make_peer(addr, info) if info is not None else None
            # A prefill still starting answers 503, like any web server might: the same words.
            error = None if info is not None else UNREACHABLE.format(addr=addr)
        except BootstrapUnavailable as e:
            logger.info("PD bootstrap lookup of %s failed: %s", addr, e)
            peer, error = None, UNREACHABLE.format(addr=addr)
        except ValueError as e:
            # Two servers that cannot pair will not learn to: no retries.
            peer, error, attempts_left = None, f"cannot pair with the prefill at {addr}: {e}", False
            self._fail_addr(addr, error, FailureCause.CONFIG)
        with self._lock:
            self._fetching[addr] = False
            if peer is not None:
                # Only prefills learnt here may send KV and status frames to this rank.
                self.transport.allow_peer(peer.endpoint)
                self._peers[addr] = peer
                self._attempts[addr] = 0
                self._misses[addr] = 0
                self._peer_errors.pop(addr, None)
                return
            assert error is not None  # without a peer, each branch above says why
            self._attempts[addr] = self._attempts.get(addr, 0) + 1
            if not attempts_left or self._attempts[addr] >= self.config.ensure_info_retries:
                message = error if not attempts_left else f"{error} ({self._attempts[addr]} attempts)"
                self._peer_errors[addr] = (message, now())

    def _make_peer(self, addr: str, info: Dict[str, Any]) -> PrefillPeer:
        """Pair with a bootstrap answer: BootstrapUnavailable when it is not one (whatever listens
        there is not a prefill), ValueError when it is one this server cannot pair with."""
        try:
            version = info["metadata_schema_version"]
            theirs = KVLayout.from_dict(info["ranks"]["0"]["kv_layout"])
            endpoints = {rank: str(entry["endpoint"]) for rank, entry in info["ranks"].items()}
            if not (isinstance(theirs.tp_size, int) and 1 <= theirs.tp_size <= MAX_PREFILL_TP_SIZE):
                raise ValueError(f"TP size {theirs.tp_size!r}")
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise BootstrapUnavailable(f"not a bootstrap answer: {e!r}") from None
        if version != METADATA_SCHEMA_VERSION:
            raise ValueError(f"metadata schema {version} != ours {METADATA_SCHEMA_VERSION}")
        ours = self.kv_args.layout
        rank, head_start, num_heads = pair_ranks(theirs, ours)
        served = sum(1 for d in range(ours.tp_size)
                     if pair_ranks(theirs, KVLayout(**{**ours.to_dict(), "tp_rank": d}))[0] == rank)
        if str(rank) not in endpoints:
            raise BootstrapUnavailable(f"the bootstrap answer lacks rank {rank}")
        return PrefillPeer(addr=addr, session_id=str(info.get("session_id", "")),
                           endpoint=endpoints[str(rank)], prefill_rank=rank,
                           head_start=head_start, num_heads=num_heads, required_dst_num=served)

    # ------------------------------------------------------------------ heartbeat
    def heartbeat_once(self) -> None:
        """Probe every known prefill; one that misses max_failures probes in a row (or restarted
        with a new session) fails every room still waiting for it."""
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            session = self.bootstrap_client.session(peer.addr)
            if session == peer.session_id:
                self._misses[peer.addr] = 0
                continue
            misses = self._misses.get(peer.addr, 0) + 1
            self._misses[peer.addr] = misses
            if session is not None or misses >= self.config.heartbeat_max_failures:
                what = "restarted" if session is not None else f"missed {misses} heartbeats"
                self.node_failed(peer.addr, f"the prefill server at {peer.addr} {what}")

    def node_failed(self, addr: str, reason: str) -> None:
        logger.warning("%s: failing the requests that wait for its KV", reason)
        with self._lock:
            peer = self._peers.pop(addr, None)
            self._last_attempt.pop(addr, None)  # a replacement may be up already: look at once
        if peer is not None:
            self.io_runner.submit(lambda: self.transport.forget(peer.endpoint))
        self._fail_addr(addr, reason, FailureCause.PEER_DEAD)

    def _fail_addr(self, addr: str, reason: str, cause: FailureCause) -> None:
        with self._lock:
            rooms = [r for r in self._rooms.values() if r.addr == addr]
        for room in rooms:
            if self.status.get(room.room) != KVPoll.Success:
                self.status.fail(room.room, reason, cause)

    # ------------------------------------------------------------------ scheduler thread
    def add_room(self, room: int, addr: str) -> _Room:
        state = _Room(room=room, addr=addr)
        with self._lock:
            self._rooms[room] = state
        self.status.register(room, KVPoll.Bootstrapping)
        return state

    def has_room(self, room: int) -> bool:
        with self._lock:
            return room in self._rooms

    def send_dst(self, state: _Room, slots: torch.Tensor, aux_index: int) -> None:
        peer = state.peer
        assert peer is not None, "destination published before the prefill was found"
        with state.lock:
            state.slots = slots.to("cpu", dtype=torch.int64).clone()
            state.aux_index = aux_index
            state.expected = len(slots)
            state.dst_sent = True
        dst = DstInfo(room=state.room, endpoint=self.transport.endpoint, num_tokens=len(slots), decode_prefix_len=0,
                      aux_index=aux_index, decode_tp_rank=self.kv_args.layout.tp_rank,
                      required_dst_num=peer.required_dst_num, head_start=peer.head_start, num_heads=peer.num_heads)
        self._send(peer.endpoint, protocol.encode(dst), state.room)

    def request_recompute(self, state: _Room, req: RecomputeReq) -> None:
        """Ask the room's prefill (its bootstrap server) to recompute the KV, off this thread;
        a refusal or an unreachable server fails the room (then the request ends with a 500)."""
        def job() -> None:
            try:
                self.bootstrap_client.recompute(state.addr, req)
            except BootstrapUnavailable as e:
                logger.warning("Re-bootstrap of room %d failed: %s", state.room, e)
                self.status.fail(state.room, f"the prefill did not take the recompute request: {e}",
                                 FailureCause.BOOTSTRAP)

        self.control_runner.submit(job)

    def abort_room(self, state: _Room, reason: str, cause: FailureCause) -> None:
        with state.lock:  # the fence: no frame writes this room's slots after this
            state.alive = False
            # Once the prefill is known it is told, destination sent or not: it drops the
            # request at once instead of waiting for its bootstrap timeout.
            peer = state.peer  # set once, never unset
        self.status.fail(state.room, reason, cause)
        if peer is not None:
            # The reason is cut so the message stays far below the prefill's frame limit.
            self._send(peer.endpoint, protocol.encode(AbortMsg(room=state.room, endpoint=self.transport.endpoint,
                                                                    reason=reason[:1000])), None)

    def clear(self, state: _Room) -> None:
        with state.lock:
            state.alive = False
        with self._lock:
            if self._rooms.get(state.room) is state:
                del self._rooms[state.room]
        self.status.clear(state.room)

    def idle_state(self) -> Dict[str, int]:
        with self._lock:
            return {"rooms": len(self._rooms), "statuses": len(self.status)}

    def close(self) -> None:
        self.io_runner.close()
        self.control_runner.close()
        self.transport.close()

    def _send(self, endpoint: str, frames: List[Any], room: Optional[int]) -> None:
        def job() -> None:
            try:
                self.transport.send(endpoint, frames)
            except TransportError as e:
                if room is not None:
                    self.status.fail(room, f"cannot reach the prefill server: {e}", FailureCause.PEER_DEAD)

        self.io_runner.submit(job)

    # ------------------------------------------------------------------ listener thread
    def _on_message(self, frames: List[Any]) -> None:
        try:
            header, payload = protocol.decode(frames)
        except (msgspec.DecodeError, IndexError):
            logger.warning("Dropped an undecodable KV transfer message")
            return
        with self._lock:
            state = self._rooms.get(header.room)
        if state is None:
            self.late_frames += 1
            return
        if isinstance(header, KVFrame):
            self._on_kv(state, header, payload)
        elif isinstance(header, AuxFrame):
            self._on_aux(state, header, payload)
        elif isinstance(header, StatusMsg):
            self._on_status(state, header)
        else:
            logger.warning("Decode got an unexpected %s", type(header).__name__)

    def _on_kv(self, state: _Room, frame: KVFrame, payload: Any) -> None:
        with state.lock:
            if not state.alive or state.slots is None:
                self.late_frames += 1
                return
            error = None
            if frame.token_offset != state.received or frame.token_offset + frame.num_tokens > state.expected:
                error = (f"KV frame for tokens [{frame.token_offset}, {frame.token_offset + frame.num_tokens}) "
                         f"after {state.received} of {state.expected} tokens (lost or reordered frame)")
            elif payload is None or checksum(payload) != frame.crc:
                error = "KV frame checksum mismatch"
            if error is None:
                peer = state.peer
                assert peer is not None  # KV arrives only after send_dst, which needs the peer
                try:
                    data, features = split_payload(payload, self.kv_args.layout, frame.num_tokens, peer.num_heads)
                except ValueError as e:
                    error = str(e)
            if error is None:
                slots = state.slots[frame.token_offset:frame.token_offset + frame.num_tokens]
                scatter_kv(self.kv_args.pool, slots, data)
                if features is not None:
                    assert self.kv_args.features is not None  # the layouts paired: both send features
                    self.kv_args.features.scatter_features(slots, features)
                state.received += frame.num_tokens
                state.received_bytes += len(payload)
                return
        self.status.fail(state.room, error, FailureCause.CORRUPT)

    def _on_aux(self, state: _Room, frame: AuxFrame, payload: Any) -> None:
        with state.lock:
            if not state.alive:
                self.late_frames += 1
                return
            if payload is not None and checksum(payload) == frame.crc and frame.aux_index == state.aux_index:
                self.kv_args.metadata.write_row_bytes(state.aux_index, bytes(payload))
                return
        self.status.fail(state.room, "metadata row checksum or index mismatch", FailureCause.CORRUPT)

    def _on_status(self, state: _Room, msg: StatusMsg) -> None:
        if not msg.success:
            cause = FailureCause(msg.cause) if msg.cause in FailureCause._value2member_map_ else \
                FailureCause.PEER_FAILED
            self.status.fail(state.room, f"prefill server: {msg.reason}", cause)
            return
        with state.lock:
            complete = state.alive and state.received == state.expected
            got, want = state.received, state.expected
        if complete:
            self.status.update(state.room, KVPoll.Success)
        else:
            self.status.fail(state.room, f"transfer ended after {got} of {want} tokens", FailureCause.CORRUPT)


class DecodeKVReceiver(KVReceiver):
    def __init__(self, manager: DecodeKVManager, room: int, addr: str) -> None:
        self.manager = manager
        self.room = room
        self.times = TransferTimes(created=now())
        self.state = manager.add_room(room, addr)

    def _since_bootstrapped(self) -> float:
        assert self.times.bootstrapped is not None  # set when the status became WaitingForInput
        return now() - self.times.bootstrapped

    def poll(self) -> KVPoll:
        status = self.manager.status.get(self.room)
        config = self.manager.config
        if status == KVPoll.Bootstrapping:
            status = self._try_bootstrap()
        elif status == KVPoll.WaitingForInput and self._since_bootstrapped() > config.bootstrap_timeout:
            # The prefill gave up on this request by now: decode memory stayed short too long.
            self.abort(f"no decode memory for this request within {config.bootstrap_timeout:g} s "
                       "(the prefill's bootstrap timeout)", FailureCause.TIMEOUT)
            return KVPoll.Failed
        elif status in (KVPoll.Transferring, KVPoll.WaitingForInput) and self.times.dst_sent is not None \
                and now() - self.times.dst_sent > config.waiting_timeout:
            self.abort(f"the KV did not arrive within {config.waiting_timeout:g} s (waiting timeout)",
                       FailureCause.TIMEOUT)
            return KVPoll.Failed
        if status not in (KVPoll.Failed, KVPoll.Success) and config.failure_prob > 0 \
                and random.random() < config.failure_prob:
            self.abort("injected transfer failure", FailureCause.INJECTED)
            return KVPoll.Failed
        return status

    def _try_bootstrap(self) -> KVPoll:
        try:
            peer = self.manager.peer(self.state.addr, self.times.created)
        except BootstrapUnavailable as e:
            self.manager.status.fail(self.room, str(e), FailureCause.BOOTSTRAP)
            return KVPoll.Failed
        if peer is None:
            return self.manager.status.get(self.room)
        self.state.peer = peer
        self.manager.status.update(self.room, KVPoll.WaitingForInput)
        self.times.bootstrapped = now()
        return self.manager.status.get(self.room)

    def send_metadata(self, slots: torch.Tensor, aux_index: int) -> None:
        self.times.dst_sent = now()
        self.manager.status.update(self.room, KVPoll.Transferring)
        self.manager.send_dst(self.state, slots, aux_index)

    def request_recompute(self, req: RecomputeReq) -> None:
        # One request per room, as SGLang's leader rank: the prefill's ranks send every decode
        # rank its part of the one recomputed KV.
        if self.manager.kv_args.layout.tp_rank == 0:
            self.manager.request_recompute(self.state, req)

    def abort(self, reason: str, cause: FailureCause = FailureCause.ABORTED) -> None:
        self.manager.abort_room(self.state, reason, cause)

    def failure(self) -> Optional[Tuple[str, FailureCause]]:
        return self.manager.status.failure(self.room)

    def clear(self) -> None:
        self.times.done = self.times.done or now()
        self.manager.clear(self.state)

    def received_bytes(self) -> int:
        return self.state.received_bytes
