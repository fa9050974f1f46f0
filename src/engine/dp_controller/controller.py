"""The data-parallel controller: one process in front of `--dp-size` replicas (each a TP group).

    TokenizerManager --PUSH--> [controller] --PUSH--> replica d, TP rank 0 (one socket per replica)
    replica d --BatchTokenIDOutput--> detokenizer (directly, the controller never sees outputs)
    replica d --control replies--> [controller] --> TokenizerManager

Generate requests go to one replica (the one a DP-aware client names in routed_dp_rank, else
`round_robin` or `shortest_queue`); aborts and every control
request (io_struct.CONTROL_REQUESTS: flush_cache, get_internal_state, weights, memory, pause)
go to every replica. Control replies come back through the controller so that the
TokenizerManager, which waits for `dp_size` replies per call, always gets them grouped one per
replica and in call order, however the replicas interleave.

`shortest_queue` load of a replica = requests it reported (running + waiting) in the answer to the
controller's last GetInternalStateReq poll + requests dispatched to it after that poll was sent.
The poll rides the same FIFO socket as requests, so the report already counts everything sent
before it; finished requests leave the count at the next poll.

Like SGLang's, the controller starts its replicas' scheduler processes itself, watches them, and
exits non-zero when one dies (the launcher then takes the whole server down).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import signal
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional

from engine.io_struct import (
    CONTROL_REPLIES,
    CONTROL_REQUESTS,
    AbortReq,
    BatchEmbeddingOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    decode,
    encode,
    route_to_workers,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import zmq

    from engine.port_args import PortArgs
    from engine.server_args import ServerArgs
    from engine.launch.children import ChildProcesses

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05  # shortest_queue: how often a busy replica is asked for its queue length
CONTROLLER_CHILD_NAME = "data_parallel_controller"

_TOKENIZER = "tokenizer"  # who asked a control request: the TokenizerManager ...
_POLL = "poll"  # ... or the controller's own load poll


class LoadBalancer:
    """Chooses the replica of each request; pure bookkeeping, no sockets (unit-testable)."""

    def __init__(self, dp_size: int, method: str) -> None:
        if method not in ("round_robin", "shortest_queue"):
            raise ValueError(f"unknown load balance method {method!r}")
        self.dp_size = dp_size
        self.method = method
        self.next_rr = 0
        self.dispatched = [0] * dp_size  # requests sent to each replica, ever
        self.reported_load = [0] * dp_size  # running + waiting at the last answered poll
        self.dispatched_at_report = [0] * dp_size  # `dispatched` when that poll was sent
        self.dispatched_at_poll: Dict[int, Deque[int]] = {d: collections.deque() for d in range(dp_size)}

    def load(self, dp_rank: int) -> int:
        return self.reported_load[dp_rank] + self.dispatched[dp_rank] - self.dispatched_at_report[dp_rank]

    def choose(self) -> int:
        if self.method == "round_robin":
            dp_rank = self.next_rr
            self.next_rr = (self.next_rr + 1) % self.dp_size
        else:
            # Ties go round robin, so a burst spreads evenly before any poll has answered.
            order = [(self.next_rr + i) % self.dp_size for i in range(self.dp_size)]
            dp_rank = min(order, key=self.load)
            self.next_rr = (dp_rank + 1) % self.dp_size
        self.dispatched[dp_rank] += 1
        return dp_rank

    def assign(self, dp_rank: int) -> int:
        """A replica the client named (routed_dp_rank): counted in its load like a chosen one."""
        self.dispatched[dp_rank] += 1
        return dp_rank

    def on_poll_sent(self, dp_rank: int) -> None:
        self.dispatched_at_poll[dp_rank].append(self.dispatched[dp_rank])

    def on_poll_reply(self, dp_rank: int, state: Dict[str, Any]) -> None:
        self.dispatched_at_report[dp_rank] = self.dispatched_at_poll[dp_rank].popleft()
        self.reported_load[dp_rank] = int(state.get("num_running_reqs", 0)) + int(state.get("num_waiting_reqs", 0))


class ReplyGrouper:
    """Pairs control replies across replicas: the i-th reply of every replica answers call i."""

    def __init__(self, dp_size: int) -> None:
        self.asker: List[Deque[str]] = [collections.deque() for _ in range(dp_size)]
        self.ready: List[Deque[Any]] = [collections.deque() for _ in range(dp_size)]

    def on_request(self, dp_rank: int, asker: str) -> None:
        self.asker[dp_rank].append(asker)

    def on_reply(self, dp_rank: int, reply: Any) -> Optional[str]:
        """Record a reply; return who asked for it (the caller handles its own polls)."""
        asker = self.asker[dp_rank].popleft() if self.asker[dp_rank] else _TOKENIZER
        if asker == _TOKENIZER:
            self.ready[dp_rank].append(reply)
        return asker

    def pop_complete(self) -> List[List[Any]]:
        """Calls for which every replica has answered, each as one reply per replica."""
        groups = []
        while all(self.ready):
            groups.append([q.popleft() for q in self.ready])
        return groups


def replica_port_args(port_args: PortArgs, dp_rank: int, nccl_port: int) -> PortArgs:
    """Endpoints of one replica: its own input and control-reply sockets (served by the controller)."""
    base = os.path.dirname(port_args.scheduler_input_ipc_name[len("ipc://"):])
    return dataclasses.replace(
        port_args,
        scheduler_input_ipc_name=f"ipc://{os.path.join(base, f'scheduler_dp{dp_rank}')}",
        tokenizer_ipc_name=f"ipc://{os.path.join(base, f'dp_control_{dp_rank}')}",
        nccl_port=nccl_port,
        tokenizer_worker_num=1,  # the controller is the replica's one "tokenizer"
    )


class DataParallelController:
    def __init__(self, server_args: ServerArgs, port_args: PortArgs, context: zmq.Context) -> None:
        import zmq

        from engine.utils.zmq_utils import get_zmq_socket

        self.dp_size = server_args.dp_size
        self.balancer = LoadBalancer(self.dp_size, server_args.load_balance_method)
        self.replies = ReplyGrouper(self.dp_size)
        self.recv_from_tokenizer = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_names(),
                                                  bind=False)
        self.send_to_tokenizer = [get_zmq_socket(context, zmq.PUSH, endpoint, bind=False)
                                  for endpoint in port_args.tokenizer_ipc_names()]
        self.replica_ports: List[Any] = []
        self.send_to_replica: List[Any] = []
        self.recv_from_replica: List[Any] = []
        self.poll_outstanding = [False] * self.dp_size
        self.last_poll = [0.0] * self.dp_size
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        from engine.utils.network_utils import get_free_port

        picked: List[int] = []
        for d in range(self.dp_size):
            picked.append(get_free_port(exclude=picked))
            ports = replica_port_args(port_args, d, picked[-1])
            self.replica_ports.append(ports)
            self.send_to_replica.append(get_zmq_socket(context, zmq.PUSH, ports.scheduler_input_ipc_name, bind=True))
            sock = get_zmq_socket(context, zmq.PULL, ports.tokenizer_ipc_name, bind=True)
            self.recv_from_replica.append(sock)
            self.poller.register(sock, zmq.POLLIN)

    # ------------------------------------------------------------------ requests
    def dispatch(self, msg: Any) -> None:
        if isinstance(msg, TokenizedGenerateReqInput) and msg.options.routed_dp_rank is not None:
            # SGLang's DP-aware gateway routes itself (the TokenizerManager checked the range).
            self.send_to_replica[self.balancer.assign(msg.options.routed_dp_rank)].send(encode(msg))
        elif isinstance(msg, (TokenizedGenerateReqInput, TokenizedEmbeddingReqInput)):
            self.send_to_replica[self.balancer.choose()].send(encode(msg))
        elif isinstance(msg, CONTROL_REQUESTS):
            for d in range(self.dp_size):
                self.replies.on_request(d, _TOKENIZER)
                self.send_to_replica[d].send(encode(msg))
        elif isinstance(msg, AbortReq):
            for sock in self.send_to_replica:
                sock.send(encode(msg))
        else:
            logger.error("Data parallel controller got an unknown message %r", type(msg).__name__)

    def on_replica_message(self, dp_rank: int, msg: Any) -> None:
        if isinstance(msg, CONTROL_REPLIES):
            asker = self.replies.on_reply(dp_rank, msg)
            if asker == _POLL:
                assert isinstance(msg, GetInternalStateReqOutput)  # the poll is a get_internal_state call
                self.poll_outstanding[dp_rank] = False
                self.balancer.on_poll_reply(dp_rank, msg.internal_state)
            for group in self.replies.pop_complete():
                for reply in group:
                    self.send_to_tokenizers(reply)
        elif isinstance(msg, BatchEmbeddingOutput):
            # Embedding outputs skip the detokenizer: they reach the TokenizerManager through here.
            self.send_to_tokenizers(msg)
        else:
            logger.error("Data parallel controller got an unexpected reply %r from replica %d",
                         type(msg).__name__, dp_rank)

    def send_to_tokenizers(self, msg: Any) -> None:
        for worker, part in route_to_workers(msg, len(self.send_to_tokenizer)):
            self.send_to_tokenizer[worker].send(encode(part))

    def maybe_poll_loads(self) -> None:
        if self.balancer.method != "shortest_queue":
            return
        now = time.monotonic()
        for d in range(self.dp_size):
            if self.poll_outstanding[d] or now - self.last_poll[d] < POLL_INTERVAL_S:
                continue
            if self.balancer.load(d) == 0:
                continue  # nothing in flight there: no need to ask
            self.poll_outstanding[d] = True
            self.last_poll[d] = now
            self.replies.on_request(d, _POLL)
            self.balancer.on_poll_sent(d)
            self.send_to_replica[d].send(encode(GetInternalStateReq()))

    # ------------------------------------------------------------------ loop
    def event_loop(self) -> None:
        import zmq

        timeout_ms = int(POLL_INTERVAL_S * 1000)
        while True:
            events = dict(self.poller.poll(timeout_ms))
            if self.recv_from_tokenizer in events:
                while True:
                    try:
                        data = self.recv_from_tokenizer.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.dispatch(decode(data))
            for d, sock in enumerate(self.recv_from_replica):
                if sock in events:
                    while True:
                        try:
                            data = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self.on_replica_message(d, decode(data))
            self.maybe_poll_loads()


def run_data_parallel_controller_process(server_args: ServerArgs, port_args: PortArgs,
                                         pipe_writer: Connection) -> None:
    import zmq

    from engine.launch.children import ChildProcesses, LaunchError
    from engine.launch.tp_group import launch_tp_group
    from engine.utils.log_utils import configure_logging
    from engine.utils.process_utils import set_process_title, watch_parent

    set_process_title(CONTROLLER_CHILD_NAME)
    configure_logging(server_args.log_level, prefix="dp_controller")
    watch_parent()
    children = ChildProcesses()
    try:
        controller = DataParallelController(server_args, port_args, zmq.Context(2))
        first_names = [launch_tp_group(children, server_args, ports, dp_rank=d, gpu_offset=d * server_args.tp_size)
                       for d, ports in enumerate(controller.replica_ports)]
        infos = children.wait_ready(server_args.startup_timeout)
    except Exception as e:  # a LaunchError carries its own message; anything else its traceback
        msg = str(e) if isinstance(e, LaunchError) else traceback.format_exc()
        logger.error("Data parallel controller failed to start:\n%s", msg)
        children.shutdown()
        pipe_writer.send({"status": "error", "message": msg})
        sys.exit(1)

    def on_replica_death(name: str, pid: int, exitcode: Any) -> None:
        logger.error("Data parallel replica process %s (%d) died with exit code %s; shutting down.",
                     name, pid, exitcode)
        children.shutdown()
        logging.shutdown()
        os._exit(1)

    children.start_watchdog(on_replica_death)
    # SIGTERM from the launcher: take the replicas down with us.
    def on_sigterm(*_: Any) -> None:
        children.shutdown()
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    pipe_writer.send({"status": "ready", **infos[first_names[0]], "dp_size": server_args.dp_size})
    try:
        controller.event_loop()
    except Exception:
        logger.error("Data parallel controller hit an exception:\n%s", traceback.format_exc())
        children.shutdown()
        sys.exit(1)
