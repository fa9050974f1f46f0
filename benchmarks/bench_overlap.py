"""Overlap scheduling against the normal loop, side by side in one process.

For each configuration the same request set (N decoding requests, fixed input and output
lengths, ignore_eos) runs through the in-process Scheduler with the real model, once with
`event_loop_overlap` and once with the normal loop, alternating, best of --repeats. Reported:
output throughput of each loop and their ratio, and for the normal loop the scheduler's CPU time
per step (everything but the forward) as a share of the step, and the noise: the spread of each
loop's own repeats.

--device-forward-ms T replaces the model's forward by one that takes T ms of wall time without
using the CPU (it sleeps, as the host does while a GPU computes) and returns fixed tokens: the
scheduler's work is real, the forward is what an accelerator would look like to it. That is the
setting overlap scheduling is for; on this CPU the real forward needs every core.

  python benchmarks/bench_overlap.py --model builtin --num-reqs 64 256
  python benchmarks/bench_overlap.py --model 100m --num-reqs 64 --profile overlap.txt
  python benchmarks/bench_overlap.py --num-reqs 64 256 --stream --device-forward-ms 5

--phase prefill times a burst of prefills instead (requests with one output token, chunked, so
prefill batches follow each other) in the overlap loop with consecutive prefills overlapped (the
default) and with --disable-consecutive-prefill-overlap: wall time of the burst and mean time to
first token.

  python benchmarks/bench_overlap.py --phase prefill --num-reqs 32 --input-len 256 --device-forward-ms 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import resolve_model  # noqa: E402
from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput  # noqa: E402
from engine.scheduler.overlap_utils import scheduling_thread, write_relay  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.scheduler.tp_worker import GenerationBatchResult  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402


def make_scheduler(model_path: str, num_reqs: int, dtype: str) -> Scheduler:
    """One scheduler for both loops: run_once picks the loop from `enable_overlap`."""
    args = ServerArgs(model_path=model_path, device="cpu", dtype=dtype, log_level="warning",
                      max_total_tokens=max(8192, num_reqs * 400), max_running_requests=num_reqs,
                      chunked_prefill_size=4096, max_prefill_tokens=8192)
    return Scheduler(args)


def use_device_like_forward(s: Scheduler, forward_ms: float) -> None:
    """A forward that costs `forward_ms` of wall time and no CPU, and samples token 100."""
    worker = s.worker

    def forward_batch_generation(batch) -> GenerationBatchResult:
        time.sleep(forward_ms / 1000)
        nxt = torch.full((batch.batch_size,), 100, dtype=torch.int64)
        write_relay(worker.output_tokens_buf, batch.req_pool_indices, nxt)
        return GenerationBatchResult(logits_output=None, next_token_ids=nxt)

    worker.forward_batch_generation = forward_batch_generation


def submit(s: Scheduler, num_reqs: int, input_len: int, output_len: int, vocab: int, seed: int,
           stream: bool = False) -> None:
    rng = random.Random(seed)
    for i in range(num_reqs):
        s.add_request(TokenizedGenerateReqInput(
            rid=f"{seed}-{i}", input_ids=[rng.randrange(10, vocab - 10) for _ in range(input_len)], stream=stream,
            sampling_params={"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True}))


class TimedScheduler:
    """Wraps run_batch to split each normal-loop step into forward time and scheduler time."""

    def __init__(self, s: Scheduler) -> None:
        self.forward_s = 0.0
        self.decode_steps = 0
        orig = s.run_batch

        def run_batch(batch):
            t = time.perf_counter()
            out = orig(batch)
            self.forward_s += time.perf_counter() - t
            self.decode_steps += batch.forward_mode.is_decode()
            return out

        s.run_batch = run_batch
        self.s = s

    def close(self) -> None:
        del self.s.run_batch  # back to the class's method


def run_once(s: Scheduler, num_reqs: int, input_len: int, output_len: int, vocab: int, seed: int,
             stream: bool = False) -> Dict:
    submit(s, num_reqs, input_len, output_len, vocab, seed, stream)
    # Prefill everything first so the timed part is the decode phase with all requests running.
    step = s.step_overlap if s.enable_overlap else s.step
    while s.waiting_queue or s.inbox or s.chunked_req is not None:
        step()
    # The overlap loop still has the last prefill in flight here: process it now, so both loops
    # start the timed decode phase from the same state (nothing in flight, one token per request).
    while s.result_queue:
        s._pop_and_process()
    timer = None if s.enable_overlap else TimedScheduler(s)
    tokens_before = sum(len(r.output_ids) for r in s.running_batch.reqs)
    steps = 0
    t0 = time.perf_counter()
    while s.has_work():
        step()
        steps += 1
    elapsed = time.perf_counter() - t0
    if timer is not None:
        timer.close()
    s.outbox.clear()
    out = {"decode_tokens": num_reqs * output_len - tokens_before, "elapsed_s": elapsed, "steps": steps}
    out["throughput"] = out["decode_tokens"] / elapsed
    if timer is not None:
        out["forward_s"] = timer.forward_s
        out["sched_share"] = 1 - timer.forward_s / elapsed
        out["sched_ms_per_step"] = 1000 * (elapsed - timer.forward_s) / max(steps, 1)
        out["step_ms"] = 1000 * elapsed / max(steps, 1)
    s.flush_cache()
    return out


def run_prefill_burst(s: Scheduler, num_reqs: int, input_len: int, vocab: int, seed: int) -> Dict:
    """Overlap loop over `num_reqs` one-token requests: burst wall time and mean time to first token."""
    submit(s, num_reqs, input_len, 1, vocab, seed)
    first_token: Dict[str, float] = {}
    t0 = time.perf_counter()
    while s.has_work():
        s.step_overlap()
        now = time.perf_counter() - t0
        for msg in s.outbox:
            if isinstance(msg, BatchTokenIDOutput):
                for rid in msg.rids:
                    first_token.setdefault(rid, now)
        s.outbox.clear()
    elapsed = time.perf_counter() - t0
    s.flush_cache()
    return {"elapsed_s": elapsed, "mean_ttft_s": sum(first_token.values()) / max(len(first_token), 1),
            "throughput": num_reqs * input_len / elapsed}


def prefill_phase(args, model_path: str, vocab: int) -> List[Dict]:
    results: List[Dict] = []
    for n in args.num_reqs:
        sched = make_scheduler(model_path, n, args.dtype)
        sched.prefill.chunked_prefill_size = args.input_len * 2  # two requests per prefill batch
        if args.device_forward_ms > 0:
            use_device_like_forward(sched, args.device_forward_ms)
        runs: Dict[str, List[Dict]] = {"overlapped": [], "disabled": []}
        for rep in range(args.repeats):
            for mode in ("overlapped", "disabled") if rep % 2 == 0 else ("disabled", "overlapped"):
                sched.server_args.disable_consecutive_prefill_overlap = mode == "disabled"
                runs[mode].append(run_prefill_burst(sched, n, args.input_len, vocab, seed=rep))
        best = {mode: min(rs, key=lambda r: r["elapsed_s"]) for mode, rs in runs.items()}
        o, d = best["overlapped"], best["disabled"]
        print(f"prefill burst model={args.model} reqs={n} in={args.input_len} forward="
              f"{f'device-like {args.device_forward_ms:g} ms' if args.device_forward_ms else 'real'}: "
              f"overlapped {o['elapsed_s']:.3f} s (mean TTFT {1000 * o['mean_ttft_s']:.1f} ms), "
              f"disabled {d['elapsed_s']:.3f} s (mean TTFT {1000 * d['mean_ttft_s']:.1f} ms), "
              f"burst time ratio disabled/overlapped {d['elapsed_s'] / o['elapsed_s']:.3f}", flush=True)
        results.append({"num_reqs": n, "best": best, "runs": runs})
        sched.shutdown()
    return results


def main() -> None:
    with scheduling_thread():  # as in the scheduler process
        _main()


def _main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-reqs", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--stream", action="store_true",
                    help="streaming requests: every step emits every request's token, as a server does")
    ap.add_argument("--device-forward-ms", type=float, default=0.0,
                    help="replace the forward by a T ms sleep (an accelerator as the host sees it)")
    ap.add_argument("--profile", default=None, help="write a pyinstrument profile of one normal-loop run here")
    ap.add_argument("--phase", default="decode", choices=["decode", "prefill"],
                    help="decode: overlap vs normal loop; prefill: consecutive prefills overlapped or not")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()

    model_path, vocab = resolve_model(args.model, args.dtype)
    if args.phase == "prefill":
        results = prefill_phase(args, model_path, vocab)
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump({"args": vars(args), "results": results}, f, indent=2)
        return
    results: List[Dict] = []
    for n in args.num_reqs:
        # One scheduler (one model, one forward thread, as in a scheduler process) runs both loops.
        sched = make_scheduler(model_path, n, args.dtype)
        if args.device_forward_ms > 0:
            use_device_like_forward(sched, args.device_forward_ms)
        runs: Dict[str, List[Dict]] = {"normal": [], "overlap": []}
        for rep in range(args.repeats):
            for mode in ("normal", "overlap") if rep % 2 == 0 else ("overlap", "normal"):
                sched.enable_overlap = mode == "overlap"
                runs[mode].append(run_once(sched, n, args.input_len, args.output_len, vocab, seed=rep,
                                           stream=args.stream))
        best = {mode: max(rs, key=lambda r: r["throughput"]) for mode, rs in runs.items()}
        # Noise: how far a loop's own repeats fall below its best.
        noise = max(1 - min(r["throughput"] for r in rs) / best[mode]["throughput"] for mode, rs in runs.items())
        row = {"num_reqs": n, "normal": best["normal"], "overlap": best["overlap"], "noise": noise,
               "ratio": best["overlap"]["throughput"] / best["normal"]["throughput"], "runs": runs}
        results.append(row)
        nb = best["normal"]
        forward = f"device-like forward {args.device_forward_ms:g} ms" if args.device_forward_ms else "real forward"
        print(f"model={args.model} dtype={args.dtype} reqs={n} in={args.input_len} out={args.output_len} "
              f"stream={args.stream} {forward}: "
              f"normal {nb['throughput']:.1f} tok/s (step {nb['step_ms']:.1f} ms, scheduler "
              f"{nb['sched_ms_per_step']:.1f} ms = {100 * nb['sched_share']:.0f}%), "
              f"overlap {best['overlap']['throughput']:.1f} tok/s, ratio {row['ratio']:.2f}x, "
              f"noise (repeat spread) {100 * noise:.1f}%", flush=True)
        if args.profile:
            from pyinstrument import Profiler

            prof = Profiler(interval=0.001)
            prof.start()
            sched.enable_overlap = False
            run_once(sched, n, args.input_len, args.output_len, vocab, seed=99)
            prof.stop()
            with open(f"{args.profile}.{n}.txt", "w") as f:
                f.write(prof.output_text(unicode=False, color=False, show_all=False))
        sched.shutdown()
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
