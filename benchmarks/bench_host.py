"""The host side at accelerator speed: scheduler, detokenizer and HTTP over a simulated device.

Every run uses `--simulated-device-forward-ms A,B` (model_executor/simulated_device.py): the
forward sleeps A + B x tokens ms and returns deterministic tokens, so the time the host spends
around it is what is measured. For each number of running requests N (all submitted at once,
--input-len prompt tokens, --output-len output tokens, ignore_eos):

  inproc  the Scheduler in this process (as bench_overlap: prefill first, then the decode phase
          is timed), with the overlap loop and the normal loop; its messages are encoded as the
          server would send them. Reported: decode tok/s against the forward-bound ideal
          N / (A + B x N) per ms, and the process's CPU time per decode step.
  http    a real server (`engine.launch_server` with the simulated device) and N concurrent
          /generate clients on raw sockets (host_client.py), streaming and not. Reported: the
          steady-state tok/s (streaming: while all N streams run), the whole run's tok/s, and the
          CPU time of each server process (by its title) per decode step and as a share of a core.

With --profile-dir, py-spy records each process (host_profile.py) at the --profile-at sizes and
the top functions are printed and written next to the raw stacks.

  python benchmarks/bench_host.py --num-reqs 256 1024 4096 --result-file host.json --plot host.png
  python benchmarks/bench_host.py --num-reqs 1024 --modes http --profile-dir prof --profile-at 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_client import run_clients, steady_window  # noqa: E402
from host_profile import Profiler, cpu_seconds, format_summary, process_titles  # noqa: E402

PROCESS_NAMES = ("engine::scheduler_TP0", "engine::detokenizer", "engine::main")
WORKER_PREFIX = "engine::http_worker_"  # --tokenizer-worker-num > 1: the HTTP processes


def short_name(title: str) -> str:
    """scheduler, detokenizer, main, or worker (every HTTP worker)."""
    return "worker" if title.startswith(WORKER_PREFIX) else title.split("::")[1].split("_")[0]


# ---------------------------------------------------------------------------- in process
def server_flags(args: argparse.Namespace, n: int) -> Dict[str, Any]:
    """The ServerArgs both modes run with (the CUDA defaults for prefill: we simulate a GPU)."""
    return {"simulated_device_forward_ms": f"{args.forward_ms},{args.per_token_ms}", "device": "cpu",
            "max_running_requests": n, "max_total_tokens": n * (args.input_len + args.output_len + 8) + 4096,
            "chunked_prefill_size": 8192, "max_prefill_tokens": 16384, "log_level": "warning",
            "incremental_streaming_output": args.incremental_streaming_output}


def prompts_for(n: int, input_len: int, seed: int, vocab: int = 2560) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(n)]


def inproc_run(s: Any, prompts: List[List[int]], output_len: int, stream: bool, tag: str,
               on_decode_start: Optional[Any] = None) -> Dict[str, Any]:
    from engine.io_struct import TokenizedGenerateReqInput

    for i, p in enumerate(prompts):
        s.add_request(TokenizedGenerateReqInput(
            rid=f"{tag}-{i}", input_ids=p, stream=stream,
            sampling_params={"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}))
    step = s.step_overlap if s.enable_overlap else s.step
    while s.waiting_queue or s.inbox or s.chunked_req is not None:
        step()
    while s.result_queue:  # both loops start the timed phase with nothing in flight
        s._pop_and_process()
    s.flush_outputs()
    tokens_before = sum(len(r.output_ids) for r in s.running_batch.reqs)
    if on_decode_start is not None:
        on_decode_start()
    runner = s.worker.model_runner
    asked0, spent0 = runner.requested_s, runner.elapsed_s
    steps, cpu0, t0 = 0, time.process_time(), time.perf_counter()
    while s.has_work():
        step()
        steps += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    overshoot_ms = 1000 * ((runner.elapsed_s - spent0) - (runner.requested_s - asked0)) / max(steps, 1)
    s.flush_cache()
    tokens = len(prompts) * output_len - tokens_before
    return {"tokens": tokens, "wall_s": wall, "steps": steps, "throughput": tokens / wall,
            "cpu_ms_per_step": 1000 * cpu / max(steps, 1), "cpu_share": cpu / wall,
            # How late the simulated forward's sleep ended, per step: the loaded host's wake-up
            # latency, part of every step here though no device would add it.
            "forward_overshoot_ms": overshoot_ms,
            "scheduler_cpu_us_per_token": 1e6 * cpu / max(tokens, 1)}


def inproc_phase(args: argparse.Namespace, n: int, results: List[Dict]) -> None:
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model
    from engine.io_struct import encode
    from engine.scheduler.overlap_utils import scheduling_thread
    from engine.scheduler.scheduler import Scheduler
    from engine.server_args import ServerArgs

    try:
        from engine.utils.process_utils import freeze_startup_objects
    except ImportError:  # a tree from before it existed (a --baseline run)
        def freeze_startup_objects() -> None:
            pass

    path = ensure_builtin_model()
    with scheduling_thread():
        s = Scheduler(ServerArgs(model_path=path, **server_flags(args, n)), tokenizer=AutoTokenizer.from_pretrained(path))
        s.send_output = lambda msg: encode(msg)  # the server's serialisation, without a socket
        freeze_startup_objects()  # as the scheduler process does once it is ready
        for stream in args.stream_modes:
            for loop in args.loops:
                s.enable_overlap = loop == "overlap"
                runs = [inproc_run(s, prompts_for(n, args.input_len, seed), args.output_len, stream, f"r{seed}")
                        for seed in range(args.repeats)]
                best = max(runs, key=lambda r: r["throughput"])
                row = {"mode": "inproc", "num_reqs": n, "stream": stream, "loop": loop, **best,
                       "ideal": ideal_throughput(args, n), "runs": runs}
                results.append(row)
                print(format_row(row), flush=True)
                if args.profile_dir and n in args.profile_at and loop == "overlap":
                    prof = Profiler(args.profile_dir, {"inproc": os.getpid()}, best["wall_s"],
                                    f"inproc.n{n}.{'stream' if stream else 'nostream'}")
                    inproc_run(s, prompts_for(n, args.input_len, 99), args.output_len, stream, "prof",
                               on_decode_start=prof.start)
                    for name, summary in prof.finish().items():
                        row.setdefault("profile", {})[name] = summary
                        print(format_summary(name, summary), flush=True)
        s.shutdown()


def ideal_throughput(args: argparse.Namespace, n: int) -> float:
    step_ms = args.forward_ms + args.per_token_ms * n
    return n / (step_ms / 1000) if step_ms > 0 else float("inf")  # 0: a host-only measurement


# ---------------------------------------------------------------------------- through HTTP
def http_phase(args: argparse.Namespace, n: int, results: List[Dict]) -> None:
    import httpx

    from bench_serving import launched_server

    flags = server_flags(args, n)
    if args.tokenizer_worker_num > 1:
        flags["tokenizer_worker_num"] = args.tokenizer_worker_num
    cli = " ".join(f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')} {v}"
                   for k, v in flags.items() if v is not False)
    with launched_server(cli, timeout_s=600) as srv:
        host, port = "127.0.0.1", int(srv.base_url.rsplit(":", 1)[1])
        pids = {k: v for k, v in process_titles(srv.pid).items()
                if k in PROCESS_NAMES or k.startswith(WORKER_PREFIX)}

        def forward_ct() -> int:
            info = httpx.get(srv.base_url + "/get_server_info", timeout=60).json()
            return int(info["internal_states"][0]["forward_ct"])

        _run_loop(run_clients(host, port, prompts_for(8, args.input_len, 1000), 4, True))  # warm-up
        for stream in args.stream_modes:
            best: Optional[Dict[str, Any]] = None
            for rep in range(args.repeats):
                httpx.post(srv.base_url + "/flush_cache", timeout=60)
                fc0, cpu0, client0 = forward_ct(), cpu_seconds(pids), time.process_time()
                records, _, wall = _run_loop(run_clients(host, port, prompts_for(n, args.input_len, 2000 + rep),
                                                         args.output_len, stream))
                client_cpu = time.process_time() - client0
                cpu1, fc1 = cpu_seconds(pids), forward_ct()
                row = http_row(args, n, stream, records, wall, fc1 - fc0,
                               {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}, client_cpu)
                print(format_row(row), flush=True)
                if best is None or row["throughput"] > best["throughput"]:
                    best = row
            assert best is not None
            results.append(best)
            if args.profile_dir and n in args.profile_at:
                httpx.post(srv.base_url + "/flush_cache", timeout=60)
                prof = Profiler(args.profile_dir, pids, 0.9 * best["wall_s"],
                                f"http.n{n}.{'stream' if stream else 'nostream'}")
                prof.start()
                _run_loop(run_clients(host, port, prompts_for(n, args.input_len, 99), args.output_len, stream))
                best["profile"] = prof.finish()
                for name, summary in best["profile"].items():
                    print(format_summary(name, summary), flush=True)


def http_row(args: argparse.Namespace, n: int, stream: bool, records: List[Any], wall: float, forwards: int,
             cpu: Dict[str, float], client_cpu: float) -> Dict[str, Any]:
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed, e.g. {errors[0]}")
    tokens = sum(r.completion_tokens for r in records)
    # At least 30 forwards and a quarter of the run long: counts arrive in chunks, and a short
    # window (the last stream admitted just before the first one ends) is mostly their error.
    window = steady_window(records, max(30 * args.forward_ms / 1000, wall / 4)) if stream else None
    steady = window[2] / (window[1] - window[0]) if window else None
    steps = max(args.output_len, 1)  # decode steps per request: the per-step CPU unit
    row: Dict[str, Any] = {
        "mode": "http", "num_reqs": n, "stream": stream, "loop": "overlap", "tokens": tokens,
        "wall_s": wall, "whole_run_throughput": tokens / wall, "throughput": steady or tokens / wall,
        "steady": steady is not None, "forwards": forwards, "ideal": ideal_throughput(args, n),
        "device_busy_share": forwards * args.forward_ms / 1000 / wall,
        "client_cpu_share": client_cpu / wall,
        # How long until every stream had its first token: admission through HTTP and prefill.
        "all_started_s": max(r.first for r in records) - min(r.sent for r in records) if stream else None,
    }
    grouped: Dict[str, List[float]] = {}
    for name, seconds in cpu.items():
        grouped.setdefault(short_name(name), []).append(seconds)
    for short, times in grouped.items():  # the HTTP workers together; the busiest one apart
        seconds = sum(times)
        row[f"{short}_cpu_share"] = seconds / wall
        row[f"{short}_cpu_ms_per_step"] = 1000 * seconds / steps
        row[f"{short}_cpu_us_per_token"] = 1e6 * seconds / max(tokens, 1)
        row[f"{short}_max_cpu_share"] = max(times) / wall
    row["http_workers"] = len(grouped.get("worker", []))
    row["cpu_ms_per_step"] = row.get("scheduler_cpu_ms_per_step")
    row["cpu_share"] = row.get("scheduler_cpu_share")
    return row


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


# ---------------------------------------------------------------------------- output
def format_row(r: Dict[str, Any]) -> str:
    extra = ""
    if r["mode"] == "http":
        started = "" if r["all_started_s"] is None else f", all streams started after {r['all_started_s']:.2f} s"
        extra = (f" | whole run {r['whole_run_throughput']:,.0f} tok/s{started}, device busy "
                 f"{100 * r['device_busy_share']:.0f}% | CPU share of a core: scheduler "
                 f"{100 * r.get('scheduler_cpu_share', 0):.0f}%, detokenizer {100 * r.get('detokenizer_cpu_share', 0):.0f}%, "
                 f"main {100 * r.get('main_cpu_share', 0):.0f}%{_workers(r)}, client {100 * r['client_cpu_share']:.0f}%")
    if r["mode"] == "inproc":
        extra = f" | forward sleep overshoot {r['forward_overshoot_ms']:.2f} ms/step"
    return (f"{r['mode']:<6} N={r['num_reqs']:<5} stream={str(r['stream']):<5} {r['loop']:<7} "
            f"{r['throughput']:>10,.0f} tok/s = {100 * r['throughput'] / r['ideal']:5.1f}% of ideal "
            f"{r['ideal']:,.0f} | scheduler CPU {r['cpu_ms_per_step'] or 0:.2f} ms/step "
            f"({1000 * (r['cpu_ms_per_step'] or 0) / r['num_reqs']:.2f} us/req){extra}")


def _workers(r: Dict[str, Any]) -> str:
    if not r.get("http_workers"):
        return ""
    return (f", {r['http_workers']} HTTP workers {100 * r['worker_cpu_share']:.0f}% "
            f"(busiest {100 * r['worker_max_cpu_share']:.0f}%)")


def markdown_table(results: List[Dict[str, Any]]) -> str:
    lines = ["| mode | running | stream | loop | tok/s | % of ideal | scheduler CPU ms/step | "
             "CPU us/token: scheduler / detokenizer / main | % of a core: scheduler / detokenizer / main / client "
             "| HTTP workers: % of a core, all (busiest) | forward sleep overshoot ms/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        per_token = " / ".join(_fmt(r.get(f"{p}_cpu_us_per_token"), ".2f") for p in ("scheduler", "detokenizer", "main"))
        shares = " / ".join(_fmt(None if r.get(k) is None else 100 * r[k], ".0f", "%")
                            for k in ("scheduler_cpu_share", "detokenizer_cpu_share", "main_cpu_share", "client_cpu_share"))
        workers = (f"{r['http_workers']}: {100 * r['worker_cpu_share']:.0f}% ({100 * r['worker_max_cpu_share']:.0f}%)"
                   if r.get("http_workers") else "-")
        lines.append(f"| {r['mode']} | {r['num_reqs']} | {'yes' if r['stream'] else 'no'} | {r['loop']} | "
                     f"{r['throughput']:,.0f}{'' if r.get('steady', True) else ' (whole run)'} | "
                     f"{100 * r['throughput'] / r['ideal']:.0f}% | {r['cpu_ms_per_step'] or 0:.2f} | {per_token} | "
                     f"{shares} | {workers} | {_fmt(r.get('forward_overshoot_ms'), '.2f')} |")
    return "\n".join(lines)


def _fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-reqs", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--input-len", type=int, default=64)
    # Long enough that the streams still run together after the last one was admitted over HTTP.
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--forward-ms", type=float, default=10.0, help="A: simulated ms per forward")
    ap.add_argument("--per-token-ms", type=float, default=0.0, help="B: simulated ms per token of the batch")
    ap.add_argument("--modes", nargs="+", default=["inproc", "http"], choices=["inproc", "http"])
    ap.add_argument("--loops", nargs="+", default=["overlap", "normal"], choices=["overlap", "normal"],
                    help="in-process loops")
    ap.add_argument("--stream", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--incremental-streaming-output", action="store_true",
                    help="serve with --incremental-streaming-output (streamed chunks carry only what is new)")
    ap.add_argument("--tokenizer-worker-num", type=int, default=1,
                    help="HTTP worker processes of the http mode's server (the server's flag)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration (the best is kept)")
    ap.add_argument("--profile-dir", default=None, help="py-spy profiles of each process go here")
    ap.add_argument("--profile-at", type=int, nargs="*", default=[1024], help="sizes to profile")
    ap.add_argument("--result-file", default=None)
    ap.add_argument("--plot", default=None, help="PNG of %% of ideal and CPU per token against N")
    ap.add_argument("--baseline", default=None, help="a --result-file of an earlier run, drawn dashed in the plot")
    ap.add_argument("--baseline-label", default="before", help="what the baseline is, in the plot's legend")
    args = ap.parse_args()
    args.stream_modes = [s == "on" for s in args.stream]
    if args.profile_dir and not Profiler.available():
        raise SystemExit("--profile-dir needs py-spy (pip install py-spy)")
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs", flush=True)
    results: List[Dict[str, Any]] = []
    for n in args.num_reqs:
        if "inproc" in args.modes:
            inproc_phase(args, n, results)
        if "http" in args.modes:
            http_phase(args, n, results)
    print()
    print(markdown_table(results))
    load_after = os.getloadavg()
    print(f"\nload average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "load_before": load, "load_after": load_after,
                       "results": results}, f, indent=2, default=str)
    if args.plot:
        from host_plot import plot

        baseline = None
        if args.baseline:
            with open(args.baseline) as f:
                baseline = json.load(f)["results"]
        plot(results, args.plot, baseline, args.baseline_label)


if __name__ == "__main__":
    main()
