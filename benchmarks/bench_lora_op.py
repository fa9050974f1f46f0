"""The LoRA delta of one forward's projections against their base linears, in-process (issue 38).

For each projection of a model (q/k/v fused, o, gate/up fused, down; rank-16 adapters on all of them), a
decode batch (--decode-rows rows, the adapters round-robin) and a prefill chunk (--prefill-requests
requests of --prefill-len rows, one adapter each): the base linear as the engine runs it (linear_forward
over the packed weight), the torch path of the LoRA delta (backend.lora_native) and the native kernel
(csrc/lora_delta.c, backend.lora_kernel), at 1 and 2 threads. Reported per forward (every layer's
projections): CPU time of the process and wall time, the best of --repeats blocks of --iters calls.

  python benchmarks/bench_lora_op.py                     # built-in model shapes
  python benchmarks/bench_lora_op.py --model small --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import resolve_model  # noqa: E402
from engine.kernels import library  # noqa: E402
from engine.layers.linear import linear_forward, prepack_linear_weights  # noqa: E402
from engine.lora import backend  # noqa: E402


class _Weight(nn.Module):
    """A bare linear weight for prepack_linear_weights (the packing the engine's layers get)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.packed_weight = None
        self.bias = None


def _time(fn: Callable[[], object], iters: int, repeats: int) -> Tuple[float, float]:
    """(CPU s, wall s) per call: the block with the least wall time."""
    fn()
    best = (float("inf"), float("inf"))
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(iters):
            fn()
        cpu, wall = (time.process_time() - c0) / iters, (time.perf_counter() - t0) / iters
        if wall < best[1]:
            best = (cpu, wall)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--decode-rows", type=int, default=64)
    parser.add_argument("--prefill-requests", type=int, default=16)
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model_path, _ = resolve_model(args.model, args.dtype)
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    # name: (input size, sections)
    projections: Dict[str, Tuple[int, List[Tuple[int, int]]]] = {
        "qkv": (hidden, [(0, q), (q, kv), (q + kv, kv)]), "o": (q, [(0, hidden)]),
        "gate_up": (hidden, [(0, inter), (inter, inter)]), "down": (inter, [(0, hidden)])}
    dtype = getattr(torch, args.dtype)
    lib = library.lora()
    assert lib is not None, "the native kernels did not build"
    slots, rank = args.adapters + 1, args.rank
    gen = torch.Generator().manual_seed(0)
    decode_slots = [1 + i % args.adapters for i in range(args.decode_rows)]
    prefill_slots = [1 + r % args.adapters for r in range(args.prefill_requests) for _ in range(args.prefill_len)]
    results: Dict[str, Dict[str, float]] = {}
    print(f"model={args.model} dtype={args.dtype} rank={rank} adapters={args.adapters} layers={layers} "
          f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs; ms per forward (all layers), CPU / wall")
    for batch, row_slots in (("decode", decode_slots), ("prefill", prefill_slots)):
        for threads in (1, 2):
            torch.set_num_threads(threads)
            totals: Dict[str, List[float]] = {"base": [0.0, 0.0], "torch": [0.0, 0.0], "kernel": [0.0, 0.0]}
            scalings = torch.rand(slots, generator=gen) + 0.5
            scalings[0] = 0.0
            for name, (k, sections) in projections.items():
                n = sum(size for _, size in sections)
                holder = _Weight((torch.randn(n, k, generator=gen) * 0.02).to(dtype))
                prepack_linear_weights(holder)
                a = torch.randn(slots, len(sections) * rank, k, generator=gen) * 0.02
                b = torch.randn(slots, n, rank, generator=gen) * 0.02
                b_sections = backend.native_b(b, sections, rank, scalings)
                b_full = backend.kernel_b(b, rank, scalings)
                sections_t = backend.sections_tensor(sections)
                info = backend.build_batch_info(row_slots, scalings, torch.device("cpu"),
                                                backend.NativeShape(n, len(sections) * rank, torch.float32))
                plan = info.native
                assert plan is not None
                x = torch.randn(len(row_slots), k, generator=gen).to(dtype)
                out = linear_forward(x, holder.weight, None, holder.packed_weight)
                slots_t = torch.tensor(row_slots, dtype=torch.int64)
                runs: Dict[str, Callable[[], object]] = {
                    "base": lambda: linear_forward(x, holder.weight, None, holder.packed_weight),
                    # as the engine runs it (its one-thread rule included)
                    "torch": lambda: backend.lora_native(x, out, a, b_sections, sections, rank, plan),
                    # on `threads` threads whatever the rows
                    "kernel": lambda: backend.lora_kernel(lib, x, out, a, b_full, sections_t, rank, slots_t, threads)}
                for what, fn in runs.items():
                    cpu, wall = _time(fn, args.iters, args.repeats)
                    totals[what][0] += cpu * layers
                    totals[what][1] += wall * layers
            key = f"{batch} ({len(row_slots)} rows), {threads} thread{'s' if threads > 1 else ''}"
            results[key] = {f"{what}_{m}_ms": v * 1e3 for what, (c, w) in totals.items() for m, v in (("cpu", c), ("wall", w))}
            line = "  ".join(f"{what} {c * 1e3:7.2f} / {w * 1e3:7.2f}" for what, (c, w) in totals.items())
            print(f"{key:<32} {line}   torch/base {totals['torch'][0] / totals['base'][0]:.2f}x "
                  f"kernel/base {totals['kernel'][0] / totals['base'][0]:.2f}x (CPU)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
