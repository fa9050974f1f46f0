"""Latency of one static batch through ModelRunner (no scheduler, no server), like SGLang's
bench_one_batch: one prefill of `batch_size` prompts of `input_len` tokens, then `output_len`
greedy decode steps. With --compare-hf, transformers' greedy `generate` runs on the same model
and batch in the same process and the table shows the ratios.

    python benchmarks/bench_one_batch.py --random-llama 100m --batch-size 16 \\
        --input-len 128 --output-len 128 --dtype bfloat16 --compare-hf --result-file out.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional

# The engine's scheduler processes run with passive OpenMP waits (engine.launch.children);
# so does this in-process ModelRunner, before libgomp starts with torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from engine.configs.model_config import ModelConfig  # noqa: E402
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch  # noqa: E402
from engine.model_executor.model_runner import ModelRunner  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402

logger = logging.getLogger(__name__)

RANDOM_LLAMAS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    # ~110M parameters with untied embeddings (about 125M counting the LM head).
    "100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
}


def build_random_llama(size: str, out_dir: str, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**RANDOM_LLAMAS[size], max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class OneBatch:
    """Drives ModelRunner through prefill + decode the way the scheduler would."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.allocator = runner.token_to_kv_pool_allocator
        self.table = runner.req_to_token_pool.req_to_token

    def prefill(self, input_ids: torch.Tensor):
        bs, input_len = input_ids.shape
        self.rows = torch.tensor(self.runner.req_to_token_pool.alloc(bs), dtype=torch.int64)
        self.seq_lens = torch.full((bs,), input_len, dtype=torch.int64)
        out_loc = self.allocator.alloc_extend(
            torch.zeros(bs, dtype=torch.int64), self.seq_lens, torch.full((bs,), -1, dtype=torch.int64), bs * input_len
        )
        self.table[self.rows.to(self.table.device), :input_len] = out_loc.view(bs, input_len).to(self.table)
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=input_ids.reshape(-1),
            req_pool_indices=self.rows,
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens.tolist(),
            out_cache_loc=out_loc,
            extend_num_tokens=bs * input_len,
            extend_seq_lens=[input_len] * bs,
            extend_prefix_lens=[0] * bs,
        )
        return self._run(batch)

    def decode(self, tokens: torch.Tensor):
        last_loc = self.table[self.rows.to(self.table.device), (self.seq_lens - 1).to(self.table.device)]
        self.seq_lens = self.seq_lens + 1
        out_loc = self.allocator.alloc_decode(self.seq_lens, last_loc)
        self.table[self.rows.to(self.table.device), (self.seq_lens - 1).to(self.table.device)] = out_loc.to(self.table)
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=tokens,
            req_pool_indices=self.rows,
            seq_lens=self.seq_lens,
            seq_lens_cpu=self.seq_lens.tolist(),
            out_cache_loc=out_loc,
        )
        return self._run(batch)

    def _run(self, batch: ModelWorkerBatch) -> torch.Tensor:
        fb = ForwardBatch.init_new(batch, self.runner)
        return self.runner.sample(self.runner.forward(fb), fb)

    def release(self) -> None:
        """Give the batch's KV slots and request rows back (the warm-up run precedes the real one)."""
        slots = self.table[self.rows.to(self.table.device)][:, : int(self.seq_lens.max())].reshape(-1)
        self.allocator.free(torch.unique(slots.long()))
        self.runner.req_to_token_pool.free(self.rows.tolist())


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Parameter bytes one decode step reads: all but the embedding table (only bs rows of it are
    read), unless the LM head is the embedding table."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    tied = getattr(model.lm_head, "weight", None) is embed
    return total if tied else total - embed.numel() * embed.element_size()


def linear_flops_per_token(model: torch.nn.Module) -> int:
    """2 x the weights of every matmul a decode token goes through (linear layers and LM head)."""
    return 2 * sum(m.weight.numel() for name, m in model.named_modules()
                   if hasattr(m, "packed_weight") and getattr(m, "weight", None) is not None)


class MachineProbe:
    """Read bandwidth (a sum over a tensor far larger than the caches) and the bf16 matmul rate at a
    large shape, in this process, best of several runs: the ceilings a decode step is set against.
    `measure()` runs right before each timed repeat, so that each repeat's steps are set against what
    the machine did at that moment (a VM's bandwidth moves between minutes: 30-48 GB/s on the 2-core
    AMD EPYC within ten minutes)."""

    def __init__(self, device: str, read_bytes: int = 512 << 20, matmul_n: int = 2048) -> None:
        self.device, self.read_bytes, self.matmul_n = device, read_bytes, matmul_n
        self.x = torch.ones(read_bytes // 4, dtype=torch.float32, device=device)
        self.a = torch.randn(matmul_n, matmul_n, device=device).to(torch.bfloat16)
        self.b = torch.randn(matmul_n, matmul_n, device=device).to(torch.bfloat16)

    def _best(self, fn, reps: int) -> float:
        times = []
        for _ in range(reps):
            _sync(self.device)
            t = time.perf_counter()
            fn()
            _sync(self.device)
            times.append(time.perf_counter() - t)
        return min(times[1:])  # the first run warms up

    def measure(self) -> Dict[str, float]:
        read_s = self._best(lambda: self.x.sum(), 8)
        mm_s = self._best(lambda: torch.mm(self.a, self.b), 6)
        return dict(read_bandwidth_Bps=self.read_bytes / read_s, matmul_flops=2 * self.matmul_n**3 / mm_s)


def decode_floors(runner: ModelRunner, bs: int, context_lens: List[int], machine: Dict[str, float]) -> Dict:
    """Per decode step: the memory floor (weight bytes + every request's K/V bytes, over the read
    bandwidth) and the compute floor (matmul FLOPs over the large-shape matmul rate)."""
    weights = decode_weight_bytes(runner.model)
    kv_per_token = runner.kv_bytes_per_token()
    memory = [(weights + bs * n * kv_per_token) / machine["read_bandwidth_Bps"] for n in context_lens]
    compute = bs * linear_flops_per_token(runner.model) / machine["matmul_flops"]
    return dict(weight_bytes=weights, memory_floor_s=memory, compute_floor_s=compute)


def run_engine(runner: ModelRunner, input_ids: torch.Tensor, output_len: int) -> Dict:
    device = runner.device
    driver = OneBatch(runner)
    _sync(device)
    t0 = time.perf_counter()
    tokens = driver.prefill(input_ids.to(device))
    _sync(device)
    prefill_latency = time.perf_counter() - t0
    outputs = [tokens.cpu()]
    decode_latencies: List[float] = []
    for _ in range(output_len - 1):
        t = time.perf_counter()
        tokens = driver.decode(tokens)
        _sync(device)
        decode_latencies.append(time.perf_counter() - t)
        outputs.append(tokens.cpu())
    total = time.perf_counter() - t0
    driver.release()
    bs, input_len = input_ids.shape
    med = statistics.median(decode_latencies) if decode_latencies else float("nan")
    return dict(
        prefill_latency=prefill_latency,
        prefill_throughput=bs * input_len / prefill_latency,
        decode_latencies=decode_latencies,
        median_decode_latency=med,
        median_decode_throughput=bs / med,
        decode_throughput=bs * len(decode_latencies) / sum(decode_latencies) if decode_latencies else float("nan"),
        total_latency=total,
        output_ids=torch.stack(outputs, 1).tolist(),
    )


def load_hf(model_path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()


def run_hf(model, device: str, input_ids: torch.Tensor, output_len: int) -> Dict:
    ids = input_ids.to(device)
    mask = torch.ones_like(ids)

    def generate(n: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                  pad_token_id=0)

    generate(2)  # warm-up
    _sync(device)
    t = time.perf_counter()
    generate(1)
    _sync(device)
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    out = generate(output_len)
    _sync(device)
    total = time.perf_counter() - t
    bs, input_len = input_ids.shape
    decode_time = max(total - prefill, 1e-9)
    return dict(
        prefill_latency=prefill,
        prefill_throughput=bs * input_len / prefill,
        # generate() gives no per-step times: the decode rate is the mean over the decode steps.
        decode_throughput=bs * (output_len - 1) / decode_time,
        median_decode_latency=decode_time / max(output_len - 1, 1),
        total_latency=total,
        output_ids=out[:, input_len:].tolist(),
    )


def main(argv: Optional[List[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF model directory (default: the built-in model)")
    p.add_argument("--random-llama", choices=sorted(RANDOM_LLAMAS), default=None,
                   help="build a random Llama of this size in a temporary directory")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--compare-hf", action="store_true", help="also run transformers' generate and print ratios")
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1,
                   help="alternate engine and transformers runs this many times and keep each one's best "
                        "(shared machines drift; interleaving keeps the comparison fair)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    tmp = None
    if args.random_llama:
        tmp = tempfile.TemporaryDirectory(prefix="bench-llama-")
        model_path = build_random_llama(args.random_llama, tmp.name, args.seed)
    elif args.model_path:
        model_path = args.model_path
    else:
        from engine.builtin_model import ensure_builtin_model

        model_path = ensure_builtin_model()

    bs, input_len, output_len = args.batch_size, args.input_len, args.output_len
    server_args = ServerArgs(
        model_path=model_path, dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        page_size=args.page_size, max_running_requests=bs, random_seed=args.seed,
        max_total_tokens=((bs * (input_len + output_len) + bs * args.page_size) // args.page_size + 2) * args.page_size,
    )
    config = ModelConfig.from_pretrained(model_path, dtype=args.dtype, context_length=input_len + output_len + 8,
                                         device=server_args.device)
    runner = ModelRunner(config, server_args)
    gen = torch.Generator().manual_seed(args.seed)
    input_ids = torch.randint(0, config.vocab_size, (bs, input_len), generator=gen)

    # Warm-up at full size (first touches of the KV pool and kernel set-up are not steady state).
    run_engine(runner, input_ids, min(output_len, 4))
    hf_model = load_hf(model_path, config.dtype, server_args.device) if args.compare_hf else None
    engine_runs, hf_runs, machines = [], [], []
    probe = MachineProbe(runner.device)
    for _ in range(max(1, args.repeats)):
        machines.append(probe.measure())
        engine_runs.append(run_engine(runner, input_ids, output_len))
        if hf_model is not None:
            hf_runs.append(run_hf(hf_model, server_args.device, input_ids, output_len))
    # Each repeat's steps against the floors of the bandwidth measured just before it; the repeat
    # with the lowest median ratio is reported. Step i (0-based) attends over input_len + i + 1
    # positions per request.
    contexts = [input_len + i + 1 for i in range(output_len - 1)]
    per_repeat = []
    for run, machine in zip(engine_runs, machines):
        floors = decode_floors(runner, bs, contexts, machine)
        ratios = [lat / floor for lat, floor in zip(run["decode_latencies"], floors["memory_floor_s"])]
        per_repeat.append((statistics.median(ratios) if ratios else float("nan"), run, machine, floors))
    ratio, best_run, machine, floors = min(per_repeat, key=lambda t: t[0])
    engine = _best(engine_runs)
    engine.pop("decode_latencies")
    median_floor = statistics.median(floors["memory_floor_s"]) if contexts else float("nan")
    result: Dict = dict(
        model_path=model_path if not tmp else f"random-llama-{args.random_llama}",
        batch_size=bs, input_len=input_len, output_len=output_len, dtype=str(config.dtype).replace("torch.", ""),
        device=runner.device, torch_threads=torch.get_num_threads(),
        engine={k: v for k, v in engine.items() if k != "output_ids"},
    )
    result["repeats"] = max(1, args.repeats)
    result["machine"] = machine
    bandwidths = [m["read_bandwidth_Bps"] for m in machines]
    result["decode_floor"] = dict(
        weight_bytes=floors["weight_bytes"], kv_bytes_per_token=runner.kv_bytes_per_token(),
        median_decode_latency=best_run["median_decode_latency"],
        median_memory_floor_s=median_floor, median_ratio_to_memory_floor=ratio if contexts else None,
        compute_floor_s=floors["compute_floor_s"],
        read_bandwidth_range_Bps=[min(bandwidths), max(bandwidths)],
        ratio_range=[ratio, max(t[0] for t in per_repeat)])
    if args.compare_hf:
        hf = _best(hf_runs)
        result["hf"] = {k: v for k, v in hf.items() if k != "output_ids"}
        result["ratio"] = {
            "prefill_throughput": engine["prefill_throughput"] / hf["prefill_throughput"],
            "decode_throughput": engine["decode_throughput"] / hf["decode_throughput"],
            "total_latency": hf["total_latency"] / engine["total_latency"],
        }
        same = sum(a == b for a, b in zip(engine["output_ids"], hf["output_ids"]))
        result["greedy_outputs_identical"] = f"{same}/{bs}"

    _print_table(result)
    if args.result_file:
        with open(args.result_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    if tmp is not None:
        tmp.cleanup()
    return result


def _best(runs: List[Dict]) -> Dict:
    """Per metric the best value over the repeats (lowest latency, highest throughput)."""
    best = dict(runs[0])
    for key in best:
        if key == "output_ids":
            continue
        if key == "decode_latencies":  # step by step, the fastest repeat
            best[key] = [min(steps) for steps in zip(*(run[key] for run in runs))]
            continue
        values = [run[key] for run in runs]
        best[key] = min(values) if "latency" in key else max(values)
    return best


def _print_table(r: Dict) -> None:
    print(f"\nbench_one_batch: {r['model_path']}  bs={r['batch_size']} in={r['input_len']} out={r['output_len']} "
          f"dtype={r['dtype']} device={r['device']} threads={r['torch_threads']} best of {r['repeats']}")
    rows = [
        ("prefill latency (s)", "prefill_latency"),
        ("prefill throughput (tok/s)", "prefill_throughput"),
        ("median decode latency (s)", "median_decode_latency"),
        ("decode throughput (tok/s)", "decode_throughput"),
        ("total latency (s)", "total_latency"),
    ]
    has_hf = "hf" in r
    print(f"{'metric':<30}{'engine':>14}" + (f"{'transformers':>14}{'ratio':>10}" if has_hf else ""))
    for label, key in rows:
        line = f"{label:<30}{r['engine'][key]:>14.4f}"
        if has_hf:
            e, h = r["engine"][key], r["hf"][key]
            ratio = h / e if "latency" in key else e / h
            line += f"{h:>14.4f}{ratio:>9.2f}x"
        print(line)
    floor = r.get("decode_floor")
    if floor and floor["median_ratio_to_memory_floor"] is not None:
        m = r["machine"]
        lo, hi = floor["read_bandwidth_range_Bps"]
        rlo, rhi = floor["ratio_range"]
        print(f"decode step vs the memory floor measured just before each repeat, the repeat nearest its floor: "
              f"median step {floor['median_decode_latency'] * 1e3:.2f} ms, "
              f"floor {floor['median_memory_floor_s'] * 1e3:.2f} ms = ({floor['weight_bytes'] / 1e6:.0f} MB weights + "
              f"{r['batch_size']} x ~{r['input_len'] + r['output_len'] // 2} tokens x {floor['kv_bytes_per_token']} B of KV) / "
              f"{m['read_bandwidth_Bps'] / 1e9:.1f} GB/s read; step / floor = {floor['median_ratio_to_memory_floor']:.2f}x "
              f"(median over steps; over the {r['repeats']} repeat(s) the read bandwidth was {lo / 1e9:.1f}-{hi / 1e9:.1f} GB/s "
              f"and the ratio {rlo:.2f}-{rhi:.2f}x); compute floor {floor['compute_floor_s'] * 1e3:.2f} ms at "
              f"{m['matmul_flops'] / 1e9:.0f} GFLOP/s (bf16 matmul 2048^3)")
    if has_hf:
        print(f"greedy outputs identical to transformers: {r['greedy_outputs_identical']} "
              "(ratios > 1 mean the engine is faster)")


if __name__ == "__main__":
    main(sys.argv[1:])
