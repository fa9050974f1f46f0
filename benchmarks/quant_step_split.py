"""Where one batch-1 decode step of bench_quant.py's model goes, on one thread, by CPU time (issue 40).

Wall time on a shared 2-core machine swings with the load; the CPU time of one thread does not (much).
So each configuration's ModelRunner is driven directly, torch and the native kernels on one thread, for
--steps decode steps of one request at --context tokens (its K/V written into the pool as random values,
as bench_quant's KV rows do), and the table gives:

- the step's CPU time (median), once plain and once with every op timed (the timers cost a little); the
  configurations' plain steps alternate, one step each in turn, and the ratio to bf16 is the median of the
  alternated steps' ratios;
- that step split by op: the linears, the LM head, attention (with the KV store), the norms, SiLU-and-mul,
  rotary, the embedding, sampling, and the rest (Python: module calls, ForwardBatch, dispatch);
- each kernel alone over the model's own weights, called through ctypes once per linear for one row
  (a step's worth of weight reads, as a decode step does them): ns per weight; and, for int8, the
  activation quantization alone (the same call over a 4-channel slice of each weight).

  python benchmarks/quant_step_split.py                  # bf16 and int8, 12 steps each
  python benchmarks/quant_step_split.py --configs int8 fp8 --steps 20
  python benchmarks/quant_step_split.py --configs bf16 int8 int8+head   # +head: --quantize-lm-head
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_quant import CONFIGS, Shape, checkpoint, model_path  # noqa: E402

from engine.configs.model_config import ModelConfig  # noqa: E402
from engine.kernels import library  # noqa: E402
from engine.kernels.linear import WidenedBf16  # noqa: E402
from engine.layers import linear as linear_module  # noqa: E402
from engine.layers.activation import SiluAndMul  # noqa: E402
from engine.layers.block_fp8_linear import BlockFp8Weight  # noqa: E402
from engine.layers.layernorm import RMSNorm  # noqa: E402
from engine.layers.quantization import QuantizedWeight  # noqa: E402
from engine.layers.radix_attention import RadixAttention  # noqa: E402
from engine.layers.rotary_embedding import RotaryEmbedding  # noqa: E402
from engine.layers.vocab_parallel_embedding import VocabParallelEmbedding  # noqa: E402
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from engine.model_executor.model_runner import ModelRunner  # noqa: E402
from engine.scheduler.schedule_batch import ModelWorkerBatch  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402

# --quantize-lm-head with the method of the config named before the "+".
HEAD_CONFIGS = {"int8+head": "w8a8_int8", "fp8+head": "fp8"}
OPS = ("linears", "lm_head", "attention", "norms", "silu_mul", "rotary", "embedding", "sampling")


class OpTimer:
    """CPU time of this thread per op, summed over one step (thread_time: steady under load)."""

    def __init__(self) -> None:
        self.ns: Dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn: Callable[..., torch.Tensor],
             pick: Callable[[torch.Tensor], str] = lambda out: "") -> Callable[..., torch.Tensor]:
        def timed(*args: object, **kwargs: object) -> torch.Tensor:
            t = time.thread_time_ns()
            out = fn(*args, **kwargs)
            self.ns[pick(out) or name] += time.thread_time_ns() - t
            return out
        return timed


@contextmanager
def timed_ops(timer: OpTimer, vocab: int) -> Iterator[None]:
    """Every op of the module path timed into `timer` (the LM head told from the linears by its width)."""
    patched: List[Tuple[object, str, Optional[str]]] = [
        (linear_module, "linear_forward", None), (RadixAttention, "forward", "attention"), (RMSNorm, "forward", "norms"),
        (SiluAndMul, "forward", "silu_mul"), (RotaryEmbedding, "forward", "rotary"),
        (VocabParallelEmbedding, "forward", "embedding")]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in patched]
    try:
        for owner, attr, name in patched:
            fn = getattr(owner, attr)
            if name is None:
                setattr(owner, attr, timer.wrap("linears", fn, lambda out: "lm_head" if out.shape[-1] == vocab else ""))
            else:
                setattr(owner, attr, timer.wrap(name, fn))
        yield
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def make_runner(path: str, quantization: Optional[str], context: int, steps: int,
                quantize_lm_head: bool = False) -> Tuple[ModelRunner, List[int]]:
    server_args = ServerArgs(model_path=path, device="cpu", log_level="warning", dtype="bfloat16",
                             quantization=quantization, quantize_lm_head=quantize_lm_head,
                             max_total_tokens=context + 3 * steps + 256,
                             max_running_requests=1, disable_radix_cache=True)
    config = ModelConfig.from_pretrained(path, dtype="bfloat16", device="cpu")
    runner = ModelRunner(config, server_args)
    row = runner.req_to_token_pool.alloc(1)
    assert row is not None
    slots = runner.token_to_kv_pool_allocator.alloc(context)
    assert slots is not None
    runner.req_to_token_pool.req_to_token[row[0], :context] = slots.to(torch.int32)
    pool = runner.token_to_kv_pool
    gen = torch.Generator().manual_seed(0)
    for layer in range(pool.layer_num):
        shape = (context, pool.head_num, pool.head_dim)
        pool.set_kv_buffer(layer, slots, torch.randn(shape, generator=gen).to(torch.bfloat16) * 0.1,
                           torch.randn(shape, generator=gen).to(torch.bfloat16))
    return runner, list(row)


class Stepper:
    """Decode steps of the runner's one request, each after the last (its slots allocated per step)."""

    def __init__(self, runner: ModelRunner, rows: List[int], context: int) -> None:
        self.runner, self.rows, self.length = runner, rows, context
        self.tokens = torch.tensor([11])

    def step(self, timer: "OpTimer | None") -> Tuple[float, Dict[str, int]]:
        """One step's CPU time (s) and its op split (empty without a timer)."""
        runner = self.runner
        self.length += 1
        out_loc = runner.token_to_kv_pool_allocator.alloc(1)
        assert out_loc is not None
        runner.req_to_token_pool.req_to_token[self.rows[0], self.length - 1] = int(out_loc[0])
        batch = ModelWorkerBatch(forward_mode=ForwardMode.DECODE, input_ids=self.tokens,
                                 req_pool_indices=torch.tensor(self.rows, dtype=torch.int64),
                                 seq_lens=torch.tensor([self.length], dtype=torch.int64), seq_lens_cpu=[self.length],
                                 out_cache_loc=out_loc)
        if timer is not None:
            timer.ns.clear()
        t = time.thread_time_ns()
        fb = ForwardBatch.init_new(batch, runner)
        output = runner.forward(fb)
        s = time.thread_time_ns()
        self.tokens = runner.sample(output, fb)
        done = time.thread_time_ns()
        split: Dict[str, int] = {}
        if timer is not None:
            split = dict(timer.ns)
            split["sampling"] = done - s
        return (done - t) * 1e-9, split


def kernel_rates(runner: ModelRunner, repeats: int) -> Dict[str, float]:
    """ns per weight of each linear kernel alone over the model's weights (one row, one thread)."""
    lib = library.linear()
    assert lib is not None
    vocab = runner.model_config.vocab_size
    keep: List[torch.Tensor] = []  # the buffers the calls point into
    groups: Dict[str, List[Callable[[], int]]] = defaultdict(list)
    weights: Dict[str, int] = defaultdict(int)
    for module in runner.model.modules():
        packed = getattr(module, "packed_weight", None)
        head = " lm_head" if isinstance(packed, QuantizedWeight) and packed.n == vocab else ""
        if isinstance(packed, QuantizedWeight) and packed.int8_activations:
            n, k = packed.n, packed.k
            x = torch.randn(1, k).to(torch.bfloat16)
            out, xs = torch.empty(1, n, dtype=torch.bfloat16), torch.empty(1)
            args = (x.data_ptr(), 1, k, packed.qweight.data_ptr(), packed.scale.data_ptr(), None)
            tail = (out.data_ptr(), 1, xs.data_ptr(), 1)
            keep += [x, out, xs]
            groups["int8 w8a8" + head].append(functools.partial(lib.linear_w8a8, *args, n, *tail))
            weights["int8 w8a8" + head] += n * k
            if not head:  # 4 channels: the activation quantization, the call and 4 channels' dot products
                groups["int8 quantize (4 ch)"].append(functools.partial(lib.linear_w8a8, *args, 4, *tail))
                weights["int8 quantize (4 ch)"] += 4 * k
        elif isinstance(packed, QuantizedWeight):
            n, k, name = packed.n, packed.k, ("fp8" if packed.is_fp8 else "int8 weight-only") + head
            x = torch.randn(1, k).to(torch.bfloat16)
            out = torch.empty(1, n, dtype=torch.bfloat16)
            keep += [x, out]
            groups[name].append(functools.partial(lib.linear_q8, x.data_ptr(), 1, k, packed.qweight.data_ptr(),
                                                  int(packed.is_fp8), packed.scale.data_ptr(), None, n,
                                                  out.data_ptr(), 1, 1))
            weights[name] += n * k
        elif isinstance(packed, BlockFp8Weight):
            n, k = packed.n, packed.k
            x = torch.randn(1, k).to(torch.bfloat16)
            out = torch.empty(1, n, dtype=torch.bfloat16)
            keep += [x, out]
            groups["fp8 block"].append(functools.partial(lib.linear_fp8_block, x.data_ptr(), 1, k,
                                                         packed.qweight.data_ptr(), packed.scale.data_ptr(),
                                                         packed.block[0], packed.block[1], None, n, out.data_ptr(),
                                                         1, 1))
            weights["fp8 block"] += n * k
        elif isinstance(packed, WidenedBf16):
            n, k = packed.weight.shape
            name = "bf16 lm_head" if n == vocab else "bf16"
            x = torch.randn(1, k).to(torch.bfloat16)
            out = torch.empty(1, n, dtype=torch.bfloat16)
            keep += [x, out]
            groups[name].append(functools.partial(lib.linear_q8, x.data_ptr(), 1, k, packed.weight.data_ptr(), 2,
                                                  None, None, n, out.data_ptr(), 1, 1))
            weights[name] += n * k
    rates: Dict[str, float] = {}
    for name, calls in groups.items():
        passes: List[float] = []
        for _ in range(repeats + 1):
            t = time.thread_time_ns()
            for call in calls:
                call()
            passes.append(time.thread_time_ns() - t)
        rates[name] = statistics.median(passes[1:]) / weights[name]
        rates[name + " ms"] = statistics.median(passes[1:]) * 1e-6
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--context", type=int, default=40, help="tokens before the first timed step (bench_quant: 32 + 8)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--configs", nargs="+", default=["bf16", "int8"], choices=list(CONFIGS) + list(HEAD_CONFIGS))
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "engine_bench_quant"))
    ap.add_argument("--json", default="quant_step_split.json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # torch's ops and the native kernels (they take torch's count)
    shape = Shape(args.layers, args.hidden, args.heads, args.kv_heads, args.inter, args.vocab)
    path = checkpoint(args.dir, shape)
    load_before = os.getloadavg()[0]
    report: Dict[str, Dict[str, float]] = {}
    with torch.inference_mode():
        # Every configuration's runner at once, their plain steps alternated: a change in the machine's load
        # (memory traffic from other work raises CPU time too) falls on all of them alike.
        steppers: Dict[str, Stepper] = {}
        for name in args.configs:
            runner, rows = make_runner(model_path(path, name), HEAD_CONFIGS.get(name, CONFIGS.get(name)), args.context, args.steps,
                                       quantize_lm_head=name in HEAD_CONFIGS)
            steppers[name] = Stepper(runner, rows, args.context)
            steppers[name].step(None)  # warm-up
        plain: Dict[str, List[float]] = {name: [] for name in args.configs}
        for _ in range(args.steps):
            for name, stepper in steppers.items():
                plain[name].append(stepper.step(None)[0])
        for name, stepper in steppers.items():
            timer = OpTimer()
            with timed_ops(timer, args.vocab):
                timed = [stepper.step(timer) for _ in range(args.steps)]
            row: Dict[str, float] = {"step_ms": statistics.median(plain[name]) * 1e3,
                                     "timed_step_ms": statistics.median(t for t, _ in timed) * 1e3}
            for op in OPS:
                row[op + "_ms"] = statistics.median(split.get(op, 0) for _, split in timed) * 1e-6
            row["rest_ms"] = row["timed_step_ms"] - sum(row[op + "_ms"] for op in OPS)
            row.update({"kernel " + k: v for k, v in kernel_rates(stepper.runner, args.steps).items()})
            if "bf16" in plain:  # the median of the alternated steps' ratios
                row["bf16_ratio"] = statistics.median(b / t for b, t in zip(plain["bf16"], plain[name]))
            report[name] = row
    load_after = os.getloadavg()[0]
    print(f"one thread, CPU time, batch 1 at {args.context} tokens, median of {args.steps} steps; "
          f"load average {load_before:.1f} before, {load_after:.1f} after")
    names = list(report)
    print(f"{'':28}" + "".join(f"{n:>12}" for n in names))
    for key in ["step_ms", "timed_step_ms"] + [op + "_ms" for op in OPS] + ["rest_ms"]:
        print(f"{key:28}" + "".join(f"{report[n][key]:12.2f}" for n in names))
    for n in names:
        for key, v in report[n].items():
            if key.startswith("kernel ") and not key.endswith(" ms"):
                print(f"{n}: {key[7:]:22} {v:.4f} ns/weight, {report[n][key + ' ms']:.2f} ms a step")
    for n in names:
        if "bf16_ratio" in report[n]:
            print(f"{n}: bf16 step / {n} step = {report[n]['bf16_ratio']:.2f}x (median of the alternated steps)")
    with open(args.json, "w") as f:
        json.dump({"shape": vars(args), "load_average": [load_before, load_after], "report": report}, f, indent=2)


if __name__ == "__main__":
    main()
