"""The scheduler process: one per TP rank (and DP replica).

Rank 0 receives from the TokenizerManager over ZMQ and broadcasts each iteration's messages to the
other ranks; only rank 0 sends outputs. Every rank runs the same Scheduler steps.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import torch

from engine.io_struct import BatchTokenIDOutput, GetInternalStateReqOutput, decode, encode, route_to_workers
from engine.scheduler.overlap_utils import limit_omp_threads_of_this_thread
from engine.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    import zmq

    from engine.port_args import PortArgs
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)


# ====================================================================== the process
def run_scheduler_process(server_args: ServerArgs, port_args: PortArgs, gpu_id: int, tp_rank: int,
                          dp_rank: Optional[int], pipe_writer: Connection) -> None:
    """Body of one scheduler rank.

    With --tp-size N every rank runs the same Scheduler steps on the same requests: rank 0 drains
    the ZMQ input and broadcasts what it received to the other ranks over the gloo CPU group, and
    only rank 0 sends outputs (ranks > 0 never touch ZMQ).
    """
    import zmq

    from engine.distributed.parallel_state import init_distributed_environment
    from engine.utils.log_utils import configure_logging
    from engine.utils.process_utils import freeze_startup_objects, set_process_title, watch_parent

    name = f"scheduler_TP{tp_rank}" + (f"_DP{dp_rank}" if dp_rank is not None else "")
    set_process_title(name)
    configure_logging(server_args.log_level, prefix=name)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    watch_parent()
    try:
        _set_cpu_threads(server_args)
        init_distributed_environment(tp_rank, server_args.tp_size, dist_init_method(server_args, port_args),
                                     server_args.device, server_args.dist_timeout)
        tokenizer = None
        if not server_args.skip_tokenizer_init:
            from transformers import AutoTokenizer

            # Every rank needs it: stop strings decide when a request finishes.
            tokenizer = AutoTokenizer.from_pretrained(server_args.tokenizer_path or server_args.model_path)
        scheduler = Scheduler(server_args, tokenizer=tokenizer, gpu_id=gpu_id, tp_rank=tp_rank)
        if tp_rank == 0:
            recv, send, wait_for_input = _rank0_channels(zmq.Context(2), port_args, server_args.tp_size, dp_rank)
        else:
            recv, send, wait_for_input = _follower_channels()
    except Exception:
        msg = traceback.format_exc()
        logger.error("Scheduler failed to start:\n%s", msg)
        pipe_writer.send({"status": "error", "message": msg})
        sys.exit(1)

    scheduler.send_output = send
    scheduler.recv_requests = recv
    _start_watchdog(scheduler, server_args.watchdog_timeout)
    freeze_startup_objects()
    pipe_writer.send({"status": "ready", **scheduler.worker.get_worker_info()})
    try:
        scheduler.event_loop(wait_for_input)
    except Exception:
        logger.error("Scheduler TP rank %d hit an exception (a dead peer rank shows up here as a failed "
                     "collective):\n%s", tp_rank, traceback.format_exc())
        sys.exit(1)


def dist_init_method(server_args: ServerArgs, port_args: PortArgs) -> str:
    """Rendezvous of a TP group: --dist-init-addr across nodes, else a local port of this launch."""
    if server_args.dist_init_addr:
        return f"tcp://{server_args.dist_init_addr}"
    return f"tcp://127.0.0.1:{port_args.nccl_port}"


def num_local_scheduler_processes(server_args: ServerArgs) -> int:
    return max(1, server_args.tp_size // server_args.nnodes) * server_args.dp_size


def _set_cpu_threads(server_args: ServerArgs) -> None:
    """On the CPU the scheduler ranks of a node share its cores: give each an equal share.

    Without this every rank starts one intra-op thread per core and N ranks oversubscribe the
    machine N-fold (on 2 cores, tp=2 runs 1 thread per rank). --threads-per-rank overrides.
    """
    if server_args.device != "cpu":
        return
    if server_args.threads_per_rank is not None:
        threads = server_args.threads_per_rank
    else:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            cores = os.cpu_count() or 1
        threads = max(1, cores // num_local_scheduler_processes(server_args))
    torch.set_num_threads(threads)  # the forward thread's count
    # This (scheduling) thread stays at one: the forward thread's OpenMP team is the only one.
    limit_omp_threads_of_this_thread(1)
    logger.info("Using %d CPU thread(s) for this rank", threads)


def _rank0_channels(context: zmq.Context, port_args: PortArgs, tp_size: int, dp_rank: Optional[int]):
    """recv / send / wait functions of TP rank 0: ZMQ in, broadcast to the followers, ZMQ out."""
    import zmq

    from engine.distributed.parallel_state import broadcast_bytes_list
    from engine.utils.zmq_utils import get_zmq_socket

    # Through the one helper: with ZMQ's default high-water mark a slow detokenizer would block
    # `send` below, and with it the whole scheduling loop.
    # One PULL fair-queues the requests of every HTTP worker; one PUSH per worker for its replies.
    recv_sock = get_zmq_socket(context, zmq.PULL, port_args.scheduler_input_ipc_names(), bind=False)
    detok_sock = get_zmq_socket(context, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
    tok_socks = [get_zmq_socket(context, zmq.PUSH, endpoint, bind=False)
                 for endpoint in port_args.tokenizer_ipc_names()]

    def recv() -> List[Any]:
        raw: List[bytes] = []
        while True:
            try:
                raw.append(recv_sock.recv(zmq.NOBLOCK))
            except zmq.Again:
                break
        if tp_size > 1:
            broadcast_bytes_list(raw)  # every iteration, even empty: the followers' step clock
        return [decode(b) for b in raw]

    def send(msg: Any) -> None:
        if isinstance(msg, GetInternalStateReqOutput):
            msg = GetInternalStateReqOutput(internal_state=_with_rank_states(msg.internal_state, tp_size, dp_rank),
                                            http_worker=msg.http_worker)
        if isinstance(msg, BatchTokenIDOutput):
            detok_sock.send(encode(msg))
            return
        for worker, part in route_to_workers(msg, len(tok_socks)):
            tok_socks[worker].send(encode(part))

    def wait_for_input() -> None:
        recv_sock.poll(timeout=1000)

    return recv, send, wait_for_input


def _with_rank_states(state: Dict[str, Any], tp_size: int, dp_rank: Optional[int]) -> Dict[str, Any]:
    """Rank 0's state, plus every TP rank's own state under "tp_rank_states" (collective)."""
    from engine.distributed.parallel_state import gather_objects_to_rank0

    out = dict(state)
    if dp_rank is not None:
        out["dp_rank"] = dp_rank
    if tp_size > 1:
        states = gather_objects_to_rank0(state) or []
        out["tp_rank_states"] = [{**s, "tp_rank": r} for r, s in enumerate(states)]
    return out


def _follower_channels():
    """recv / send / wait functions of TP ranks > 0: rank 0's broadcast in, nothing out."""
    from engine.distributed.parallel_state import broadcast_bytes_list, gather_objects_to_rank0

    def recv() -> List[Any]:
        return [decode(b) for b in broadcast_bytes_list(None)]

    def send(msg: Any) -> None:
        if isinstance(msg, GetInternalStateReqOutput):
            gather_objects_to_rank0(msg.internal_state)  # rank 0 reports it

    def wait_for_input() -> None:
        pass  # the broadcast in recv() blocks until rank 0 steps

    return recv, send, wait_for_input


class SchedulerWatchdog:
    """Decides when a forward has made no progress for `timeout` seconds.

    A forward counts from its launch until its result is processed, so the overlap loop's last
    forward of a burst is watched too: the loop waits on it with no batch of its own scheduled
    (`cur_batch` is None). Progress is any forward launched or completed.
    """

    def __init__(self, scheduler: Scheduler, timeout: float) -> None:
        self.scheduler = scheduler
        self.timeout = timeout
        self._last_progress: Optional[Tuple[int, int]] = None
        self._last_change = 0.0

    def busy(self) -> bool:
        s = self.scheduler
        return s.cur_batch is not None or s.forward_done_ct < s.forward_ct

    def check(self, now: float) -> bool:
        """True when the watched scheduler is stuck (call with a monotonic clock)."""
        progress = (self.scheduler.forward_ct, self.scheduler.forward_done_ct)
        if not self.busy() or progress != self._last_progress:
            self._last_progress, self._last_change = progress, now
            return False
        return now - self._last_change > self.timeout


def _start_watchdog(scheduler: Scheduler, timeout: float) -> None:
    """Kill the scheduler when a forward makes no progress for `timeout` seconds."""
    watchdog = SchedulerWatchdog(scheduler, timeout)

    def run() -> None:
        watchdog.check(time.monotonic())
        while True:
            time.sleep(min(timeout / 2, 5.0))
            if watchdog.check(time.monotonic()):
                logger.error("Scheduler watchdog timeout (watchdog_timeout=%.1f s): a forward made no progress; "
                             "shutting down.", timeout)
                sys.stderr.flush()
                os._exit(1)

    threading.Thread(target=run, daemon=True, name="scheduler-watchdog").start()
