"""Several HTTP worker processes on one port (--tokenizer-worker-num, SGLang's flag).

One process serves HTTP by default: uvicorn, the TokenizerManager and the handling of every
streamed chunk share one core, which thousands of concurrent streams fill. With N workers the
main process binds N listening sockets to the port with SO_REUSEPORT (the kernel spreads new
connections over them), starts the schedulers and the detokenizer as usual, then N spawned
workers, each serving HTTP on its socket with a TokenizerManager of its own:

    worker k --(its own PUSH)--> scheduler rank 0 (one PULL connected to all N)
    scheduler / detokenizer --(one PUSH per worker)--> worker k, with the rows of its requests

Each message a worker sends names it (`http_worker`), and each output row and control reply
goes back to the worker that waits for it (io_struct.route_to_workers). The main process only
supervises: a child or a worker that dies stops the server (exit 1), SIGTERM/SIGINT stop the
workers gracefully (streams in flight get their final chunk), then the children.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import traceback
from multiprocessing.process import BaseProcess
from typing import Any

from engine.port_args import PortArgs

from engine.server_args import ServerArgs
from engine.launch.children import ChildProcesses, ProcessHandle, exit_before_ready
from engine.utils.log_utils import configure_logging
from engine.utils.process_utils import freeze_startup_objects, set_process_title, start_parent_death_watcher

logger = logging.getLogger(__name__)

# How long stopping workers may take to end their streams before they are killed.
WORKER_STOP_GRACE_S = 5.0


def worker_name(worker_id: int) -> str:
    return f"http_worker_{worker_id}"


def bind_listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` listening sockets on host:port, each with SO_REUSEPORT (raises OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(2048)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def start_http_workers(children: ChildProcesses, server_args: ServerArgs, port_args: PortArgs,
                       scheduler_info: dict, sockets: list[socket.socket]) -> list[BaseProcess]:
    """Spawn one worker per socket (they report ready through `children`, like any child)."""
    child_pids = [p.pid for p in children.processes() if p.pid is not None]
    return [children.start(worker_name(k), run_http_worker,
                           (server_args, port_args, scheduler_info, k, sock, child_pids))
            for k, sock in enumerate(sockets)]


def stop_http_workers(workers: list[BaseProcess], grace: float = WORKER_STOP_GRACE_S) -> None:
    """SIGTERM each worker (uvicorn's graceful shutdown: requests in flight get their final chunk),
    wait up to `grace` seconds in all; whoever is left is killed by the caller's shutdown."""
    for process in workers:
        if process.is_alive() and process.pid is not None:
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for process in workers:
        process.join(timeout=grace / max(len(workers), 1))


def run_http_worker(server_args: ServerArgs, port_args: PortArgs, scheduler_info: dict, worker_id: int,
                    listen_socket: socket.socket, child_pids: list[int], pipe_writer: Any) -> None:
    """Entry point of HTTP worker `worker_id` (multiprocessing 'spawn' target)."""
    set_process_title(f"engine::{worker_name(worker_id)}")
    configure_logging(server_args.log_level, prefix=f"HTTP{worker_id}")
    start_parent_death_watcher()
    try:
        from engine.launch.processes import load_server_tokenizer
        from engine.entrypoints.http_server import build_http_server
        from engine.tokenizer.tokenizer_manager import TokenizerManager

        tokenizer_manager = TokenizerManager(
            server_args, port_args, scheduler_info, tokenizer=load_server_tokenizer(server_args),
            child_processes=[ProcessHandle(pid) for pid in child_pids], worker_id=worker_id)
        server = build_http_server(server_args, tokenizer_manager)
    except Exception:
        message = traceback.format_exc()
        logger.error("HTTP worker %d failed to start: %s", worker_id, message)
        exit_before_ready(pipe_writer, message)
    pipe_writer.send({"status": "ready"})
    freeze_startup_objects()
    # Until uvicorn starts, connections wait in the socket's backlog (it listens already).
    try:
        server.run(sockets=[listen_socket])
    finally:
        tokenizer_manager.close()
