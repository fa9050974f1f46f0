"""benchmarks/bench_serving.py run as users run it (a subprocess) against a real server.

The oracle for its arithmetic is the per-request records it writes with --output-file: every
aggregate (throughputs, concurrency, TTFT / TPOT / ITL / E2E mean, median, p99) is recomputed
here from them. The workload follows the flags (lengths, shared prefixes, a fixed output length)
and the seed (same seed, same workload and the same greedy texts; another seed, another workload).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence

import pytest

pytestmark = pytest.mark.slow  # one server, and a Python start per benchmark run

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "bench_serving.py")
RUN_TIMEOUT_S = 300


def bench(args: Sequence[str], tmp_path: Any, name: str = "out") -> subprocess.CompletedProcess:
    out_file = tmp_path / f"{name}.json"
    return subprocess.run([sys.executable, SCRIPT, *args, "--output-file", str(out_file), "--disable-tqdm"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def bench_json(server_url: str, args: Sequence[str], tmp_path: Any, name: str = "out") -> Dict[str, Any]:
    done = bench(["--base-url", server_url, "--warmup-requests", "0", *args], tmp_path, name)
    assert done.returncode == 0, done.stderr[-3000:]

    def no_nan(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")

    with open(tmp_path / f"{name}.json") as f:
        result = json.loads(f.read(), parse_constant=no_nan)
    result["stdout"] = done.stdout
    return result


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between the closest ranks (SGLang's and numpy's default)."""
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def check_aggregates(result: Dict[str, Any], token_counts_per_chunk: bool = True) -> None:
    """Every aggregate recomputed from the per-request records. `token_counts_per_chunk`: the
    backend knows how many tokens each streamed chunk holds (the engine's does; the openai one
    counts one per chunk with text, so a token that adds no text adds no ITL entry)."""
    m, records = result["metrics"], [r for r in result["requests"] if r["success"]]
    duration = m["duration_s"]
    assert m["completed"] == len(records) and m["failed"] == len(result["requests"]) - len(records)
    assert m["total_input"] == sum(r["prompt_len"] for r in records)
    assert m["total_output"] == sum(r["output_len"] for r in records)
    approx = lambda x: pytest.approx(x, rel=1e-9, abs=1e-9)  # noqa: E731
    assert m["request_throughput"] == approx(len(records) / duration)
    assert m["input_throughput"] == approx(m["total_input"] / duration)
    assert m["output_throughput"] == approx(m["total_output"] / duration)
    assert m["total_throughput"] == approx((m["total_input"] + m["total_output"]) / duration)
    assert m["concurrency"] == approx(sum(r["latency"] for r in records) / duration)
    ttft = [1000 * r["ttft"] for r in records]
    e2e = [1000 * r["latency"] for r in records]
    tpot = [1000 * (r["latency"] - r["ttft"]) / (r["output_len"] - 1) for r in records if r["output_len"] > 1]
    itl = [1000 * gap for r in records for gap in r["itl"]]
    for name, values in (("ttft", ttft), ("e2e_latency", e2e), ("tpot", tpot)):
        assert m[f"mean_{name}_ms"] == approx(mean(values)), name
        assert m[f"median_{name}_ms"] == approx(percentile(values, 50)), name
        assert m[f"p99_{name}_ms"] == approx(percentile(values, 99)), name
    assert m["mean_itl_ms"] == approx(mean(itl)) and m["max_itl_ms"] == approx(max(itl))
    assert m["median_itl_ms"] == approx(percentile(itl, 50))
    assert m["p95_itl_ms"] == approx(percentile(itl, 95)) and m["p99_itl_ms"] == approx(percentile(itl, 99))
    for r in records:
        # One ITL entry per token after the first; TPOT is SGLang's (decode time / later tokens).
        if token_counts_per_chunk:
            assert len(r["itl"]) == r["output_len"] - 1
        else:
            assert 0 <= len(r["itl"]) <= r["output_len"] - 1
        expected_tpot: Optional[float] = (r["latency"] - r["ttft"]) / (r["output_len"] - 1) \
            if r["output_len"] > 1 else None
        assert r["tpot"] == (approx(expected_tpot) if expected_tpot is not None else None)
        assert 0 < r["ttft"] <= r["latency"]


def table_value(stdout: str, label: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(label)]
    assert len(lines) == 1, (label, stdout)
    return lines[0][len(label):].strip()


# ---------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("args, needle", [
    (["--launch-server", "--base-url", "http://127.0.0.1:1"], "do not pass --base-url with it"),
    (["--request-rate", "0"], "--request-rate must be > 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
])
def test_contradictory_flags_exit_2_with_the_reason(tmp_path, args: List[str], needle: str) -> None:
    done = bench(args, tmp_path)
    assert done.returncode == 2 and needle in done.stderr, done.stderr


# ---------------------------------------------------------------------------- runs against a server
RANDOM = ["--dataset", "random", "--num-prompts", "8", "--random-input-len", "40", "--random-output-len", "6",
          "--random-range-ratio", "0.5"]


def test_random_dataset_lengths_metrics_table_and_seed(server_url, tmp_path) -> None:
    first = bench_json(server_url, [*RANDOM, "--seed", "3"], tmp_path, "first")
    records = first["requests"]
    assert len(records) == 8 and all(r["success"] for r in records), records
    # SGLang's random lengths: uniform in [len x ratio, len]; ignore_eos makes every output full length.
    assert all(20 <= r["prompt_len"] <= 40 and 3 <= r["output_len"] <= 6 for r in records)
    check_aggregates(first)
    m = first["metrics"]
    assert table_value(first["stdout"], "Successful requests:") == "8"
    assert table_value(first["stdout"], "Total generated tokens:") == str(m["total_output"])
    assert table_value(first["stdout"], "Output token throughput (tok/s):") == f"{m['output_throughput']:.2f}"
    assert table_value(first["stdout"], "P99 ITL (ms):") == f"{m['p99_itl_ms']:.2f}"

    def workload(result: Dict[str, Any]) -> List[Any]:
        return [(r["prompt_len"], r["output_len"], r["generated_text"]) for r in result["requests"]]

    again = bench_json(server_url, [*RANDOM, "--seed", "3"], tmp_path, "again")
    other = bench_json(server_url, [*RANDOM, "--seed", "4"], tmp_path, "other")
    assert workload(again) == workload(first)
    assert [w[:2] for w in workload(other)] != [w[:2] for w in workload(first)]


def test_shared_prefix_dataset_through_the_openai_backend(server_url, tmp_path) -> None:
    result = bench_json(server_url, ["--backend", "openai", "--dataset", "generated-shared-prefix",
                                     "--gsp-num-groups", "2", "--gsp-prompts-per-group", "3",
                                     "--gsp-system-prompt-len", "32", "--gsp-question-len", "8",
                                     "--gsp-output-len", "4", "--max-concurrency", "2"], tmp_path)
    records = result["requests"]
    assert len(records) == 6 and all(r["success"] for r in records), records
    # The counts come from the streamed usage: the prompt is system + question, the output fixed.
    assert all(r["prompt_len"] == 40 and r["output_len"] == 4 for r in records)
    check_aggregates(result, token_counts_per_chunk=False)
    assert table_value(result["stdout"], "Max request concurrency:") == "2"
    assert table_value(result["stdout"], "Backend:") == "openai"


def test_sharegpt_like_text_prompts_with_a_fixed_output_length(server_url, tmp_path) -> None:
    result = bench_json(server_url, ["--dataset", "sharegpt", "--num-prompts", "5", "--sharegpt-output-len", "4",
                                     "--request-rate", "50"], tmp_path)
    records = result["requests"]
    assert len(records) == 5 and all(r["success"] for r in records), records
    assert all(r["output_len"] == 4 and r["generated_text"] for r in records)
    assert len({r["prompt_len"] for r in records}) > 1  # conversations of varied length
    check_aggregates(result)


def test_a_run_where_every_request_fails_writes_strict_json(server_url, tmp_path) -> None:
    # Prompts longer than the built-in model's context: each request is refused with a 400.
    result = bench_json(server_url, ["--dataset", "random", "--num-prompts", "3", "--random-input-len", "3000",
                                     "--random-output-len", "4", "--random-range-ratio", "1.0"], tmp_path)
    m = result["metrics"]
    assert (m["completed"], m["failed"]) == (0, 3)
    assert m["total_output"] == 0 and m["mean_ttft_ms"] is None and m["p99_itl_ms"] is None
    assert all(not r["success"] and "400" in r["error"] for r in result["requests"]), result["requests"]
    assert table_value(result["stdout"], "Failed requests:") == "3"
