"""The peer benchmark's table (markdown, with the issue's targets) and plot."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

COLUMNS = (("hf", "transformers"), ("vllm1", "vLLM, 1 core"), ("vllm2", "vLLM, 2 cores"), ("engine", "engine"))
ROWS = (
    ("offline_16", "offline, 16 x 128 / 128", 1.2),
    ("offline_1", "offline, 1 x 128 / 128", 1.1),
    ("server_16", "OpenAI server, 16 concurrent", 1.1),
    ("server_1", "OpenAI server, 1 at a time", None),
    ("offline_64", "offline, 64 x 128 / 128", None),
    ("shared_prefix", "shared prefix, 8 x 16, 1024 + 64 in, 64 out", 1.5),
    ("stream_64", "streaming, 64 concurrent (bench_serving)", None),
)
# (metric key, label, target for engine / vLLM: at most this)
POISSON_ROWS = (
    ("median_ttft_ms", "TTFT median (ms)", None),
    ("p99_ttft_ms", "TTFT p99 (ms)", None),
    ("median_tpot_ms", "TPOT median (ms)", 1.0),
    ("p99_tpot_ms", "TPOT p99 (ms)", None),
    ("p99_itl_ms", "ITL p99 (ms)", 1.0),
    ("max_itl_ms", "ITL max (ms)", None),
    ("median_e2e_latency_ms", "end-to-end median (ms)", 0.9),
    ("concurrency", "requests in flight (mean)", None),
    ("output_throughput", "output tok/s", None),
)


def _tput(results: Dict[str, Any], system: str, workload: str) -> Optional[float]:
    row = results.get(system, {}).get(workload)
    return row.get("out_tok_per_s") if isinstance(row, dict) else None


def _fmt(value: Optional[float], digits: int = 0) -> str:
    if value is None:
        return ""
    return f"{value:,.{digits}f}"


def _best_vllm(results: Dict[str, Any], workload: str) -> Tuple[Optional[str], Optional[float]]:
    best: Tuple[Optional[str], Optional[float]] = (None, None)
    for system in ("vllm1", "vllm2"):
        value = _tput(results, system, workload)
        if value is not None and (best[1] is None or value > best[1]):
            best = (system, value)
    return best


def _verdict(ratio: Optional[float], target: Optional[float], higher_is_better: bool = True) -> str:
    if ratio is None or target is None:
        return ""
    ok = ratio >= target if higher_is_better else ratio <= target
    return "met" if ok else "not met"


def _model_name(report: Dict[str, Any]) -> str:
    kind = report.get("model", {}).get("kind", "small")
    return "small Llama" if kind == "small" else "Mixtral-shaped model (8 experts, top-2)"


def format_table(report: Dict[str, Any]) -> str:
    results = report["results"]
    cpu = report["cpu"]
    amx = "with AMX" if cpu.get("amx") else "no AMX"
    lines = [
        f"Peer benchmark, {report['started']}: {cpu.get('model')} ({cpu.get('cores')} cores, "
        f"{' '.join(cpu.get('isa', []))}, {amx}), torch {report['torch']}; {_model_name(report)} bf16, greedy, EOS "
        f"ignored; KV {report['kv_tokens']} tokens for vLLM and the engine; best of {report['reps']} x "
        f"{report['rounds']} round(s). Output tokens/s.",
        "",
        "| workload | " + " | ".join(label for _, label in COLUMNS) + " | engine / best vLLM | target | |",
        "|---" * (len(COLUMNS) + 4) + "|",
    ]
    for key, label, target in ROWS:
        values = [_tput(results, system, key) for system, _ in COLUMNS]
        if all(v is None for v in values):
            continue
        _, best = _best_vllm(results, key)
        engine = _tput(results, "engine", key)
        ratio = engine / best if engine is not None and best else None
        lines.append(f"| {label} | " + " | ".join(_fmt(v) for v in values)
                     + f" | {_fmt(ratio, 2) + 'x' if ratio else ''} | {'>= ' + str(target) + 'x' if target else ''}"
                     + f" | {_verdict(ratio, target)} |")
    lines += _stream_lines(results)
    lines += _poisson_lines(results)
    lines += _memory_lines(results, report["kv_tokens"])
    return "\n".join(lines)


def _stream_lines(results: Dict[str, Any]) -> List[str]:
    out = []
    for system, label in COLUMNS:
        stream, offline = _tput(results, system, "stream_64"), _tput(results, system, "offline_64")
        if stream and offline:
            ratio = stream / offline
            target = " (target >= 0.9: " + _verdict(ratio, 0.9) + ")" if system == "engine" else ""
            out.append(f"- {label}: streaming 64 / offline 64 = {ratio:.2f}{target}")
    return ["", "Streaming against offline at 64 requests:", *out] if out else []


def _poisson_lines(results: Dict[str, Any]) -> List[str]:
    present = [(s, label) for s, label in COLUMNS if isinstance(results.get(s, {}).get("poisson"), dict)]
    if not present:
        return []
    vllm = [s for s, _ in present if s.startswith("vllm")]
    # vLLM's best configuration here: the lower median end-to-end latency.
    best = min(vllm, key=lambda s: results[s]["poisson"]["median_e2e_latency_ms"]) if vllm else None
    lines = ["", "Poisson serving, 4 req/s, 120 prompts of 384-640 tokens, 96-160 out, streaming:", "",
             "| metric | " + " | ".join(label for _, label in present) + " | engine / best vLLM | target | |",
             "|---" * (len(present) + 4) + "|"]
    for key, label, target in POISSON_ROWS:
        values = [results[s]["poisson"].get(key) for s, _ in present]
        ratio = None
        if best and "engine" in results and isinstance(results["engine"].get("poisson"), dict):
            e, v = results["engine"]["poisson"].get(key), results[best]["poisson"].get(key)
            ratio = e / v if e is not None and v else None
        lines.append(f"| {label} | " + " | ".join(_fmt(v, 1) for v in values)
                     + f" | {_fmt(ratio, 2) + 'x' if ratio else ''} | {'<= ' + str(target) + 'x' if target else ''}"
                     + f" | {_verdict(ratio, target, higher_is_better=False)} |")
    return lines


def _memory_lines(results: Dict[str, Any], kv_tokens: int) -> List[str]:
    rows = []
    for system, label in COLUMNS:
        r = results.get(system, {})
        offline = r.get("memory_offline", {}).get("peak_rss_gb")
        server = r.get("memory_server", {}).get("peak_rss_gb")
        if offline or server:
            rows.append((system, label, offline, server))
    if not rows:
        return []
    lines = ["", f"Peak resident memory, sum of RSS over each system's processes (GB; KV {kv_tokens} tokens):", "",
             "| system | offline run | server run |", "|---|---|---|"]
    lines += [f"| {label} | {_fmt(o, 2)} | {_fmt(s, 2)} |" for _, label, o, s in rows]
    engine = [(o, s) for system, _, o, s in rows if system == "engine"]
    vllm = [(o, s) for system, _, o, s in rows if system.startswith("vllm")]
    if engine and vllm:
        for index, what in ((0, "offline"), (1, "server")):
            e = engine[0][index]
            v = [x[index] for x in vllm if x[index]]
            if e and v:
                verdict = "met" if e <= min(v) else "not met"
                lines.append(f"- {what}: engine / vLLM (lower of its two) = {e / min(v):.2f} (target <= 1: {verdict})")
    return lines


def plot(report: Dict[str, Any], path: str) -> None:
    """Two panels: output tok/s against batch size (128/128) and against shared-prefix length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, (system, label) in enumerate(COLUMNS):
        color = f"C{i}"  # one color per system in both panels
        r = results.get(system, {})
        batch = sorted((int(k.split("_")[1]), v["out_tok_per_s"]) for k, v in r.items()
                       if k.startswith("offline_") and isinstance(v, dict) and "out_tok_per_s" in v)
        prefix = sorted(((1024 if k == "shared_prefix" else int(k.split("_")[1])), v["out_tok_per_s"])
                        for k, v in r.items()
                        if (k == "shared_prefix" or k.startswith("prefix_")) and isinstance(v, dict))
        if batch:
            ax1.plot(*zip(*batch), marker="o", label=label, color=color)
        if prefix:
            ax2.plot(*zip(*prefix), marker="o", label=label, color=color)
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch size (128 in / 128 out)")
    ax2.set_xlabel("shared system prompt tokens (8 groups x 16 prompts)")
    for ax in (ax1, ax2):
        ax.set_ylabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend()
    cpu = report["cpu"]
    fig.suptitle(f"{_model_name(report)} bf16 on {cpu.get('model')}, {cpu.get('cores')} cores "
                 f"({'AMX' if cpu.get('amx') else 'no AMX'}), {report['started'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
