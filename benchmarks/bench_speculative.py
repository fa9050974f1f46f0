"""NGRAM speculative decoding on/off, side by side in one run (issue 36), in-process (no HTTP).

Workloads (greedy, ignore_eos):
  copy    each prompt is a random prompt plus the first --copy-len tokens of the target's own
          greedy continuation of it; the reference output is the rest of that continuation, so
          the text the drafter copies from is the target's own and the output is known exactly.
  random  random prompts: little for the drafter to copy (acceptance is whatever it is).

For each workload and batch size (--batch-sizes, default 1 and 16) the same requests run with
speculation off and on; the table reports output tokens/s, the ratio on/off, the mean accept
length (tokens per request per verify step), the drafter's share of the wall time (drafting and
KV bookkeeping on the scheduling thread, outside the forward), ITL, and whether every output
equals the reference (the run without speculation).

  python benchmarks/bench_speculative.py                      # builtin model, table + JSON
  python benchmarks/bench_speculative.py --model 100m --out-len 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import resolve_model  # noqa: E402
from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput  # noqa: E402
from engine.scheduler.overlap_utils import scheduling_thread  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402


@dataclass
class Run:
    outputs: List[List[int]]
    duration: float
    output_tokens: int
    itl: List[float] = field(default_factory=list)
    accept_length: Optional[float] = None
    draft_share: Optional[float] = None


def run(model_path: str, prompts: List[List[int]], out_len: int, spec: bool, args: argparse.Namespace) -> Run:
    with scheduling_thread():  # as in the scheduler process
        return _run(model_path, prompts, out_len, spec, args)


def _run(model_path: str, prompts: List[List[int]], out_len: int, spec: bool, args: argparse.Namespace) -> Run:
    extra = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.num_draft_tokens) if spec else {}
    server_args = ServerArgs(model_path=model_path, device="cpu", log_level="warning", dtype=args.dtype,
                             max_total_tokens=args.max_total_tokens, max_running_requests=len(prompts),
                             disable_overlap_schedule=True, chunked_prefill_size=-1, **extra)
    scheduler = Scheduler(server_args)
    drafting = [0.0]
    if scheduler.spec is not None:
        # Time the scheduling-thread side of each verify step (drafting, slots, acceptance bookkeeping).
        spec_obj = scheduler.spec
        prepare, process = spec_obj.prepare, spec_obj.process

        def timed_prepare(batch):
            t = time.perf_counter()
            try:
                return prepare(batch)
            finally:
                drafting[0] += time.perf_counter() - t

        def timed_process(batch, step):
            t = time.perf_counter()
            try:
                return process(batch, step)
            finally:
                drafting[0] += time.perf_counter() - t

        spec_obj.prepare, spec_obj.process = timed_prepare, timed_process  # type: ignore[method-assign]
    greedy = {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}
    scheduler.add_request(TokenizedGenerateReqInput(rid="warmup", input_ids=prompts[0][:8],
                                                    sampling_params=dict(greedy, max_new_tokens=4)))
    while scheduler.has_work():
        scheduler.step()
    scheduler.flush_cache()
    scheduler.outbox.clear()
    drafting[0] = 0.0
    if scheduler.spec is not None:
        scheduler.spec.reset_stats()  # count the measured requests only
    outputs: Dict[str, List[int]] = {str(i): [] for i in range(len(prompts))}
    last: Dict[str, float] = {}
    itl: List[float] = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        scheduler.add_request(TokenizedGenerateReqInput(rid=str(i), input_ids=p, stream=True, sampling_params=greedy))
    while scheduler.has_work():
        scheduler.step()
        now = time.perf_counter()
        for msg in scheduler.outbox:
            if not isinstance(msg, BatchTokenIDOutput):
                continue
            for rid, ids in zip(msg.rids, msg.output_ids):
                if ids and rid in last:
                    itl.extend([(now - last[rid]) / len(ids)] * len(ids))
                if ids:
                    last[rid] = now
                outputs[rid].extend(ids)
        scheduler.outbox.clear()
    duration = time.perf_counter() - start
    state = scheduler.internal_state()
    scheduler.shutdown()
    outs = [outputs[str(i)] for i in range(len(prompts))]
    return Run(outs, duration, sum(map(len, outs)), itl, accept_length=state.get("avg_spec_accept_length"),
               draft_share=drafting[0] / duration if scheduler.spec is not None else None)


def workloads(model_path: str, vocab: int, batch: int, args: argparse.Namespace) -> Dict[str, List[List[int]]]:
    rng = random.Random(args.seed + batch)
    bases = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(batch)]
    # The target's own greedy continuation (speculation off), long enough to copy from and to continue.
    full = run(model_path, bases, args.copy_len + args.out_len, False, args).outputs
    return {"copy": [b + f[:args.copy_len] for b, f in zip(bases, full)], "random": bases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin", help="builtin | tiny | 100m | a model directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--copy-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=12)
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_speculative.json")
    args = ap.parse_args()
    model_path, vocab = resolve_model(args.model, args.dtype)
    rows = []
    for batch in args.batch_sizes:
        for name, prompts in workloads(model_path, vocab, batch, args).items():
            off = run(model_path, prompts, args.out_len, False, args)
            on = run(model_path, prompts, args.out_len, True, args)
            rows.append({
                "workload": name, "batch": batch,
                "off_tok_s": off.output_tokens / off.duration, "on_tok_s": on.output_tokens / on.duration,
                "speedup": (on.output_tokens / on.duration) / (off.output_tokens / off.duration),
                "accept_length": on.accept_length, "draft_share": on.draft_share,
                "off_median_itl_ms": 1000 * statistics.median(off.itl) if off.itl else None,
                "on_median_itl_ms": 1000 * statistics.median(on.itl) if on.itl else None,
                "exact": on.outputs == off.outputs,
            })
            r = rows[-1]
            print(f"{name:<7} bs={batch:<3} off {r['off_tok_s']:8.1f} tok/s  on {r['on_tok_s']:8.1f} tok/s  "
                  f"x{r['speedup']:.2f}  accept {r['accept_length']:.2f}  draft share {100 * r['draft_share']:.1f}%  "
                  f"exact {r['exact']}", flush=True)
    print()
    print(f"{'workload':<9}{'batch':>6}{'off tok/s':>11}{'on tok/s':>10}{'on/off':>8}{'accept':>8}{'draft%':>8}"
          f"{'ITL off':>9}{'ITL on':>8}{'exact':>7}")
    for r in rows:
        print(f"{r['workload']:<9}{r['batch']:>6}{r['off_tok_s']:>11.1f}{r['on_tok_s']:>10.1f}{r['speedup']:>8.2f}"
              f"{r['accept_length']:>8.2f}{100 * r['draft_share']:>8.1f}{r['off_median_itl_ms']:>9.2f}"
              f"{r['on_median_itl_ms']:>8.2f}{str(r['exact']):>7}")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
