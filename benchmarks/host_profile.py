"""Profiles and CPU accounting for bench_host: py-spy on the server's processes, CPU by title.

`Profiler` runs `py-spy record --format raw --gil` on each process for the measured window (the
thread holding the GIL, so counts follow Python CPU time) and `summarize` turns the collapsed
stacks into the top functions by self and by inclusive samples.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections import Counter
from typing import Dict, List, Optional, Tuple

import psutil

# Blocking samples (py-spy pauses the process for each): --nonblocking misattributes frames of a
# process that runs while it is read. At 100 Hz the pauses cost well under 1% of the process.
PY_SPY_RATE_HZ = 100
# Only the thread that holds the GIL is sampled: in this container py-spy's idle detection counts
# threads blocked in sleep/poll/wait as running, and the GIL holder is the one doing Python work
# (C code that releases the GIL, such as a ZMQ send, is missed).
PY_SPY_FLAGS = ("--gil",)


def process_titles(root_pid: int) -> Dict[str, int]:
    """{process title: pid} of `root_pid` and its descendants that carry an engine:: title."""
    out: Dict[str, int] = {}
    root = psutil.Process(root_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if cmdline and cmdline[0].startswith("engine::"):
            out[cmdline[0].split()[0]] = proc.pid
    return out


def cpu_seconds(pids: Dict[str, int]) -> Dict[str, float]:
    """User + system CPU seconds of each named process so far."""
    out: Dict[str, float] = {}
    for name, pid in pids.items():
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[name] = t.user + t.system
    return out


class Profiler:
    """py-spy record on several processes at once, for a fixed duration."""

    def __init__(self, out_dir: str, pids: Dict[str, int], duration_s: float, tag: str) -> None:
        self.out_dir = out_dir
        self.pids = pids
        self.duration_s = max(1, int(duration_s))
        self.tag = tag
        self.procs: List[Tuple[str, str, subprocess.Popen]] = []

    @staticmethod
    def available() -> bool:
        return shutil.which("py-spy") is not None

    def start(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        for name, pid in self.pids.items():
            path = os.path.join(self.out_dir, f"{self.tag}.{name.replace('::', '_')}.raw.txt")
            cmd = ["py-spy", "record", "--pid", str(pid), "--format", "raw", "-o", path, "-r",
                   str(PY_SPY_RATE_HZ), "-d", str(self.duration_s), *PY_SPY_FLAGS]
            with open(path.replace(".raw.txt", ".log"), "w") as log:  # py-spy's own messages
                self.procs.append((name, path, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)))

    def finish(self) -> Dict[str, Dict]:
        """Wait for the recorders; {process: summary} (see `summarize`)."""
        out: Dict[str, Dict] = {}
        for name, path, proc in self.procs:
            try:
                proc.wait(timeout=self.duration_s + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            summary = summarize(path)
            if summary is not None:
                out[name] = summary
                with open(path.replace(".raw.txt", ".top.txt"), "w") as f:
                    f.write(format_summary(name, summary))
        return out


def summarize(path: str, top: int = 15) -> Optional[Dict]:
    """Top functions by self and inclusive samples of a py-spy raw (collapsed stacks) file."""
    if not os.path.exists(path):
        return None
    self_counts: Counter = Counter()
    incl_counts: Counter = Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = [_short(fr) for fr in stack.split(";")]
            total += n
            self_counts[frames[-1]] += n
            for fr in set(frames):
                incl_counts[fr] += n
    return {"samples": total,
            "self": [(fr, n / max(total, 1)) for fr, n in self_counts.most_common(top)],
            "inclusive": [(fr, n / max(total, 1)) for fr, n in incl_counts.most_common(top + 10)]}


def _short(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (file.py)': one entry per function, not per line."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({os.path.basename(file)})" if file else name


def format_summary(name: str, summary: Dict) -> str:
    lines = [f"{name}: {summary['samples']} samples of the GIL holder at {PY_SPY_RATE_HZ} Hz", "  self:"]
    lines += [f"    {100 * share:5.1f}%  {fr}" for fr, share in summary["self"]]
    lines.append("  inclusive:")
    lines += [f"    {100 * share:5.1f}%  {fr}" for fr, share in summary["inclusive"]]
    return "\n".join(lines) + "\n"
