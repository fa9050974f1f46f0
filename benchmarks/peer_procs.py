"""Processes of the peer benchmark: start one in its own session, watch its memory, stop it whole."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from typing import Dict, List, Optional

import httpx
import psutil

MEMORY_SAMPLE_S = 0.25


def launch(cmd: List[str], env: Dict[str, str], log_path: str) -> subprocess.Popen:
    """Start cmd with its output in log_path, in a session of its own (so it can be stopped whole)."""
    log = open(log_path, "w")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()  # the child holds its own descriptor


def stop(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM, then SIGKILL to whatever is left of the process group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def wait_healthy(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    """Poll GET /health (both servers have it) until 200; fail at once if the server exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was healthy")
        try:
            if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{base_url} was not healthy within {timeout_s:.0f} s")


def tree_rss(pid: int) -> int:
    """Sum of the resident set sizes of a process and all its descendants, in bytes."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:  # exited between listing and reading
            pass
    return total


class TreeMemory:
    """Samples the process tree's summed RSS on a thread; `summary()` gives the peak and the mean."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: List[int] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "TreeMemory":
        self._thread = threading.Thread(target=self._run, name="tree-memory", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_S):
            rss = tree_rss(self.pid)
            if rss:
                self.samples.append(rss)

    def summary(self) -> Dict[str, float]:
        if not self.samples:
            return {}
        return dict(peak_rss_gb=round(max(self.samples) / 1e9, 3),
                    mean_rss_gb=round(sum(self.samples) / len(self.samples) / 1e9, 3))
