"""The server's child processes: start with a ready-pipe, wait for readiness, watch, tear down.

Every child (schedulers, detokenizer) gets the write end of a one-way Pipe and reports
`{"status": "ready", ...}` or `{"status": "error", "message": ...}` on it. A watchdog thread
reports the first child that dies after startup so the owner can stop the whole server.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Iterator, NoReturn, Optional

from engine.utils.process_utils import kill_process_tree

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.2


class LaunchError(RuntimeError):
    """A child failed to start (reported an error, died, or never became ready)."""


@dataclass
class Child:
    name: str
    process: BaseProcess
    reader: Connection
    ready: bool = False


class ChildProcesses:
    def __init__(self, ipc_dir: Optional[str] = None) -> None:
        self.ctx = multiprocessing.get_context("spawn")
        self.children: list[Child] = []
        self.ipc_dir = ipc_dir
        self._stopping = threading.Event()
        self._watchdog: Optional[threading.Thread] = None
        self._shutdown_lock = threading.Lock()
        self._shut_down = False

    # ------------------------------------------------------------------ start
    def start(self, name: str, target: Callable, args: tuple) -> BaseProcess:
        """Start `target(*args, pipe_writer)` in a spawned process named `name`.

        Children ignore SIGINT: Ctrl-C on a terminal signals the whole foreground process group,
        and the stop is the owner's to make (it kills the children); a child dying of
        KeyboardInterrupt would turn the graceful exit into a child-death exit with tracebacks.
        """
        reader, writer = self.ctx.Pipe(duplex=False)
        process = self.ctx.Process(target=_ignore_sigint_then_run, args=(target, *args, writer), name=name)
        with _sigint_ignored_if_main_thread(), _passive_openmp_waits():
            # A spawned interpreter keeps an ignored SIGINT ignored from its first instruction,
            # so a Ctrl-C while it imports (seconds, for torch) does not interrupt it either.
            process.start()
        # Drop our copy of the write end, so that a child dying before it reports gives EOF.
        writer.close()
        self.children.append(Child(name, process, reader))
        logger.debug("Started %s (pid %d)", name, process.pid)
        return process

    def wait_ready(self, timeout: float) -> dict[str, dict]:
        """Wait for the ready message of every child not yet ready; raise LaunchError on the first
        failure. Returns the messages of the children that became ready."""
        deadline = time.monotonic() + timeout
        infos: dict[str, dict] = {}
        pending = [c for c in self.children if not c.ready]
        while pending:
            for child in list(pending):
                info = self._poll_one(child)
                if info is not None:
                    infos[child.name] = info
                    child.ready = True
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise LaunchError(f"Timed out after {timeout:.0f} s waiting for {names} to become ready.")
        return infos

    def _poll_one(self, child: Child) -> Optional[dict]:
        try:
            if child.reader.poll(0.05):
                message = child.reader.recv()
            elif not child.process.is_alive():
                raise EOFError
            else:
                return None
        except (EOFError, OSError):
            child.process.join(timeout=1.0)
            raise LaunchError(f"Child process {child.name} ({child.process.pid}) died during startup "
                              f"with exit code {child.process.exitcode}.") from None
        if not isinstance(message, dict) or message.get("status") != "ready":
            detail = message.get("message") if isinstance(message, dict) else repr(message)
            raise LaunchError(f"Child process {child.name} failed to start:\n{detail}")
        return message

    # ------------------------------------------------------------------ watch
    def processes(self) -> list[BaseProcess]:
        return [c.process for c in self.children]

    def start_watchdog(self, on_death: Callable[[str, int, Any], None]) -> None:
        """Call `on_death(name, pid, exitcode)` (once, from a thread) when any child dies."""

        def watch() -> None:
            while not self._stopping.wait(WATCHDOG_INTERVAL_S):
                for child in self.children:
                    if not child.process.is_alive() and not self._stopping.is_set():
                        assert child.process.pid is not None  # start() adds a child only after starting it
                        on_death(child.name, child.process.pid, child.process.exitcode)
                        return

        self._watchdog = threading.Thread(target=watch, name="child-watchdog", daemon=True)
        self._watchdog.start()

    def stop_watching(self) -> None:
        """The owner is stopping children itself: the watchdog must not report them as deaths."""
        self._stopping.set()

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Kill every child with its descendants and remove the ipc directory (idempotent)."""
        with self._shutdown_lock:
            if self._shut_down:
                return
            self._shut_down = True
        self._stopping.set()
        for child in self.children:
            if child.process.pid is None:
                continue
            # Grandchildren first (psutil), then the child itself through multiprocessing, which
            # must be the one to reap it: if psutil reaped it, Process.is_alive() would stay True.
            kill_process_tree(child.process.pid, include_parent=False, timeout=2.0)
            if child.process.is_alive():
                child.process.kill()
        for child in self.children:
            if child.process.pid is not None:
                child.process.join(timeout=5.0)
            child.reader.close()
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


class ProcessHandle:
    """A process this process did not start (an HTTP worker's view of the server's children):
    `is_alive()` as multiprocessing's, from its pid (a zombie counts as alive, as there)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def exit_before_ready(pipe_writer: Connection, message: str) -> NoReturn:
    """A child that failed to start: report `message` on its ready pipe (the launcher prints it),
    then exit 1 at once."""
    try:
        pipe_writer.send({"status": "error", "message": message})
    except OSError:  # the launcher is gone already
        pass
    sys.stderr.flush()
    os._exit(1)


def _ignore_sigint_then_run(target: Callable, *args: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    target(*args)


# OpenMP threads that wait for work sleep instead of spinning, unless the user chose otherwise.
# libgomp's default spin burns a core at every barrier; when the machine is busy with anything else
# (other processes, or our own detokenizer and HTTP process on 2 cores) a descheduled team member
# leaves its partner spinning for a whole time slice. Measured on a loaded 2-core AMD EPYC, small
# Llama, bs-16 decode step with 2 threads: 96-148 CPU-ms and 185-340 ms wall with the default,
# 17-18 CPU-ms and 26-46 ms wall with passive waits (1 thread: 17 CPU-ms, 34-36 ms wall).
OPENMP_WAIT_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


@contextlib.contextmanager
def _passive_openmp_waits() -> Iterator[None]:
    """The environment a spawned child starts with: passive OpenMP waits (see OPENMP_WAIT_ENV)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        yield
        return
    os.environ.update(OPENMP_WAIT_ENV)
    try:
        yield
    finally:
        for key in OPENMP_WAIT_ENV:
            os.environ.pop(key, None)


@contextlib.contextmanager
def _sigint_ignored_if_main_thread() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may change handlers; the child then ignores it on entry
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        if previous is not None:  # None: a handler installed outside Python, left as it is
            signal.signal(signal.SIGINT, previous)
