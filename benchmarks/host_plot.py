"""The plot of bench_host: how the host side scales with the number of running requests.

Left: decode throughput as a share of the forward-bound ideal. Middle: the scheduler's CPU time
per decode step. Right: CPU time per output token of each server process (streaming over HTTP).
An earlier run (--baseline) is drawn dashed; with --tokenizer-worker-num the HTTP workers' CPU
is one line (all of them together).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

TARGET_SHARE = 90  # % of the ideal (overlap loop, issue 21)
TARGET_SCHEDULER_MS = 1.5  # scheduler CPU per decode step at 1024 running requests


def _series(results: List[Dict[str, Any]], mode: str, stream: bool, loop: str = "overlap") -> List[Dict[str, Any]]:
    rows = [r for r in results if r["mode"] == mode and r["stream"] == stream and r["loop"] == loop]
    return sorted(rows, key=lambda r: r["num_reqs"])


def plot(results: List[Dict[str, Any]], path: str, baseline: Optional[List[Dict[str, Any]]] = None,
         baseline_label: str = "before") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.6))
    runs = [("", "-", results)] + ([(f" ({baseline_label})", "--", baseline)] if baseline else [])
    for suffix, style, rows in runs:
        for mode, stream, loop, color in (("inproc", True, "overlap", "C0"), ("inproc", False, "overlap", "C1"),
                                          ("inproc", True, "normal", "C4"), ("http", True, "overlap", "C2"),
                                          ("http", False, "overlap", "C3")):
            series = _series(rows, mode, stream, loop)
            if not series:
                continue
            xs = [r["num_reqs"] for r in series]
            label = (f"{'in-process ' + loop if mode == 'inproc' else 'server'}, "
                     f"{'stream' if stream else 'no stream'}{suffix}")
            ax1.plot(xs, [100 * r["throughput"] / r["ideal"] for r in series], marker="o", linestyle=style,
                     color=color, label=label)
            ax2.plot(xs, [r["cpu_ms_per_step"] or 0 for r in series], marker="o", linestyle=style, color=color,
                     label=label)
        http = _series(rows, "http", True)
        for proc, color in (("scheduler", "C0"), ("detokenizer", "C1"), ("main", "C2"), ("worker", "C3")):
            if any(r.get(f"{proc}_cpu_us_per_token") for r in http):  # (main is idle beside HTTP workers)
                ax3.plot([r["num_reqs"] for r in http], [r.get(f"{proc}_cpu_us_per_token", 0) for r in http],
                         marker="o", linestyle=style, color=color,
                         label=f"{'HTTP workers' if proc == 'worker' else proc}{suffix}")
    ax1.axhline(TARGET_SHARE, color="grey", linestyle=":", linewidth=1)
    ax2.axhline(TARGET_SCHEDULER_MS, color="grey", linestyle=":", linewidth=1)
    ax1.set(xscale="log", xlabel="running requests", ylabel="% of the forward-bound ideal",
            title="decode throughput, 10 ms simulated forward")
    ax2.set(xscale="log", yscale="log", xlabel="running requests", ylabel="ms CPU per decode step",
            title="scheduler CPU per decode step")
    ax3.set(xscale="log", xlabel="running requests", ylabel="CPU us per output token",
            title="server processes, streaming over HTTP")
    sizes = sorted({r["num_reqs"] for r in results})
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
