"""Offline throughput of the scheduler in-process (no HTTP), with SGLang's metric set.

Workloads:
  random         N prompts, input lengths U[min,max], output lengths U[min,max], ignore_eos.
  shared-prefix  G groups x P prompts with a shared system prompt, a question and a fixed output.

Comparisons in the same run:
  --compare-hf         transformers' generate (static batches, left padding) on the same prompts.
  --compare-no-radix   the same workload with --disable-radix-cache.

Examples:
  python benchmarks/bench_offline_throughput.py --model builtin --dataset random --compare-hf
  python benchmarks/bench_offline_throughput.py --model 100m --dataset shared-prefix --compare-no-radix
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

import torch  # noqa: E402

from bench_models import resolve_model  # noqa: E402
from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput  # noqa: E402
from engine.scheduler.overlap_utils import scheduling_thread  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402


@dataclass
class Workload:
    prompts: List[List[int]]
    output_lens: List[int]


def random_workload(n: int, in_range, out_range, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(*in_range))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*out_range) for _ in range(n)])


def shared_prefix_workload(groups: int, per_group: int, system_len: int, question_len: int, output_len: int,
                           vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = [rng.randrange(10, vocab - 10) for _ in range(system_len)]
        for _ in range(per_group):
            prompts.append(system + [rng.randrange(10, vocab - 10) for _ in range(question_len)])
    return Workload(prompts, [output_len] * len(prompts))


@dataclass
class RunResult:
    name: str
    duration: float
    input_tokens: int
    output_tokens: int
    ttft: List[float] = field(default_factory=list)
    e2e: List[float] = field(default_factory=list)
    itl: List[float] = field(default_factory=list)
    cache_hit_rate: Optional[float] = None

    def metrics(self) -> Dict[str, float]:
        n = len(self.e2e) or 1
        m = {
            "duration_s": self.duration,
            "request_throughput": n / self.duration,
            "input_throughput": self.input_tokens / self.duration,
            "output_throughput": self.output_tokens / self.duration,
            "total_throughput": (self.input_tokens + self.output_tokens) / self.duration,
        }
        for key, values in (("ttft", self.ttft), ("itl", self.itl), ("e2e", self.e2e)):
            if values:
                s = sorted(values)
                m[f"mean_{key}_ms"] = 1000 * statistics.fmean(s)
                m[f"median_{key}_ms"] = 1000 * statistics.median(s)
                m[f"p99_{key}_ms"] = 1000 * s[min(len(s) - 1, int(0.99 * len(s)))]
        if self.cache_hit_rate is not None:
            m["cache_hit_rate"] = self.cache_hit_rate
        return m


def run_engine(name: str, model_path: str, workload: Workload, server_kwargs: Dict) -> RunResult:
    with scheduling_thread():  # as in the scheduler process
        return _run_engine(name, model_path, workload, server_kwargs)


def _run_engine(name: str, model_path: str, workload: Workload, server_kwargs: Dict) -> RunResult:
    server_kwargs.setdefault("device", "cpu")
    args = ServerArgs(model_path=model_path, log_level="warning", **server_kwargs)
    scheduler = Scheduler(args)
    # Warm-up: one short request through prefill and decode.
    scheduler.add_request(TokenizedGenerateReqInput(
        rid="warmup", input_ids=workload.prompts[0][:16],
        sampling_params={"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}))
    while scheduler.has_work():
        scheduler.step()
    scheduler.flush_cache()
    scheduler.stats.total_prompt_tokens = scheduler.stats.total_cached_tokens = 0
    scheduler.outbox.clear()

    start = time.perf_counter()
    for i, (p, out_len) in enumerate(zip(workload.prompts, workload.output_lens)):
        scheduler.add_request(TokenizedGenerateReqInput(
            rid=str(i), input_ids=p, stream=True,
            sampling_params={"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}))
    first: Dict[str, float] = {}
    last: Dict[str, float] = {}
    itl: List[float] = []
    e2e: List[float] = []
    out_tokens = 0
    while scheduler.has_work():
        scheduler.step()
        now = time.perf_counter()
        for msg in scheduler.outbox:
            if not isinstance(msg, BatchTokenIDOutput):
                continue
            for rid, ids, fr in zip(msg.rids, msg.output_ids, msg.finished_reasons):
                if not ids and fr is None:
                    continue
                if rid not in first:
                    first[rid] = now - start
                elif ids:
                    itl.extend([(now - start - last[rid]) / len(ids)] * len(ids))
                last[rid] = now - start
                out_tokens += len(ids)
                if fr is not None:
                    e2e.append(now - start)
        scheduler.outbox.clear()
    duration = time.perf_counter() - start
    # Its forward thread's OpenMP team would otherwise stay and slow whatever runs next.
    scheduler.shutdown()
    return RunResult(name, duration, sum(map(len, workload.prompts)), out_tokens,
                     ttft=list(first.values()), e2e=e2e, itl=itl, cache_hit_rate=scheduler.stats.cache_hit_rate())


def run_hf(model_path: str, workload: Workload, batch_size: int, dtype: str) -> RunResult:
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype)
    model.eval()
    pad = 0
    start = time.perf_counter()
    e2e = []
    with torch.inference_mode():
        for b in range(0, len(workload.prompts), batch_size):
            prompts = workload.prompts[b:b + batch_size]
            outs = workload.output_lens[b:b + batch_size]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            n = max(outs)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=pad)
            e2e.extend([time.perf_counter() - start] * len(prompts))
    duration = time.perf_counter() - start
    # Only the tokens each request asked for count: static batching pays for the longest one.
    return RunResult("transformers", duration, sum(map(len, workload.prompts)), sum(workload.output_lens), e2e=e2e)


def print_table(results: List[RunResult]) -> None:
    keys = ["duration_s", "request_throughput", "input_throughput", "output_throughput", "total_throughput",
            "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
            "mean_e2e_ms", "median_e2e_ms", "p99_e2e_ms", "cache_hit_rate"]
    rows = [r.metrics() for r in results]
    print(f"{'metric':<22}" + "".join(f"{r.name:>18}" for r in results))
    for k in keys:
        if any(k in m for m in rows):
            print(f"{k:<22}" + "".join(f"{m.get(k, float('nan')):>18.2f}" for m in rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin", help="builtin | tiny | 100m | a model directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--dataset", default="random", choices=["random", "shared-prefix"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 512], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--prompts-per-group", type=int, default=16)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--shared-output-len", type=int, default=64)
    ap.add_argument("--max-total-tokens", type=int, default=200_000)
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--chunked-prefill-size", type=int, default=2048)
    ap.add_argument("--max-prefill-tokens", type=int, default=4096)
    ap.add_argument("--compare-hf", action="store_true")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--compare-no-radix", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()

    model_path, vocab = resolve_model(args.model, args.dtype)
    if args.dataset == "random":
        wl = random_workload(args.num_prompts, args.input_len, args.output_len, vocab, args.seed)
    else:
        wl = shared_prefix_workload(args.groups, args.prompts_per_group, args.system_len, args.question_len,
                                    args.shared_output_len, vocab, args.seed)
    kwargs = dict(dtype=args.dtype, max_total_tokens=args.max_total_tokens,
                  max_running_requests=args.max_running_requests, chunked_prefill_size=args.chunked_prefill_size,
                  max_prefill_tokens=args.max_prefill_tokens)
    results = [run_engine("engine", model_path, wl, kwargs)]
    if args.compare_no_radix:
        results.append(run_engine("engine-no-radix", model_path, wl, dict(kwargs, disable_radix_cache=True)))
    if args.compare_hf:
        results.append(run_hf(model_path, wl, args.hf_batch_size, args.dtype))
    print(f"model={args.model} dtype={args.dtype} dataset={args.dataset} prompts={len(wl.prompts)} "
          f"threads={torch.get_num_threads()}")
    print_table(results)
    base = results[0].metrics()["output_throughput"]
    for r in results[1:]:
        print(f"engine / {r.name} output throughput: {base / r.metrics()['output_throughput']:.2f}x")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"args": vars(args), "results": {r.name: r.metrics() for r in results}}, f, indent=2)


if __name__ == "__main__":
    main()
