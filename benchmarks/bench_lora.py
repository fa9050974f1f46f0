"""Multi-LoRA serving against the base model alone, side by side in one run (issue 38), in-process.

64 requests (--num-requests) of random prompts, greedy, ignore_eos, all submitted at once:
  base        a server without LoRA, every request on the base model;
  lora        a server with --max-loras-per-batch 8 and 8 random rank-16 adapters on every
              projection, the requests spread round-robin over the adapters;
  lora-base   the LoRA server with every request on the base model (the cost of the machinery alone).
The table reports SGLang's metric set (request and token throughput, TTFT, ITL, TPOT, end-to-end
latency: mean, median, p99) and each configuration's output throughput relative to `base`; beside
the wall time, the CPU time of the process over the timed run and of the forwards by mode (prefill:
EXTEND and MIXED, decode), which move much less than wall time on a machine shared with other work.

  python benchmarks/bench_lora.py                          # builtin model, table + JSON
  python benchmarks/bench_lora.py --model 100m --num-requests 64 --out-len 64 --repeats 2 --json lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import resolve_model  # noqa: E402
from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput  # noqa: E402
from engine.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from engine.model_executor.forward_batch_info import ForwardBatch  # noqa: E402
from engine.model_executor.model_runner import ModelRunner  # noqa: E402
from engine.request_options import RequestOptions  # noqa: E402
from engine.scheduler.overlap_utils import scheduling_thread  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.scheduler.tp_worker import TpModelWorker  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model_path: str, path: str, rank: int, seed: int) -> None:
    """A PEFT-format adapter with random A and B on every projection of the model."""
    from safetensors.torch import save_file

    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
              "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, (n_in, n_out) in shapes.items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
                   "bias": "none"}, f)


@dataclass
class Run:
    duration: float
    output_tokens: int
    input_tokens: int
    cpu_s: float = 0.0  # CPU time of the process (every thread) over the timed run
    # CPU time of the process during the forwards, by mode ("prefill": EXTEND and MIXED; "decode")
    forward_cpu_s: Dict[str, float] = field(default_factory=dict)
    ttft: List[float] = field(default_factory=list)
    itl: List[float] = field(default_factory=list)
    tpot: List[float] = field(default_factory=list)
    e2e: List[float] = field(default_factory=list)


def run(model_path: str, prompts: List[List[int]], out_len: int, loras: List[Optional[str]],
        lora_paths: Optional[List[str]], args: argparse.Namespace) -> Run:
    with scheduling_thread():  # as in the scheduler process
        return _run(model_path, prompts, out_len, loras, lora_paths, args)


def _run(model_path: str, prompts: List[List[int]], out_len: int, loras: List[Optional[str]],
         lora_paths: Optional[List[str]], args: argparse.Namespace) -> Run:
    server_args = ServerArgs(model_path=model_path, device="cpu", log_level="warning", dtype=args.dtype,
                             max_total_tokens=args.max_total_tokens, max_running_requests=len(prompts),
                             lora_paths=lora_paths, max_loras_per_batch=args.max_loras_per_batch)
    scheduler = Scheduler(server_args)
    forward_cpu: Dict[str, float] = {}
    if isinstance(scheduler.worker, TpModelWorker) and scheduler.worker.real_runner is not None:
        _time_forwards(scheduler.worker.real_runner, forward_cpu)
    greedy = {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}
    for i, name in enumerate(sorted({n for n in loras if n is not None}) or [None]):  # warm-up, each adapter
        scheduler.add_request(TokenizedGenerateReqInput(rid=f"warmup{i}", input_ids=prompts[0][:8],
                                                        sampling_params=dict(greedy, max_new_tokens=2),
                                                        options=RequestOptions(lora_path=name)))
    while scheduler.has_work():
        scheduler.step()
    scheduler.flush_cache()
    scheduler.outbox.clear()
    forward_cpu.clear()  # the warm-up's forwards are not part of the run
    n = len(prompts)
    first: Dict[str, float] = {}
    last: Dict[str, float] = {}
    counts: Dict[str, int] = {str(i): 0 for i in range(n)}
    result = Run(0.0, 0, sum(map(len, prompts)))
    cpu_start = time.process_time()
    start = time.perf_counter()
    for i, (p, name) in enumerate(zip(prompts, loras)):
        scheduler.add_request(TokenizedGenerateReqInput(rid=str(i), input_ids=p, stream=True, sampling_params=greedy,
                                                        options=RequestOptions(lora_path=name)))
    while scheduler.has_work():
        scheduler.step()
        now = time.perf_counter()
        for msg in scheduler.outbox:
            if not isinstance(msg, BatchTokenIDOutput):
                continue
            for rid, ids, reason in zip(msg.rids, msg.output_ids, msg.finished_reasons):
                if reason is not None and reason.get("type") == "abort":
                    raise RuntimeError(f"request {rid} aborted: {reason}")
                if not ids:
                    continue
                if rid not in first:
                    first[rid] = now
                    result.ttft.append(now - start)
                else:
                    result.itl.extend([(now - last[rid]) / len(ids)] * len(ids))
                last[rid] = now
                counts[rid] += len(ids)
        scheduler.outbox.clear()
    result.duration = time.perf_counter() - start
    result.cpu_s = time.process_time() - cpu_start
    result.forward_cpu_s = dict(forward_cpu)
    scheduler.shutdown()
    result.output_tokens = sum(counts.values())
    for rid in counts:
        result.e2e.append(last[rid] - start)
        if counts[rid] > 1:
            result.tpot.append((last[rid] - first[rid]) / (counts[rid] - 1))
    return result


def _time_forwards(runner: ModelRunner, totals: Dict[str, float]) -> None:
    """Add each forward's CPU time (the whole process's: the OpenMP team included) to totals[mode]."""
    forward = runner.forward

    def timed(forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        begin = time.process_time()
        try:
            return forward(forward_batch)
        finally:
            mode = "decode" if forward_batch.forward_mode.is_decode() else "prefill"
            totals[mode] = totals.get(mode, 0.0) + time.process_time() - begin

    runner.forward = timed  # type: ignore[method-assign]  # a benchmark's probe on its own runner


def _stats(values: List[float]) -> Dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {"mean": statistics.fmean(values) * 1000, "median": statistics.median(values) * 1000,
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1000}


def summarize(run_: Run) -> Dict[str, object]:
    return {"duration_s": run_.duration, "request_throughput": len(run_.e2e) / run_.duration,
            "input_token_throughput": run_.input_tokens / run_.duration,
            "output_token_throughput": run_.output_tokens / run_.duration,
            "total_token_throughput": (run_.input_tokens + run_.output_tokens) / run_.duration,
            "ttft_ms": _stats(run_.ttft), "itl_ms": _stats(run_.itl), "tpot_ms": _stats(run_.tpot),
            "e2e_latency_ms": _stats(run_.e2e), "cpu_s": run_.cpu_s,
            "forward_cpu_s": {"prefill": run_.forward_cpu_s.get("prefill", 0.0),
                              "decode": run_.forward_cpu_s.get("decode", 0.0)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--in-len", type=int, default=128)
    parser.add_argument("--out-len", type=int, default=32)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the configurations in turn this many times, keep each one's fastest")
    parser.add_argument("--warmup-runs", type=int, default=1,
                        help="untimed runs of the `lora` workload before the timed ones (the process's warm-up)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    model_path, vocab = resolve_model(args.model, args.dtype)
    load_start = os.getloadavg()[0]
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(vocab) for _ in range(args.in_len)] for _ in range(args.num_requests)]
    with tempfile.TemporaryDirectory() as root:
        names = [f"adapter{i}" for i in range(args.num_adapters)]
        for i, name in enumerate(names):
            write_adapter(model_path, os.path.join(root, name), args.rank, seed=i)
        lora_paths = [f"{name}={os.path.join(root, name)}" for name in names]
        base_only: List[Optional[str]] = [None] * len(prompts)
        spread: List[Optional[str]] = [names[i % len(names)] for i in range(len(prompts))]
        configs = {"base": (base_only, None), "lora": (spread, lora_paths), "lora-base": (base_only, lora_paths)}
        runs: Dict[str, Run] = {}
        # The first full-size run in a process pays one-time costs that the per-server warm-up (short
        # prompts) does not (it took 4.6x as long as every later run of either server, in bfloat16):
        # an untimed run of the whole workload first, or the configuration that runs first loses.
        for _ in range(args.warmup_runs):
            run(model_path, prompts, args.out_len, spread, lora_paths, args)
        names_in_order = list(configs)
        for repeat in range(args.repeats):  # alternating: a machine that slows down hurts every configuration
            # each round starts with another configuration, so none always follows the same neighbour
            shift = repeat % len(names_in_order)
            for name in names_in_order[shift:] + names_in_order[:shift]:
                loras, paths = configs[name]
                result = run(model_path, prompts, args.out_len, loras, paths, args)
                if name not in runs or result.duration < runs[name].duration:
                    runs[name] = result
    results = {name: summarize(r) for name, r in runs.items()}
    base_tput = float(results["base"]["output_token_throughput"])  # type: ignore[arg-type]
    print(f"model={args.model} dtype={args.dtype} requests={args.num_requests} adapters={args.num_adapters} "
          f"rank={args.rank} in={args.in_len} out={args.out_len}")
    print(f"load average {load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end, {os.cpu_count()} CPUs")
    print(f"{'config':<10} {'req/s':>7} {'out tok/s':>10} {'vs base':>8} {'TTFT med':>9} {'ITL med':>8} "
          f"{'TPOT med':>9} {'E2E p99':>8}  (ms) {'wall s':>7} {'CPU s':>6} {'fwd CPU s: prefill':>18} {'decode':>7}")
    for name, r in results.items():
        out_tput = float(r["output_token_throughput"])  # type: ignore[arg-type]
        fwd = r["forward_cpu_s"]
        print(f"{name:<10} {r['request_throughput']:>7.2f} {out_tput:>10.1f} {out_tput / base_tput:>8.2f} "
              f"{r['ttft_ms']['median']:>9.1f} {r['itl_ms']['median']:>8.1f} "  # type: ignore[index]
              f"{r['tpot_ms']['median']:>9.1f} {r['e2e_latency_ms']['p99']:>8.1f}      "  # type: ignore[index]
              f"{r['duration_s']:>7.2f} {r['cpu_s']:>6.2f} {fwd['prefill']:>18.2f} {fwd['decode']:>7.2f}")  # type: ignore[index]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_average": [load_start, os.getloadavg()[0]], "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
