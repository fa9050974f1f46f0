"""Whether the engine behind a TokenizerManager can still answer: its child processes are alive,
no fatal error was reported, no shutdown began. The answer a request gets when it cannot is a 503
with the reason."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from engine.errors import EngineRequestError
from engine.utils.process_utils import child_alive

SHUTDOWN_MESSAGE = "The server is shutting down."
# How often the admission check also looks for zombie children in /proc (alive_for_admission).
ZOMBIE_CHECK_INTERVAL_S = 0.25


class Liveness:
    def __init__(self, child_processes: Sequence[Any]) -> None:
        self.child_processes = list(child_processes)
        self.dead_message: Optional[str] = None  # why the engine cannot answer (None while it can)
        self.shutting_down = False
        self._zombie_checked_at = float("-inf")

    def mark_dead(self, message: str) -> None:
        self.dead_message = message

    def begin_shutdown(self) -> bool:
        """Mark the engine as shutting down; False when it already could not answer."""
        if self.dead_message is not None:
            return False
        self.shutting_down = True
        self.dead_message = SHUTDOWN_MESSAGE
        return True

    def is_alive(self) -> bool:
        """True while every child process is alive, no fatal error was reported and no shutdown began."""
        alive = self.dead_message is None and all(child_alive(p) for p in self.child_processes)
        if not alive:
            # A death seen here (a zombie child the watchdog has not reported yet) is seen by the
            # next admission check too: it must not answer from its cached "alive".
            self._zombie_checked_at = float("-inf")
        return alive

    def alive_for_admission(self) -> bool:
        """is_alive() for the check before each request is sent: the zombie check through /proc
        (~0.1 ms per child here; per request it was 12% of the main process's samples while a
        thousand streams arrived) runs at most every ZOMBIE_CHECK_INTERVAL_S. A request that
        slips through in that window waits on a dead child and is failed with 503 when the child
        watchdog reports the death, as one already running would be."""
        if self.dead_message is not None or not all(p.is_alive() for p in self.child_processes):
            return False
        now = time.monotonic()
        if now - self._zombie_checked_at < ZOMBIE_CHECK_INTERVAL_S:
            return True
        alive = self.is_alive()
        if alive:
            self._zombie_checked_at = now
        return alive

    def not_alive_message(self, message: str) -> str:
        return message if self.shutting_down else f"The server is not alive: {message}"

    def unavailable_error(self) -> Optional[EngineRequestError]:
        """The 503 a request gets while the engine cannot answer (None while it can)."""
        if self.is_alive():
            return None
        message = self.dead_message or "A child process of the server died."
        return EngineRequestError(self.not_alive_message(message), 503, "ServiceUnavailableError")

    def check(self) -> None:
        """Raise the 503 before a request is sent, if the engine cannot answer it."""
        if self.alive_for_admission():
            return
        error = self.unavailable_error()
        if error is not None:
            raise error
