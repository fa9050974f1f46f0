"""Quantized weights (issue 40): decode tokens/s of one random Llama-shaped model with bf16, int8
(--quantization w8a8_int8), fp8 (--quantization fp8), int4 (an AWQ checkpoint of the same weights, groups
of 128, round-to-nearest) and fp8-block (a block-wise fp8 checkpoint of them, DeepSeek-V3's format, blocks of
128 x 128) linears, side by side in one run, in-process (the Scheduler, no HTTP), each
against its memory floor.

The model (default 8 layers, hidden 1024, intermediate 2816, 16 heads / 4 KV heads, vocab 32000) is
written once as a bf16 safetensors checkpoint (random weights) under --dir. For each batch size
(--batch-sizes, default 1 and 16) every configuration decodes --out-len greedy tokens (ignore_eos) for
the same random prompts; the table gives decode tokens/s, the median decode step, the ratio to bf16,
and the step against its floor: the bytes a decode step must read (the linears at 2 bytes per weight
for bf16, 1 plus a float32 scale per channel for int8 / fp8 (per block for fp8-block), 1/2 plus a float32 scale and offset per
group of 128 for int4; the LM head, the batch's embedding rows and the KV cache in bf16) at the bandwidth
of a streaming read on the same cores.

The fp8 KV cache rows (--kv-cache-dtype auto / fp8_e5m2 / fp8_e4m3, bf16 weights): a decode step of
--kv-batch requests (default 64) at --kv-context tokens each (default 1024), through the ModelRunner (the
scheduler's prefill of 64k tokens would take minutes on a small CPU, so each request's context is
written straight into the pool as random K/V); the table gives the median step, the KV bytes the step
must read (the floor that fp8 halves) and the step's floor (weights, LM head and KV at the streaming
bandwidth).

  python benchmarks/bench_quant.py                        # table + bench_quant.json
  python benchmarks/bench_quant.py --layers 2 --out-len 8 # a quick check
  python benchmarks/bench_quant.py --configs --kv-steps 8 # the fp8 KV rows only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_moe import _decode, read_bandwidth  # noqa: E402

from engine.scheduler.overlap_utils import scheduling_thread  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402

# --quantization per configuration; int4 loads an AWQ checkpoint instead (detected, no flag) with float
# activations (ENGINE_INT4_INT8_ACTIVATIONS=0), int4-a8 the same with int8 ones (the CPU default, layers/int4.py),
# fp8-block a block-wise fp8 one (DeepSeek-V3's format, blocks of FP8_BLOCK; csrc/linear_q8.c's linear_fp8_block).
CONFIGS: Dict[str, Optional[str]] = {"bf16": None, "int8": "w8a8_int8", "fp8": "fp8", "int4": None, "int4-a8": None,
                                     "fp8-block": None}
INT4_GROUP = 128
FP8_BLOCK = 128


@dataclass
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def linear_weights(self) -> int:
        d = self.head_dim
        return self.layers * (self.hidden * (self.heads + 2 * self.kv_heads) * d + self.heads * d * self.hidden
                              + 3 * self.hidden * self.inter)

    def linear_channels(self) -> int:
        return self.layers * ((self.heads + 2 * self.kv_heads) * self.head_dim + self.hidden + 2 * self.inter
                              + self.hidden)


def checkpoint(root: str, shape: Shape) -> str:
    from safetensors.torch import save_file

    path = os.path.join(root, "llama_" + "_".join(str(v) for v in asdict(shape).values()))
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=shape.hidden,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  intermediate_size=shape.inter, vocab_size=shape.vocab, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    gen = torch.Generator().manual_seed(1)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) / dims[-1] ** 0.5).to(torch.bfloat16)

    h, d = shape.hidden, shape.head_dim
    w = {"model.embed_tokens.weight": rand(shape.vocab, h), "lm_head.weight": rand(shape.vocab, h),
         "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(shape.heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rand(shape.kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = rand(shape.kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, shape.heads * d)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=torch.bfloat16)
        w[p + "mlp.gate_proj.weight"] = rand(shape.inter, h)
        w[p + "mlp.up_proj.weight"] = rand(shape.inter, h)
        w[p + "mlp.down_proj.weight"] = rand(h, shape.inter)
    save_file(w, os.path.join(path, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(path, "model.safetensors.tmp"), os.path.join(path, "model.safetensors"))
    return path


def awq_checkpoint(path: str) -> str:
    """The AWQ (4-bit, groups of INT4_GROUP) checkpoint of the bf16 one, written once beside it."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from utils_quant import write_int4_checkpoint

    dst = path + f"_awq{INT4_GROUP}"
    config = os.path.join(dst, "config.json")
    # config.json gets its quantization_config last: a half-written checkpoint is written again.
    if not (os.path.exists(config) and "quantization_config" in json.load(open(config))):
        write_int4_checkpoint(path, dst, "awq", group=INT4_GROUP)
    return dst


def block_fp8_checkpoint(path: str) -> str:
    """The block-wise fp8 checkpoint of the bf16 one (e4m3 weights, a float32 weight_scale_inv = amax / 448
    per FP8_BLOCK x FP8_BLOCK block of each projection), written once beside it."""
    from safetensors.torch import load_file, save_file

    dst = path + f"_fp8block{FP8_BLOCK}"
    config_path = os.path.join(dst, "config.json")
    if os.path.exists(config_path) and "quantization_config" in json.load(open(config_path)):
        return dst
    os.makedirs(dst, exist_ok=True)
    out: Dict[str, torch.Tensor] = {}
    for name, w in load_file(os.path.join(path, "model.safetensors")).items():
        if ".layers." not in name or w.dim() != 2:
            out[name] = w
            continue
        n, k = w.shape
        grid = w.float().reshape(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
        scale = grid.abs().amax(dim=(1, 3)).clamp_min(1e-12) / 448.0
        out[name] = (grid / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(n, k).contiguous()
        out[name + "_scale_inv"] = scale.contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    with open(config_path, "w") as f:  # last: a half-written checkpoint is written again
        json.dump(config, f)
    return dst


def model_path(path: str, config: str) -> str:
    """The checkpoint a configuration loads: the bf16 one, or its AWQ / block-fp8 copy."""
    if config in ("int4", "int4-a8"):
        return awq_checkpoint(path)
    return block_fp8_checkpoint(path) if config == "fp8-block" else path


def step_bytes(shape: Shape, config: str, batch: int, context: int) -> float:
    if config == "fp8-block":
        linears = shape.linear_weights() + 4 * shape.linear_weights() // (FP8_BLOCK * FP8_BLOCK)
    elif config in ("int4", "int4-a8"):
        linears = shape.linear_weights() // 2 + 8 * shape.linear_weights() // INT4_GROUP
    elif config in ("int8", "fp8"):
        linears = shape.linear_weights() + 4 * shape.linear_channels()
    else:
        linears = 2 * shape.linear_weights()
    head = 2 * (shape.vocab * shape.hidden + batch * shape.hidden)
    kv = 2 * batch * context * shape.layers * 2 * shape.kv_heads * shape.head_dim
    return float(linears + head + kv)


KV_CONFIGS = ("auto", "fp8_e5m2", "fp8_e4m3")


@dataclass
class KVResult:
    kv_cache_dtype: str
    batch: int
    context: int
    step_ms: float
    kv_bytes_per_step: float
    floor_ms: float


def kv_step_bytes(shape: Shape, batch: int, context: int, kv_element: int) -> float:
    """What one decode step reads at least: the bf16 linears and LM head, and every request's K and V."""
    head = 2 * (shape.vocab * shape.hidden + batch * shape.hidden)
    return float(2 * shape.linear_weights() + head + kv_bytes(shape, batch, context, kv_element))


def kv_bytes(shape: Shape, batch: int, context: int, kv_element: int) -> float:
    return float(batch * context * shape.layers * 2 * shape.kv_heads * shape.head_dim * kv_element)


def kv_decode_steps(path: str, kv_cache_dtype: str, batch: int, context: int, steps: int) -> List[float]:
    """Median-ready times of `steps` decode steps of `batch` requests whose first `context` tokens' K/V
    are written into the pool directly (random, unit scale), each request's slots contiguous as a
    prompt's are."""
    import time

    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from engine.model_executor.model_runner import ModelRunner
    from engine.scheduler.schedule_batch import ModelWorkerBatch

    server_args = ServerArgs(model_path=path, device="cpu", log_level="warning", dtype="bfloat16",
                             kv_cache_dtype=kv_cache_dtype, max_total_tokens=batch * (context + steps + 8) + 256,
                             max_running_requests=batch, disable_radix_cache=True)
    config = ModelConfig.from_pretrained(path, dtype="bfloat16", device="cpu")
    runner = ModelRunner(config, server_args)
    pool, table = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
    rows = runner.req_to_token_pool.alloc(batch)
    assert rows is not None
    gen = torch.Generator().manual_seed(0)
    for row in rows:
        slots = runner.token_to_kv_pool_allocator.alloc(context)
        assert slots is not None
        table[row, :context] = slots.to(torch.int32)
        for layer in range(pool.layer_num):
            shape = (context, pool.head_num, pool.head_dim)
            pool.set_kv_buffer(layer, slots, torch.randn(shape, generator=gen).to(torch.bfloat16),
                               torch.randn(shape, generator=gen).to(torch.bfloat16))
    times: List[float] = []
    tokens = torch.randint(10, config.vocab_size - 10, (batch,), generator=gen)
    for step in range(steps + 2):  # two warm-up steps
        seq_lens = [context + step + 1] * batch
        out_loc = runner.token_to_kv_pool_allocator.alloc(batch)
        assert out_loc is not None
        for row, slot in zip(rows, out_loc.tolist()):
            table[row, context + step] = slot
        worker_batch = ModelWorkerBatch(forward_mode=ForwardMode.DECODE, input_ids=tokens,
                                        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
                                        seq_lens=torch.tensor(seq_lens, dtype=torch.int64), seq_lens_cpu=seq_lens,
                                        out_cache_loc=out_loc)
        t = time.perf_counter()
        fb = ForwardBatch.init_new(worker_batch, runner)
        tokens = runner.sample(runner.forward(fb), fb)
        if step >= 2:
            times.append(time.perf_counter() - t)
    return times


@dataclass
class Result:
    config: str
    batch: int
    decode_tok_s: float
    step_ms: float
    floor_ms: float
    bytes_per_step: float


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1,
                    help="decode runs per configuration, the best median step kept (a shared machine)")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--kv-configs", nargs="*", default=list(KV_CONFIGS), choices=list(KV_CONFIGS),
                    help="--kv-cache-dtype values of the fp8 KV rows (none: no KV rows)")
    ap.add_argument("--kv-batch", type=int, default=64)
    ap.add_argument("--kv-context", type=int, default=1024)
    ap.add_argument("--kv-steps", type=int, default=16)
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "engine_bench_quant"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_quant.json")
    args = ap.parse_args()
    shape = Shape(args.layers, args.hidden, args.heads, args.kv_heads, args.inter, args.vocab)
    path = checkpoint(args.dir, shape)
    bandwidth = read_bandwidth("cpu")
    load_before = os.getloadavg()[0]  # a shared machine: the ratios within one run are what mean anything
    print(f"streaming read bandwidth: {bandwidth / 1e9:.1f} GB/s ({torch.get_num_threads()} threads), "
          f"load average {load_before:.1f}")
    results: List[Result] = []
    with scheduling_thread():  # as in the scheduler process
        for batch in args.batch_sizes:
            rng = random.Random(args.seed + batch)
            prompts = [[rng.randrange(10, args.vocab - 10) for _ in range(args.prompt_len)] for _ in range(batch)]
            for name in args.configs:
                os.environ["ENGINE_INT4_INT8_ACTIVATIONS"] = str(int(name == "int4-a8"))  # read at load
                server_args = ServerArgs(model_path=model_path(path, name), device="cpu", log_level="warning",
                                         dtype="bfloat16", quantization=CONFIGS[name],
                                         max_total_tokens=batch * (args.prompt_len + args.out_len + 16) + 256,
                                         max_running_requests=batch, disable_overlap_schedule=True,
                                         chunked_prefill_size=-1, disable_radix_cache=True)
                scheduler = Scheduler(server_args)
                _decode(scheduler, [p[:8] for p in prompts], 4, "warmup")
                step = min(statistics.median(_decode(scheduler, prompts, args.out_len, f"run{r}_"))
                           for r in range(args.repeats))
                scheduler.shutdown()
                nbytes = step_bytes(shape, name, batch, args.prompt_len + args.out_len // 2)
                results.append(Result(name, batch, batch / step, step * 1e3, nbytes / bandwidth * 1e3, nbytes))
    print(f"\nLlama {shape.layers} layers, hidden {shape.hidden}, intermediate {shape.inter}, bf16 activations, "
          f"prompt {args.prompt_len}, {args.out_len} tokens")
    print(f"{'config':9} {'batch':>5} {'tok/s':>8} {'step ms':>8} {'floor ms':>8} {'step/floor':>10} {'vs bf16':>7}")
    by = {(r.config, r.batch): r for r in results}
    for r in results:
        base = by.get(("bf16", r.batch))
        ratio = f"{r.decode_tok_s / base.decode_tok_s:7.2f}" if base else " " * 7
        print(f"{r.config:9} {r.batch:5d} {r.decode_tok_s:8.1f} {r.step_ms:8.1f} {r.floor_ms:8.1f} "
              f"{r.step_ms / r.floor_ms:10.2f} {ratio}")
    kv_results: List[KVResult] = []
    for name in args.kv_configs:
        times = kv_decode_steps(path, name, args.kv_batch, args.kv_context, args.kv_steps)
        element = 1 if name.startswith("fp8") else 2
        context = args.kv_context + args.kv_steps // 2 + 2
        kv_results.append(KVResult(name, args.kv_batch, args.kv_context, statistics.median(times) * 1e3,
                                   kv_bytes(shape, args.kv_batch, context, element),
                                   kv_step_bytes(shape, args.kv_batch, context, element) / bandwidth * 1e3))
    if kv_results:
        print(f"\nKV cache: {args.kv_batch} requests x {args.kv_context} context, decode step, bf16 weights "
              f"(median of {args.kv_steps})")
        print(f"{'kv dtype':9} {'KV MB/step':>10} {'step ms':>8} {'floor ms':>8} {'step/floor':>10} {'vs auto':>7}")
        base = kv_results[0] if kv_results[0].kv_cache_dtype == "auto" else None
        for k in kv_results:
            ratio = f"{base.step_ms / k.step_ms:7.2f}" if base else " " * 7
            print(f"{k.kv_cache_dtype:9} {k.kv_bytes_per_step / 1e6:10.1f} {k.step_ms:8.1f} {k.floor_ms:8.1f} "
                  f"{k.step_ms / k.floor_ms:10.2f} {ratio}")
    load_after = os.getloadavg()[0]
    print(f"load average {load_before:.1f} before, {load_after:.1f} after")
    with open(args.json, "w") as f:
        json.dump({"shape": asdict(shape), "bandwidth_bytes_s": bandwidth, "args": vars(args),
                   "load_average": [load_before, load_after],
                   "results": [asdict(r) for r in results], "kv_results": [asdict(k) for k in kv_results]},
                  f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
