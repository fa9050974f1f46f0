"""Helpers the test modules share: bounded polling and process liveness."""

from __future__ import annotations

import time
from typing import Callable

import psutil


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout` seconds pass; its last value either way.

    The deadline only bounds a failing test, so it is generous: a loaded or slow machine must not
    turn a correct engine into a failure."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
