"""The CPU kernels' ISA paths side by side in one process: AMX tiles, AVX512-BF16 and oneDNN.

On the 2-core virtual machines of this project a process keeps, for its whole life, either of two
streaming rates for the same packed weights (seen on the Intel Xeon with AMX: ~23 or ~12 GB/s), so
kernels compared across processes can differ by 2x for no reason of their own. This script times
each variant in turn, several rounds, in one process, and prints the best of each:

  linears    a model's worth of bf16 linears (the small Llama's 8 layers and LM head, weights
             packed once, far larger than the caches): the packed kernel on AMX and on
             AVX512-BF16, and F.linear (oneDNN), per row count
  extend     prefill attention of one 1024-token prompt, and of 16 x 64 new tokens over a 1024-token
             cached prefix (16 heads, 8 KV heads, dim 64), AMX against AVX512-BF16
  cascade    decode attention of 8 groups x 16 requests over 1024-token shared prefixes with 96 own
             keys each (phase 1 on AMX or AVX512-BF16), packing the prefixes' panels afresh and with
             the panels kept from an earlier step, as decode steps after a prefix's first run it

  python benchmarks/bench_cpu_kernels.py
  python benchmarks/bench_cpu_kernels.py --rows 1 16 64 --rounds 5 --result-file kernels.json

Without AMX (or with ENGINE_CPU_AMX=0) the AMX columns are left out; at one row both packed
columns run the AVX512-BF16 tiles (AMX takes over from two rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

from engine.kernels import attention as attention_kernels
from engine.kernels import library
from engine.kernels import linear as linear_kernels
from engine.layers.attention.prefix_panels import PrefixPanels
from engine.mem_cache.memory_pool import MHATokenToKVPool

HEADS, KV_HEADS, DIM = 16, 8, 64
SHAPES = [(2048, 1024), (1024, 1024), (4096, 1024), (1024, 2048)]  # qkv, o, gate_up, down
LAYERS, VOCAB = 8, 32000


def best_ms(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def rounds_of(variants: Dict[str, Callable[[], object]], rounds: int, reps: int) -> Dict[str, float]:
    """Each variant in turn, `rounds` times; the best per variant (the machine drifts between rounds)."""
    out: Dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in variants.items():
            out[name] = min(out.get(name, math.inf), best_ms(fn, reps))
    return out


def isa(name: str) -> Callable[[Callable[[], object]], Callable[[], object]]:
    """Wraps a call so that it runs with AMX on ('amx') or off (anything else), then puts back the
    process's setting (ENGINE_CPU_AMX)."""
    lib = library.library_info()
    assert lib is not None
    before = int(lib.amx_active())

    def wrap(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            lib.amx_set(int(name == "amx"))
            try:
                return fn()
            finally:
                lib.amx_set(before)
        return run
    return wrap


def linears(rows: List[int], rounds: int, amx: bool) -> List[Dict[str, object]]:
    torch.manual_seed(0)
    weights = [torch.randn(n, k).mul_(0.02).to(torch.bfloat16) for _ in range(LAYERS) for n, k in SHAPES]
    weights.append(torch.randn(VOCAB, 1024).mul_(0.02).to(torch.bfloat16))
    panels = [linear_kernels.pack_linear_bf16(w, None) for w in weights]
    flop_per_row = sum(2 * w.numel() for w in weights)
    results = []
    for m in rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (1024, 2048)}

        def packed() -> None:
            for p in panels:
                linear_kernels.linear_bf16(xs[p.k], p, add_bias=False)

        def onednn() -> None:
            for w in weights:
                F.linear(xs[w.shape[1]], w)

        variants = {"avx512": isa("avx512")(packed), "onednn": onednn}
        if amx:
            variants = {"amx": isa("amx")(packed), **variants}
        ms = rounds_of(variants, rounds, reps=3)
        results.append({"rows": m, **{f"{k}_ms": round(v, 2) for k, v in ms.items()},
                        **{f"{k}_gflops": round(flop_per_row * m / v / 1e6) for k, v in ms.items()}})
        print(f"linears, {m:5d} rows: " + "  ".join(f"{k} {v:8.2f} ms ({flop_per_row * m / v / 1e6:5.0f} GFLOP/s)"
                                                   for k, v in ms.items()))
    return results


def attention(rounds: int, amx: bool) -> List[Dict[str, object]]:
    torch.manual_seed(0)
    slots = 24000
    k = torch.randn(slots, KV_HEADS, DIM).to(torch.bfloat16)
    v = torch.randn(slots, KV_HEADS, DIM).to(torch.bfloat16)
    scale = 1 / math.sqrt(DIM)
    cases: Dict[str, Callable[[], object]] = {}

    def extend_case(prefix: List[int], ext: List[int]) -> Callable[[], object]:
        bs, longest = len(ext), max(p + e for p, e in zip(prefix, ext))
        kv_indices = torch.zeros(bs, longest, dtype=torch.int64)
        for b, (p, e) in enumerate(zip(prefix, ext)):  # the prefix shared, the new tokens each their own
            kv_indices[b, :p] = torch.arange(p)
            kv_indices[b, p:p + e] = torch.arange(4096 + b * e, 4096 + (b + 1) * e)
        tables = attention_kernels.ExtendTables(kv_indices, torch.tensor([sum(ext[:b]) for b in range(bs)]),
                                          torch.tensor(ext), torch.tensor(prefix))
        q = torch.randn(sum(ext), HEADS * DIM).to(torch.bfloat16)
        return lambda: attention_kernels.extend_attention(q, k, v, tables, HEADS, KV_HEADS, DIM, scale)

    cases["extend, one 1024-token prompt"] = extend_case([0], [1024])
    cases["extend, 16 x 64 over 1024 cached"] = extend_case([1024] * 16, [64] * 16)

    groups, members, prefix_len, own = 8, 16, 1024, 96
    bs = groups * members
    lens = torch.full((bs,), own)
    kv_indices = (groups * prefix_len + torch.arange(bs * own)).view(bs, own)
    cascade = attention_kernels.CascadeTables(
        group_offsets=torch.arange(groups + 1) * members, members=torch.arange(bs),
        prefix_indices=torch.arange(groups * prefix_len).view(groups, prefix_len),
        prefix_lens=torch.full((groups,), prefix_len), group_of=torch.arange(bs) // members)
    qd = torch.randn(bs, HEADS * DIM).to(torch.bfloat16)
    cases["decode, 8 x 16 over 1024-token prefixes"] = lambda: attention_kernels.decode_attention(
        qd, k, v, kv_indices, lens, HEADS, KV_HEADS, DIM, scale, cascade=cascade)
    # The same with the prefixes' panels kept from an earlier step (prefix_panels.py).
    pool = MHATokenToKVPool(slots - 1, 1, torch.bfloat16, KV_HEADS, DIM, 1, "cpu")
    pool.k_buffer, pool.v_buffer = [k], [v]
    kept = dataclasses.replace(cascade)
    panels = PrefixPanels(budget_bytes=1 << 30)
    panels.attach(kept, list(kept.prefix_indices), pool)
    cases["decode, 8 x 16 over 1024-token prefixes, panels kept"] = lambda: (panels, attention_kernels.decode_attention(
        qd, k, v, kv_indices, lens, HEADS, KV_HEADS, DIM, scale, cascade=kept))

    results = []
    for name, fn in cases.items():
        variants = {"avx512": isa("avx512")(fn)}
        if amx:
            variants = {"amx": isa("amx")(fn), **variants}
        ms = rounds_of(variants, rounds, reps=5)
        results.append({"case": name, **{f"{k}_ms_per_layer": round(v, 3) for k, v in ms.items()}})
        print(f"{name}: " + "  ".join(f"{k} {v:.2f} ms a layer" for k, v in ms.items()))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128, 512, 2048])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    lib, linears = library.library_info(), library.linear()
    if lib is None or linears is None or not linears.linear_bf16_available():
        raise SystemExit("the CPU kernel library is not available or this CPU lacks AVX512-BF16: nothing to compare")
    amx = bool(lib.amx_active())
    print(f"AMX {'on' if amx else 'not available (or ENGINE_CPU_AMX=0)'}; {torch.get_num_threads()} threads")
    result = {"amx": amx, "threads": torch.get_num_threads(), "linears": linears(args.rows, args.rounds, amx),
              "attention": attention(args.rounds, amx)}
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
