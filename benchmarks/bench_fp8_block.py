"""The block-fp8 kernel (csrc/linear_q8.c's linear_fp8_block, DeepSeek-V3's [128, 128] blocks) against the
per-channel kernels over the same weight shape: fp8 and weight-only int8 (linear_q8), int8 with int8
activations (linear_w8a8).

One thread, CPU time (thread_time: steadier than wall time on a shared machine), bf16 activations and
output, as a bf16 model's forward calls them. Decode rows (1 and 16) and prefill rows (256 and 1024, below
the kernels' 4096-row bf16 bound); the weight is larger than the caches (--n x --k, default 4096 x 4096:
16 MB in one byte a weight), so the one-row figures are the streaming rate. Each kernel's median over
--repeats calls; the table gives ns per weight (the call's time over n * k) and ns per multiply-add (over
rows * n * k) and the ratio to the per-channel fp8 kernel.

  python benchmarks/bench_fp8_block.py
  python benchmarks/bench_fp8_block.py --rows 1 16 --repeats 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from engine.kernels import library
from engine.layers.block_fp8_linear import BlockFp8Weight, block_fp8_linear
from engine.layers.quantization import quantize_weight, quantized_linear

BLOCK = (128, 128)


def block_weight(w: torch.Tensor) -> BlockFp8Weight:
    """w [n, k] as e4m3 blocks of BLOCK with one float32 scale each (amax / 448), DeepSeek-V3's layout."""
    n, k = w.shape
    bn, bk = BLOCK
    grid = w.float().reshape(n // bn, bn, k // bk, bk)
    scale = grid.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
    q = (grid / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, k)
    return BlockFp8Weight(q.contiguous(), scale.contiguous(), BLOCK)


def cpu_ns(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up (and the first touch of the output)
    times: List[int] = []
    for _ in range(repeats):
        t = time.thread_time_ns()
        call()
        times.append(time.thread_time_ns() - t)
    return float(statistics.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 256, 1024])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", default="bench_fp8_block.json")
    args = ap.parse_args()
    if library.linear() is None:
        sys.exit("the kernel library is not built (engine.kernels.library)")
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(args.n, args.k, generator=gen) / args.k ** 0.5
    kernels = {"fp8 block": block_weight(w), "fp8 channel": quantize_weight(w, "fp8"),
               "int8 weight-only": quantize_weight(w, "w8a8_int8"), "int8 w8a8": quantize_weight(w, "w8a8_int8")}
    kernels["int8 weight-only"].int8_activations = False
    kernels["int8 w8a8"].int8_activations = True
    load_before = os.getloadavg()[0]
    report: Dict[str, Dict[str, float]] = {}
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, args.k, generator=gen).to(torch.bfloat16)
            for name, weight in kernels.items():
                if isinstance(weight, BlockFp8Weight):
                    ns = cpu_ns(lambda: block_fp8_linear(x, weight, None), args.repeats)
                else:
                    ns = cpu_ns(lambda: quantized_linear(x, weight, None), args.repeats)
                report[f"{name} x{rows}"] = {"rows": rows, "ms": ns * 1e-6, "ns_per_weight": ns / (args.n * args.k),
                                             "ns_per_mac": ns / (rows * args.n * args.k)}
    load_after = os.getloadavg()[0]
    print(f"one thread, CPU time, weight {args.n} x {args.k}, bf16 activations, median of {args.repeats}; "
          f"load average {load_before:.1f} before, {load_after:.1f} after")
    print(f"{'kernel':18} {'rows':>5} {'ms':>9} {'ns/weight':>10} {'ns/MAC':>8} {'vs fp8 channel':>15}")
    for rows in args.rows:
        base = report[f"fp8 channel x{rows}"]["ms"]
        for name in kernels:
            r = report[f"{name} x{rows}"]
            print(f"{name:18} {rows:5d} {r['ms']:9.2f} {r['ns_per_weight']:10.4f} {r['ns_per_mac']:8.4f} "
                  f"{r['ms'] / base:14.2f}x")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "load_average": [load_before, load_after], "report": report}, f, indent=2)


if __name__ == "__main__":
    main()
