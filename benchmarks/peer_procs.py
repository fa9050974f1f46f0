"""Processes of the peer benchmark: start one in its own session and watch its memory (waiting for
health and stopping are bench_serving's)."""

from __future__ import annotations

import subprocess
import threading
from typing import Dict, List, Optional

import psutil

MEMORY_SAMPLE_S = 0.25


def launch(cmd: List[str], env: Dict[str, str], log_path: str) -> subprocess.Popen:
    """Start cmd with its output in log_path, in a session of its own (so it can be stopped whole)."""
    log = open(log_path, "w")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        log.close()  # the child holds its own descriptor


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
