"""`python -m engine.launch_server [flags]`: the HTTP server and its child processes.

Order: parse ServerArgs (bad flags: message, exit 2, nothing started) -> bind the HTTP port (in
use: message, exit 1) -> spawn the schedulers and the detokenizer and wait for them (a failure:
message, exit 1) -> watchdog on the children -> serve HTTP with uvicorn on the bound socket. SIGTERM/SIGINT stop uvicorn, kill every child and remove the ipc directory,
then exit 0. A child that dies makes the server exit non-zero within seconds.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from engine.server_args import ServerArgs, ServerArgsError
from engine.launch.children import ChildProcesses, LaunchError
from engine.utils.log_utils import configure_logging
from engine.utils.network_utils import is_port_free
from engine.utils.process_utils import freeze_startup_objects, kill_process_tree, set_process_title

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

# Exit codes: bad arguments (argparse's own convention), failure to start, a child died.
EXIT_BAD_ARGS = 2
EXIT_LAUNCH_FAILED = 1
EXIT_CHILD_DIED = 1


def parse_server_args(argv: Optional[Sequence[str]] = None) -> ServerArgs:
    """Parse flags into ServerArgs; on any error print a clear message and exit 2."""
    parser = argparse.ArgumentParser(prog="python -m engine.launch_server",
                                     description="Serve an LLM with the engine runtime.")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)  # unknown flags: argparse prints usage and exits 2
    try:
        server_args = ServerArgs.from_cli_args(args)
        from engine.tokenizer.request_normalizer import load_chat_template

        load_chat_template(server_args.chat_template)
    except (ServerArgsError, ValueError, TypeError, OSError) as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_ARGS)
    return server_args


def _exit_on_signal(signum: int, frame: Any) -> None:
    # Unwinds through launch_server's `finally`, which stops the children.
    raise SystemExit(0)


def launch_server(server_args: ServerArgs) -> None:
    """Start the children, then serve HTTP until a signal or a child's death."""
    configure_logging(server_args.log_level)
    set_process_title("engine::main")
    # Each connection holds a descriptor: let the HTTP processes (which inherit it) hold many.
    from engine.entrypoints.http_protocol import raise_open_file_limit

    raise_open_file_limit()
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)

    if server_args.node_rank > 0:
        # Multi-node TP: the other nodes run their scheduler ranks only; node 0 serves HTTP.
        _run_worker_node(server_args)
        return

    if server_args.disaggregation_mode == "prefill" and not is_port_free(
            server_args.disaggregation_bootstrap_port, server_args.host):
        print(f"error: the bootstrap port {server_args.disaggregation_bootstrap_port} on {server_args.host} is "
              "already in use.", file=sys.stderr)
        sys.exit(EXIT_LAUNCH_FAILED)

    # The HTTP port is bound (and listening) before anything else starts, so that no port the
    # children pick for themselves (the ranks' rendezvous, transfer sockets) can take it; until
    # uvicorn serves, connections wait in the backlog.
    from engine.launch.http_workers import bind_listen_sockets

    try:
        sockets = bind_listen_sockets(server_args.host, server_args.port, server_args.tokenizer_worker_num)
    except OSError as e:
        print(f"error: port {server_args.port} on {server_args.host} is already in use ({e}).", file=sys.stderr)
        sys.exit(EXIT_LAUNCH_FAILED)
    if server_args.tokenizer_worker_num > 1:
        _serve_with_http_workers(server_args, sockets)
        return

    from engine.launch.processes import launch_subprocesses

    try:
        server_args, children, tokenizer_manager = launch_subprocesses(server_args)
    except LaunchError as e:
        print(f"error: the server failed to start: {e}", file=sys.stderr)
        _kill_descendants()
        sys.exit(EXIT_LAUNCH_FAILED)

    try:
        children.start_watchdog(lambda name, pid, code: _on_child_death(
            children, tokenizer_manager.mark_dead, name, pid, code))
        _serve_http(server_args, tokenizer_manager, sockets[0])
    finally:
        logger.info("Shutting down: stopping the child processes.")
        children.shutdown()
        tokenizer_manager.close()
        _kill_descendants()


def _serve_with_http_workers(server_args: ServerArgs, sockets: list[socket.socket]) -> None:
    """--tokenizer-worker-num > 1: this process supervises the children and the HTTP workers
    (launch/http_workers.py, one on each of `sockets`) until a signal or a death."""
    from engine.launch.processes import LaunchedChildren, launch_children
    from engine.launch.http_workers import start_http_workers, stop_http_workers

    launched: Optional[LaunchedChildren] = None
    workers: list = []
    # One try for everything after the sockets: a signal at any point (SystemExit) stops whatever
    # was started, the workers first, so that their streams end before the schedulers go.
    try:
        launched = launch_children(server_args, load_tokenizer_too=False)
        children = launched.children
        workers = start_http_workers(children, launched.server_args, launched.port_args,
                                     launched.scheduler_info, sockets)
        children.wait_ready(server_args.startup_timeout)
        for sock in sockets:
            sock.close()  # the workers hold their own
        children.start_watchdog(lambda name, pid, code: _on_child_death(
            children, lambda message: stop_http_workers(workers), name, pid, code))
        logger.info("Serving HTTP on %s with %d workers", server_args.url(), len(workers))
        freeze_startup_objects()
        while True:
            signal.pause()  # SIGTERM/SIGINT raise SystemExit through _exit_on_signal
    except LaunchError as e:
        print(f"error: the server failed to start: {e}", file=sys.stderr)
        sys.exit(EXIT_LAUNCH_FAILED)
    finally:
        for sock in sockets:
            sock.close()
        if launched is not None:
            logger.info("Shutting down: stopping the HTTP workers, then the child processes.")
            launched.children.stop_watching()
            stop_http_workers(workers)
            launched.close()
        _kill_descendants()


def _run_worker_node(server_args: ServerArgs) -> None:
    """Node rank > 0: start this node's TP ranks, then wait for a signal or a rank's death."""
    from engine.launch.processes import resolve_model_path, start_scheduler_processes
    from engine.port_args import PortArgs

    server_args = resolve_model_path(server_args)
    # Ranks > 0 never touch ZMQ: the endpoints only exist to fill PortArgs.
    port_args = PortArgs.init_new(server_args)
    children = ChildProcesses(port_args.ipc_dir)
    try:
        try:
            start_scheduler_processes(children, server_args, port_args)
            children.wait_ready(server_args.startup_timeout)
        except LaunchError as e:
            print(f"error: node {server_args.node_rank} failed to start: {e}", file=sys.stderr)
            children.shutdown()
            sys.exit(EXIT_LAUNCH_FAILED)
        logger.info("Node %d: scheduler ranks ready (rendezvous at %s); no HTTP server on this node.",
                    server_args.node_rank, server_args.dist_init_addr)
        children.start_watchdog(lambda name, pid, code: _on_worker_rank_death(children, name, pid, code))
        while True:
            signal.pause()  # SIGTERM/SIGINT raise SystemExit through _exit_on_signal
    finally:
        children.shutdown()
        _kill_descendants()


def _on_worker_rank_death(children: ChildProcesses, name: str, pid: int, exitcode: Any) -> None:
    logger.error("Child process %s (%d) died with exit code %s; shutting down this node.", name, pid, exitcode)
    try:
        children.shutdown()
        _kill_descendants()
    finally:
        logging.shutdown()
        os._exit(EXIT_CHILD_DIED)


def _serve_http(server_args: ServerArgs, tokenizer_manager: TokenizerManager, listen_socket: socket.socket) -> None:
    from engine.entrypoints.http_server import build_http_server

    server = build_http_server(server_args, tokenizer_manager)
    freeze_startup_objects()
    logger.info("Serving HTTP on %s", server_args.url())
    server.run(sockets=[listen_socket])


def _on_child_death(children: ChildProcesses, mark_dead: Callable[[str], None], name: str, pid: int,
                    exitcode: Any) -> None:
    """Watchdog thread: a dead child means the server cannot work; stop everything, non-zero.

    `mark_dead` ends the requests in flight first (the TokenizerManager's, or the HTTP workers')."""
    logger.error("Child process %s (%d) died with exit code %s; shutting down.", name, pid, exitcode)
    mark_dead(f"Child process {name} ({pid}) died with exit code {exitcode}.")
    try:
        children.shutdown()
        _kill_descendants()
    finally:
        logging.shutdown()
        os._exit(EXIT_CHILD_DIED)


def _kill_descendants() -> None:
    """Kill anything still below us (grandchildren left by a killed child, helper processes)."""
    kill_process_tree(os.getpid(), include_parent=False, timeout=2.0)


def main(argv: Optional[Sequence[str]] = None) -> None:
    server_args = parse_server_args(argv)
    launch_server(server_args)


if __name__ == "__main__":
    main()
