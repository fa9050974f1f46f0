"""Engine servers behind SGLang's router (`sglang-router`): routing policies and router overhead.

One invocation runs, on the shared-prefix workload (groups of prompts that share a long system
prompt, interleaved as real traffic is):

1. per policy (default cache_aware and round_robin), two fresh workers behind the router:
   throughput, TTFT, and each worker's prefix-cache hit rate and share of the requests;
2. router overhead: one worker measured directly, then the same worker behind the router
   (its cache flushed before each run): throughput ratio and p50 TTFT difference.

Workers are started with `python -m engine.launch_server` (the built-in model unless
--server-args names one), the router with `python -m sglang_router.launch_router`; the
measuring client is bench_serving's. Prints a table; --output-file writes JSON.

  python benchmarks/bench_router.py --server-args "--device cpu --max-total-tokens 6144"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving  # noqa: E402
import serving_datasets  # noqa: E402

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- the router process
def router_workers(router_url: str) -> List[Dict[str, Any]]:
    """The router's view of its workers (GET /workers): url, is_healthy, load, metadata."""
    return httpx.get(f"{router_url}/workers", timeout=10).json()["workers"]


def start_router(worker_urls: Sequence[str], policy: str, log_file: Any,
                 extra_args: Sequence[str] = ()) -> tuple[subprocess.Popen, str]:
    """Start `sglang_router.launch_router` on free ports of 127.0.0.1 (its metrics port too, so
    that several routers can run at once); returns the process and its URL."""
    port = bench_serving.find_free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--prometheus-port", str(bench_serving.find_free_port()), "--worker-urls", *worker_urls,
           "--policy", policy, "--log-level", "warn", *extra_args]
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def wait_router_ready(proc: subprocess.Popen, router_url: str, num_workers: int, timeout_s: float = 60.0) -> None:
    """Poll until the router lists `num_workers` healthy workers (it registers them in the background)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited with code {proc.returncode}")
        try:
            listed = router_workers(router_url)
            if len(listed) == num_workers and all(w["is_healthy"] for w in listed):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.25)
    raise TimeoutError(f"the router did not register {num_workers} healthy workers in {timeout_s:.0f} s")


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def launched_router(worker_urls: Sequence[str], policy: str, extra_args: Sequence[str] = ()) -> Iterator[str]:
    with tempfile.TemporaryFile() as log:
        proc, url = start_router(worker_urls, policy, log, extra_args)
        try:
            wait_router_ready(proc, url, len(worker_urls))
            yield url
        except (RuntimeError, TimeoutError):
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            stop_process(proc)


# ---------------------------------------------------------------------------- one measured run
@dataclass
class WorkerStats:
    url: str
    requests: int
    prompt_tokens: int
    cache_hit_rate: float


@dataclass
class RunResult:
    name: str
    metrics: bench_serving.BenchmarkMetrics
    workers: List[WorkerStats]

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens over all prompt tokens, over the workers."""
        total = sum(w.prompt_tokens for w in self.workers)
        return sum(w.cache_hit_rate * w.prompt_tokens for w in self.workers) / max(total, 1)


def _counter(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(f"sglang:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def worker_stats(url: str) -> WorkerStats:
    """What one worker served (needs --enable-metrics) and its cumulative prefix-cache hit rate."""
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    state = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
    return WorkerStats(url, int(_counter(metrics, "num_requests_total")), int(_counter(metrics, "prompt_tokens_total")),
                       float(state["cache_hit_rate"]))


def measure(name: str, base_url: str, workers: Sequence[str], requests: List[serving_datasets.SampledRequest],
            args: argparse.Namespace) -> RunResult:
    cfg = bench_serving.BenchConfig(backend="engine", base_url=base_url, model="", request_rate=args.request_rate,
                                    max_concurrency=args.max_concurrency, ignore_eos=True, use_text=False,
                                    seed=args.seed, show_progress=False)
    outputs, duration, _ = asyncio.run(bench_serving.run_benchmark(cfg, requests))
    metrics = bench_serving.calculate_metrics(outputs, duration)
    if metrics.failed:
        logger.warning("%s: %d request(s) failed, e.g. %s", name, metrics.failed,
                       next(o.error for o in outputs if not o.success))
    return RunResult(name, metrics, [worker_stats(url) for url in workers])


@contextlib.contextmanager
def launched_workers(count: int, server_args: str) -> Iterator[List[str]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(bench_serving.launched_server(server_args)).base_url for _ in range(count)]


def flush(url: str) -> None:
    response = httpx.post(f"{url}/flush_cache", timeout=60)
    if response.status_code != 200:
        raise RuntimeError(f"flush_cache on {url}: {response.status_code} {response.text}")


# ---------------------------------------------------------------------------- the whole comparison
def build_requests(args: argparse.Namespace, vocab_size: int) -> List[serving_datasets.SampledRequest]:
    requests = serving_datasets.sample_generated_shared_prefix_requests(
        args.num_groups, args.prompts_per_group, args.system_prompt_len, args.question_len, args.output_len,
        vocab_size, args.seed)
    if not args.grouped:
        # Real traffic interleaves conversations; grouped order would hand every group's prompts
        # to the router back to back, which no policy can get wrong.
        random.Random(args.seed).shuffle(requests)
    return requests


def run_all(args: argparse.Namespace) -> Dict[str, Any]:
    server_args = f"{args.server_args} --enable-metrics"
    router_args = args.router_args.split()
    results: List[RunResult] = []
    requests: Optional[List[serving_datasets.SampledRequest]] = None
    for policy in args.policies:
        # Fresh workers per policy: their hit rates count from zero.
        with launched_workers(2, server_args) as workers:
            if requests is None:
                requests = build_requests(args, int(bench_serving.server_model_info(workers[0])["vocab_size"]))
            with launched_router(workers, policy, router_args) as router_url:
                results.append(measure(policy, router_url, workers, requests, args))
    overhead: Optional[Dict[str, float]] = None
    if not args.skip_overhead:
        with launched_workers(1, server_args) as workers:
            if requests is None:
                requests = build_requests(args, int(bench_serving.server_model_info(workers[0])["vocab_size"]))
            flush(workers[0])
            direct = measure("direct (1 worker)", workers[0], [], requests, args)
            with launched_router(workers, "round_robin", router_args) as router_url:
                flush(workers[0])
                routed = measure("router (1 worker)", router_url, [], requests, args)
        results += [direct, routed]
        overhead = {
            "throughput_ratio": routed.metrics.total_throughput / direct.metrics.total_throughput,
            "p50_ttft_diff_ms": routed.metrics.median_ttft_ms - direct.metrics.median_ttft_ms,
        }
    print(format_table(results, overhead))
    return {"args": vars(args), "runs": [{"name": r.name, "metrics": asdict(r.metrics), "hit_rate": r.hit_rate,
                                          "workers": [asdict(w) for w in r.workers]} for r in results],
            "overhead": overhead}


def format_table(results: Sequence[RunResult], overhead: Optional[Dict[str, float]]) -> str:
    head = (f"{'run':<20} {'req/s':>7} {'tok/s':>9} {'p50 TTFT':>9} {'p99 TTFT':>9} {'p50 TPOT':>9} "
            f"{'hit rate':>9}  per worker: hit rate (requests)")
    lines = [head, "-" * len(head)]
    for r in results:
        m = r.metrics
        per_worker = "  ".join(f"{w.cache_hit_rate:.1%} ({w.requests})" for w in r.workers)
        hit = f"{r.hit_rate:.1%}" if r.workers else "-"
        lines.append(f"{r.name:<20} {m.request_throughput:>7.2f} {m.total_throughput:>9.0f} "
                     f"{m.median_ttft_ms:>8.0f}ms {m.p99_ttft_ms:>8.0f}ms {m.median_tpot_ms:>7.1f}ms {hit:>9}  "
                     f"{per_worker}")
    by_name = {r.name: r for r in results}
    if "cache_aware" in by_name and "round_robin" in by_name:
        ca, rr = by_name["cache_aware"], by_name["round_robin"]
        lines.append(f"cache_aware / round_robin: hit rate x{ca.hit_rate / max(rr.hit_rate, 1e-9):.2f}, "
                     f"throughput x{ca.metrics.total_throughput / rr.metrics.total_throughput:.2f}")
    if overhead is not None:
        lines.append(f"router overhead (1 worker): throughput x{overhead['throughput_ratio']:.3f} of direct, "
                     f"p50 TTFT {overhead['p50_ttft_diff_ms']:+.1f} ms")
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server-args", default="--device cpu --max-total-tokens 6144",
                    help="flags for every worker (--enable-metrics is added)")
    ap.add_argument("--router-args", default="", help="extra flags for the router, one string")
    ap.add_argument("--policies", nargs="+", default=["cache_aware", "round_robin"],
                    choices=["cache_aware", "round_robin", "power_of_two", "random"])
    ap.add_argument("--skip-overhead", action="store_true", help="leave out the one-worker overhead runs")
    ap.add_argument("--num-groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-prompt-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--grouped", action="store_true", help="send each group's prompts back to back")
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--output-file", default=None)
    return ap.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    result = run_all(args)
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(bench_serving.json_safe(result), f, indent=1, allow_nan=False)
    return result


if __name__ == "__main__":
    main()
