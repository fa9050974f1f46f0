"""The loopback backend: prefill and decode managers in one process, wired by a LoopbackNetwork.

Nothing moves until the test calls `pump()`: it runs the managers' background jobs (gathering
and sending KV, bootstrap lookups) and delivers messages, in order, on the caller's thread. So a
test interleaves prefill steps, pumps and decode steps exactly, and can hold back, drop or
reorder a named message type ("abort between DstInfo and the KV", "the aux row is late", "the
status message is lost") deterministically. The managers' code is the tcp backend's code.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple

from engine.disaggregation import protocol, recompute
from engine.disaggregation.bootstrap import BootstrapClient, BootstrapUnavailable
from engine.disaggregation.transport import Handler, JobRunner, Transport, TransportError


@dataclass
class _Rule:
    kind: str  # a protocol message type name: DstInfo, AbortMsg, KVFrame, AuxFrame, StatusMsg
    action: str  # "hold" or "drop"
    remaining: Optional[int] = None  # None: every matching message


@dataclass
class LoopbackNetwork:
    handlers: Dict[str, Handler] = field(default_factory=dict)
    messages: Deque[Tuple[str, List[Any]]] = field(default_factory=deque)
    held: List[Tuple[str, List[Any]]] = field(default_factory=list)
    jobs: Deque[Callable[[], None]] = field(default_factory=deque)
    rules: List[_Rule] = field(default_factory=list)
    # Bootstrap servers by addr: (session id, server info or None while ranks are missing).
    bootstrap: Dict[str, Tuple[str, Dict[str, Any]]] = field(default_factory=dict)
    down: Set[str] = field(default_factory=set)  # bootstrap addrs whose server is "dead"
    # Where a bootstrap addr's recompute requests go: the /generate body a real bootstrap server
    # posts (the test submits it to its in-process prefill scheduler).
    recompute_sinks: Dict[str, Callable[[Dict[str, Any]], bool]] = field(default_factory=dict)
    recomputes: int = 0  # recompute requests delivered
    delivered: Dict[str, int] = field(default_factory=dict)
    _names: Any = field(default_factory=itertools.count)

    # ------------------------------------------------------------------ wiring
    def transport(self, name: str) -> "LoopbackTransport":
        return LoopbackTransport(self, f"loopback://{name}-{next(self._names)}")

    def runner(self) -> "LoopbackRunner":
        return LoopbackRunner(self)

    def bootstrap_client(self) -> "LoopbackBootstrapClient":
        return LoopbackBootstrapClient(self)

    # ------------------------------------------------------------------ faults
    def hold(self, kind: str) -> None:
        """Keep every `kind` message back until release(kind)."""
        self.rules.append(_Rule(kind, "hold"))

    def drop(self, kind: str, count: Optional[int] = None) -> None:
        """Lose the next `count` (default: every) `kind` messages."""
        self.rules.append(_Rule(kind, "drop", count))

    def release(self, kind: str) -> None:
        self.rules = [r for r in self.rules if not (r.kind == kind and r.action == "hold")]
        keep = []
        for endpoint, frames in self.held:
            if protocol.kind(frames) == kind:
                self.messages.append((endpoint, frames))
            else:
                keep.append((endpoint, frames))
        self.held = keep

    def kill_bootstrap(self, addr: str) -> None:
        self.down.add(addr)

    # ------------------------------------------------------------------ delivery
    def pump(self, max_rounds: int = 1000) -> int:
        """Run jobs and deliver messages until nothing is left; returns how many things ran."""
        done = 0
        for _ in range(max_rounds):
            progressed = False
            while self.jobs:
                self.jobs.popleft()()
                done += 1
                progressed = True
            while self.messages:
                endpoint, frames = self.messages.popleft()
                self._deliver(endpoint, frames)
                done += 1
                progressed = True
            if not progressed:
                return done
        raise RuntimeError("loopback network did not settle")

    def _deliver(self, endpoint: str, frames: List[Any]) -> None:
        kind = protocol.kind(frames)
        for rule in self.rules:
            if rule.kind != kind:
                continue
            if rule.action == "hold":
                self.held.append((endpoint, frames))
                return
            if rule.remaining is None or rule.remaining > 0:
                if rule.remaining is not None:
                    rule.remaining -= 1
                return
        handler = self.handlers.get(endpoint)
        if handler is not None:
            self.delivered[kind] = self.delivered.get(kind, 0) + 1
            handler(frames)


class LoopbackTransport(Transport):
    def __init__(self, network: LoopbackNetwork, endpoint: str) -> None:
        self.network = network
        self.endpoint = endpoint

    def start(self, handler: Handler) -> None:
        self.network.handlers[self.endpoint] = handler

    def send(self, endpoint: str, frames: Sequence[Any]) -> None:
        if endpoint not in self.network.handlers:
            raise TransportError(f"no loopback endpoint {endpoint}")
        # Copy the payload: a real network would, and the sender may reuse its buffer.
        self.network.messages.append((endpoint, [bytes(f) for f in frames]))

    def close(self) -> None:
        self.network.handlers.pop(self.endpoint, None)


class LoopbackRunner(JobRunner):
    def __init__(self, network: LoopbackNetwork) -> None:
        self.network = network

    def submit(self, job: Callable[[], None]) -> None:
        self.network.jobs.append(job)


class LoopbackBootstrapClient(BootstrapClient):
    def __init__(self, network: LoopbackNetwork) -> None:
        self.network = network

    def serve(self, addr: str, tp_size: int, session_id: str) -> None:
        """Stand in for a prefill's bootstrap server at `addr` (ranks register with register())."""
        self.network.bootstrap[addr] = (session_id, {"attn_tp_size": tp_size, "ranks": {}})
        self.network.down.discard(addr)

    def register(self, addr: str, info: Dict[str, Any]) -> None:
        session, server = self.network.bootstrap[addr]
        server["ranks"][str(info["attn_tp_rank"])] = dict(info)
        first = server["ranks"].get("0", info)
        server.update(page_size=first["page_size"], kv_cache_dtype=first["kv_cache_dtype"],
                      metadata_schema_version=first["metadata_schema_version"], session_id=session)

    def fetch(self, addr: str) -> Optional[Dict[str, Any]]:
        if addr in self.network.down or addr not in self.network.bootstrap:
            raise BootstrapUnavailable(f"bootstrap server {addr} unreachable (loopback)")
        _, server = self.network.bootstrap[addr]
        if len(server["ranks"]) < server["attn_tp_size"]:
            return None
        return dict(server)

    def session(self, addr: str) -> Optional[str]:
        if addr in self.network.down or addr not in self.network.bootstrap:
            return None
        return self.network.bootstrap[addr][0]

    def recompute(self, addr: str, req: recompute.RecomputeReq) -> None:
        sink = self.network.recompute_sinks.get(addr)
        if addr in self.network.down or sink is None:
            raise BootstrapUnavailable(f"bootstrap server {addr} takes no recompute requests (loopback)")
        host, _, port = addr.rpartition(":")
        # The bytes a real bootstrap server would get, through the same bounds.
        if not sink(recompute.generate_body(recompute.decode(recompute.encode(req)), host, int(port))):
            raise BootstrapUnavailable(f"bootstrap server {addr} refused the recompute (loopback)")
        self.network.recomputes += 1
