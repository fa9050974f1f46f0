"""Mixture-of-experts decode (issue 37): a random Mixtral-shaped model against the dense Llama with the
same active parameters, side by side in one run, in-process (no HTTP).

The MoE model: --layers decoder layers of hidden --hidden, --experts experts of intermediate
--expert-inter, top --top-k routing (default 8 x 1024, 8 experts, top-2, 3584: Mixtral's proportions
at a quarter of its width). The dense model: the same attention, embedding and head, one MLP of
intermediate top_k x expert_inter, so a token runs the same number of multiply-adds through both.
Both are written once as bf16 safetensors checkpoints (random weights) under --dir.

For each batch size (--batch-sizes, default 1 and 16) both models decode --out-len greedy tokens
(ignore_eos) for the same random prompts; the table reports decode tokens/s, the median decode step,
the MoE / dense ratio, and each step against its memory floor: the bytes a decode step must read
(every weight outside the experts, the embedding rows and the head, the distinct experts the step's
tokens were routed to (counted in a separate pass), the KV cache) at the memory bandwidth measured by
a streaming read of a large tensor on the same cores.

  python benchmarks/bench_moe.py                           # table + bench_moe.json
  python benchmarks/bench_moe.py --layers 2 --out-len 8    # a quick check
  python benchmarks/bench_moe.py --quantization w8a8_int8  # linears and experts int8 (the floor at a byte a weight)
  python benchmarks/bench_moe.py --device cuda --batch-sizes 1 16 64   # the Triton kernel on a GPU

--gpt-oss runs another case instead: one gpt-oss-shaped MoE layer's experts (models/gpt_oss.py
GptOssExperts: --oss-experts experts of hidden = intermediate --oss-hidden, top --oss-top-k, biases, the
clamped SwiGLU; default gpt-oss-20b's 32 x 2880, top-4) from random MXFP4 blocks and scales, kept packed
(the CPU kernel, csrc/linear_mxfp4.c) and dequantized to bf16 (the fused MoE's native path), side by
side: the bytes the experts hold, and the median time of the experts' forward for a decode step of
each batch size (the same routing for both; wall time, and the process's CPU time, which a shared
machine's other work inflates less at one thread), with the bytes of the distinct experts it reads. The
load average is printed with the table: the machine is shared.

  OMP_NUM_THREADS=1 python benchmarks/bench_moe.py --gpt-oss --json bench_moe_gpt_oss.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine.io_struct import TokenizedGenerateReqInput  # noqa: E402
from engine.scheduler.overlap_utils import scheduling_thread  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402


@dataclass
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    experts: int
    top_k: int
    expert_inter: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _config(shape: Shape, moe: bool) -> Dict:
    common = dict(hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                  num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, hidden_act="silu",
                  torch_dtype="bfloat16")
    if moe:
        return dict(common, architectures=["MixtralForCausalLM"], model_type="mixtral",
                    intermediate_size=shape.expert_inter, num_local_experts=shape.experts,
                    num_experts_per_tok=shape.top_k)
    return dict(common, architectures=["LlamaForCausalLM"], model_type="llama",
                intermediate_size=shape.top_k * shape.expert_inter)


def _weights(shape: Shape, moe: bool, seed: int) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

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
        if moe:
            w[p + "block_sparse_moe.gate.weight"] = rand(shape.experts, h)
            for e in range(shape.experts):
                q = f"{p}block_sparse_moe.experts.{e}."
                w[q + "w1.weight"] = rand(shape.expert_inter, h)
                w[q + "w3.weight"] = rand(shape.expert_inter, h)
                w[q + "w2.weight"] = rand(h, shape.expert_inter)
        else:
            inter = shape.top_k * shape.expert_inter
            w[p + "mlp.gate_proj.weight"] = rand(inter, h)
            w[p + "mlp.up_proj.weight"] = rand(inter, h)
            w[p + "mlp.down_proj.weight"] = rand(h, inter)
    return w


def checkpoint(root: str, shape: Shape, moe: bool) -> str:
    """The model directory (written once per shape)."""
    from safetensors.torch import save_file

    name = ("mixtral" if moe else "dense") + "_" + "_".join(str(v) for v in asdict(shape).values())
    path = os.path.join(root, name)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_config(shape, moe), f)
    save_file(_weights(shape, moe, seed=1), os.path.join(path, "model.safetensors.tmp"), metadata={"format": "pt"})
    os.replace(os.path.join(path, "model.safetensors.tmp"), os.path.join(path, "model.safetensors"))
    return path


@dataclass
class Result:
    model: str
    batch: int
    decode_tok_s: float
    step_ms: float
    floor_ms: float
    bytes_per_step: float
    experts_read_per_layer: float


def _scheduler(path: str, batch: int, args: argparse.Namespace) -> Scheduler:
    server_args = ServerArgs(model_path=path, device=args.device, log_level="warning", dtype="bfloat16",
                             quantization=args.quantization,
                             max_total_tokens=batch * (args.prompt_len + args.out_len + 16) + 256,
                             max_running_requests=batch, disable_overlap_schedule=True, chunked_prefill_size=-1,
                             disable_radix_cache=True)
    return Scheduler(server_args)


def _decode(scheduler: Scheduler, prompts: List[List[int]], out_len: int, tag: str) -> List[float]:
    """Run the prompts to completion; the duration of every decode step."""
    greedy = {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}
    for i, p in enumerate(prompts):
        scheduler.add_request(TokenizedGenerateReqInput(rid=f"{tag}{i}", input_ids=p, sampling_params=greedy))
    steps: List[float] = []
    while scheduler.has_work():
        t = time.perf_counter()
        batch = scheduler.step()
        dt = time.perf_counter() - t
        if batch is not None and batch.forward_mode.is_decode():
            steps.append(dt)
        scheduler.outbox.clear()
    return steps


def experts_read(scheduler: Scheduler, prompts: List[List[int]], out_len: int) -> float:
    """Mean distinct experts a decode step's tokens go to, per MoE layer (0 for a dense model)."""
    from engine.layers.moe.layer import FusedMoE
    from engine.layers.moe.router import select_experts

    model = scheduler.worker.model_runner.model
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        return 0.0
    decoding = [False]
    distinct: List[int] = []

    def mode_hook(module, args, kwargs):
        forward_batch = args[2] if len(args) > 2 else kwargs["forward_batch"]
        decoding[0] = forward_batch.forward_mode.is_decode()

    def moe_hook(module, args):
        if decoding[0]:
            _, ids = select_experts(args[1], module.top_k, module.renormalize)
            distinct.append(int(torch.unique(ids).numel()))

    # On the first decoder layer (called as a module, with the batch third): the model itself is run through
    # its forward method, which hooks do not see.
    handles = [model.model.layers[0].register_forward_pre_hook(mode_hook, with_kwargs=True)]
    handles += [m.register_forward_pre_hook(moe_hook) for m in layers]
    # The native decode chain runs no modules: this pass takes the modules' path (the same routing).
    chain_layers, model.model.chain_layers = model.model.chain_layers, None
    try:
        _decode(scheduler, prompts, out_len, "count")
    finally:
        model.model.chain_layers = chain_layers
        for h in handles:
            h.remove()
    return statistics.fmean(distinct)


def read_bandwidth(device: str, gib: float = 1.0) -> float:
    """Bytes/s of a streaming read (a float32 sum over a tensor much larger than the caches), best of 5."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        x.sum().item()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


def step_bytes(shape: Shape, moe: bool, batch: int, experts: float, context: int, linear_bytes: int = 2) -> float:
    """What one decode step must read: the weights it uses (the linears and experts at `linear_bytes` a weight,
    the router, head and embedding rows in bf16), the KV cache of `batch` requests (bf16)."""
    h, d, L = shape.hidden, shape.head_dim, shape.layers
    attention = (shape.heads * d * h * 2 + shape.kv_heads * d * h * 2) * L
    per_expert = 3 * h * shape.expert_inter
    ffn = experts * per_expert * L if moe else 3 * h * shape.top_k * shape.expert_inter * L
    router = shape.experts * h * L if moe else 0
    head = shape.vocab * h + batch * h  # the LM head, and the embedding rows of the batch
    kv = batch * context * L * 2 * shape.kv_heads * d
    return linear_bytes * (attention + ffn) + 2.0 * (router + head + kv)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-inter", type=int, default=3584)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=32)
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "engine_bench_moe"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quantization", choices=["w8a8_int8", "fp8"], default=None,
                    help="both models' linears and experts quantized at load (one byte a weight in the floor)")
    ap.add_argument("--json", default="bench_moe.json")
    ap.add_argument("--gpt-oss", action="store_true", help="the gpt-oss MXFP4 experts case (module doc)")
    ap.add_argument("--oss-experts", type=int, default=32)
    ap.add_argument("--oss-hidden", type=int, default=2880)
    ap.add_argument("--oss-top-k", type=int, default=4)
    ap.add_argument("--oss-reps", type=int, default=20)
    args = ap.parse_args()
    if args.gpt_oss:
        gpt_oss_experts(args)
        return
    shape = Shape(args.layers, args.hidden, args.heads, args.kv_heads, args.experts, args.top_k, args.expert_inter,
                  args.vocab)
    paths = {"mixtral": checkpoint(args.dir, shape, True), "dense": checkpoint(args.dir, shape, False)}
    bandwidth = read_bandwidth(args.device)
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else torch.cuda.get_device_name()
    print(f"streaming read bandwidth: {bandwidth / 1e9:.1f} GB/s ({where})")
    results: List[Result] = []
    with scheduling_thread():  # as in the scheduler process
        for batch in args.batch_sizes:
            rng = random.Random(args.seed + batch)
            prompts = [[rng.randrange(10, args.vocab - 10) for _ in range(args.prompt_len)] for _ in range(batch)]
            for name, path in paths.items():
                scheduler = _scheduler(path, batch, args)
                _decode(scheduler, [p[:8] for p in prompts], 4, "warmup")
                experts = experts_read(scheduler, prompts, min(args.out_len, 8))
                steps = _decode(scheduler, prompts, args.out_len, "run")
                scheduler.shutdown()
                context = args.prompt_len + args.out_len // 2
                nbytes = step_bytes(shape, name == "mixtral", batch, experts, context,
                                    1 if args.quantization else 2)
                step = statistics.median(steps)
                results.append(Result(name, batch, batch / step, step * 1e3, nbytes / bandwidth * 1e3, nbytes,
                                      experts))
    _report(results, shape, bandwidth, args)


def _report(results: List[Result], shape: Shape, bandwidth: float, args: argparse.Namespace) -> None:
    print(f"\nMoE {shape.layers} layers x {shape.experts} experts (top-{shape.top_k}, hidden {shape.hidden}, "
          f"expert intermediate {shape.expert_inter}) vs dense (intermediate {shape.top_k * shape.expert_inter}), "
          f"bf16{', ' + args.quantization if args.quantization else ''}, prompt {args.prompt_len}, "
          f"{args.out_len} tokens")
    print(f"{'model':8} {'batch':>5} {'tok/s':>8} {'step ms':>8} {'floor ms':>8} {'step/floor':>10} "
          f"{'experts/layer':>13} {'MoE/dense':>9}")
    by: Dict[Tuple[str, int], Result] = {(r.model, r.batch): r for r in results}
    for r in results:
        dense = by.get(("dense", r.batch))
        ratio = f"{r.decode_tok_s / dense.decode_tok_s:9.2f}" if r.model == "mixtral" and dense else " " * 9
        print(f"{r.model:8} {r.batch:5d} {r.decode_tok_s:8.1f} {r.step_ms:8.1f} {r.floor_ms:8.1f} "
              f"{r.step_ms / r.floor_ms:10.2f} {r.experts_read_per_layer:13.2f} {ratio}")
    with open(args.json, "w") as f:
        json.dump({"shape": asdict(shape), "bandwidth_bytes_s": bandwidth, "args": vars(args),
                   "results": [asdict(r) for r in results]}, f, indent=2)
    print(f"wrote {args.json}")


def _oss_layer(args: argparse.Namespace, mxfp4: bool, ckpt: Dict[str, torch.Tensor]):
    """A GptOssExperts loaded through its own weight loaders from checkpoint-shaped tensors: the packed
    blocks and scales, or (mxfp4 False) the bf16 weights they dequantize to, one expert at a time."""
    from engine.layers.mxfp4 import dequantize_mxfp4
    from engine.model_loader.weight_utils import weight_loader_of
    from engine.models.gpt_oss import GptOssExperts

    e, h = args.oss_experts, args.oss_hidden
    with torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = GptOssExperts(e, h, h, 1.702, 7.0, mxfp4=mxfp4)
        finally:
            torch.set_default_dtype(torch.float32)
    params = dict(layer.named_parameters())
    tensors: Dict[str, torch.Tensor] = {"w13_weight_bias": ckpt["gate_up_proj_bias"], "w2_weight_bias": ckpt["down_proj_bias"]}
    for ours, theirs in (("w13", "gate_up_proj"), ("w2", "down_proj")):
        blocks, scales = ckpt[f"{theirs}_blocks"], ckpt[f"{theirs}_scales"]
        if mxfp4:
            tensors[f"{ours}_blocks"], tensors[f"{ours}_scales"] = blocks, scales
        else:  # [E, in, out] in bf16, built per expert: the float32 whole would take 8 bytes a weight
            rows, groups = scales.shape[1], scales.shape[2]
            dense = torch.empty(e, groups * 32, rows, dtype=torch.bfloat16)
            for i in range(e):
                dense[i] = dequantize_mxfp4(blocks[i:i + 1], scales[i:i + 1])[0]
            tensors[f"{ours}_weight"] = dense
    for name, tensor in tensors.items():
        weight_loader_of(params[name])(params[name], tensor)
    return layer


def gpt_oss_experts(args: argparse.Namespace) -> None:
    e, h, k = args.oss_experts, args.oss_hidden, args.oss_top_k
    gen = torch.Generator().manual_seed(args.seed)
    # Random codes; exponents around 2^-6 as trained gpt-oss weights have (|w| mostly below 0.1).
    ckpt = {"gate_up_proj_blocks": torch.randint(0, 256, (e, 2 * h, h // 32, 16), dtype=torch.uint8, generator=gen),
            "gate_up_proj_scales": torch.randint(118, 124, (e, 2 * h, h // 32), dtype=torch.uint8, generator=gen),
            "down_proj_blocks": torch.randint(0, 256, (e, h, h // 32, 16), dtype=torch.uint8, generator=gen),
            "down_proj_scales": torch.randint(118, 124, (e, h, h // 32), dtype=torch.uint8, generator=gen),
            "gate_up_proj_bias": torch.randn(e, 2 * h, generator=gen).to(torch.bfloat16) * 0.1,
            "down_proj_bias": torch.randn(e, h, generator=gen).to(torch.bfloat16) * 0.1}
    rows: List[Dict] = []
    layers = {"bf16": _oss_layer(args, False, ckpt), "mxfp4": _oss_layer(args, True, ckpt)}
    per_expert = {name: layer.expert_bytes() / e for name, layer in layers.items()}
    with torch.inference_mode():
        for batch in args.batch_sizes:
            x = torch.randn(batch, h, generator=gen).to(torch.bfloat16)
            weights, ids = torch.softmax(torch.randn(batch, k, generator=gen), -1), torch.stack(
                [torch.randperm(e, generator=gen)[:k] for _ in range(batch)])
            distinct = int(torch.unique(ids).numel())
            outs = {}
            for name, layer in layers.items():
                outs[name] = layer(x, ids, weights)  # warm-up (and the kernel library's build)
                times, cpu_times = [], []
                for _ in range(args.oss_reps):
                    t, c = time.perf_counter(), time.process_time()
                    layer(x, ids, weights)
                    times.append(time.perf_counter() - t)
                    cpu_times.append(time.process_time() - c)
                step = statistics.median(times)
                read = distinct * per_expert[name]
                rows.append({"weights": name, "batch": batch, "step_ms": step * 1e3,
                             "cpu_ms": statistics.median(cpu_times) * 1e3, "experts_read": distinct,
                             "bytes_read": read, "read_gb_s": read / step / 1e9,
                             "expert_bytes": layers[name].expert_bytes()})
            diff = (outs["mxfp4"].float() - outs["bf16"].float()).abs().max().item()
            rows[-1]["max_abs_diff_vs_bf16"] = diff
    load = os.getloadavg()
    print(f"\ngpt-oss experts, one layer: {e} experts, hidden = intermediate {h}, top-{k}, bf16 activations, "
          f"{torch.get_num_threads()} threads, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    print(f"{'weights':8} {'batch':>5} {'expert GB':>9} {'step ms':>8} {'CPU ms':>8} {'experts read':>12} "
          f"{'GB/s read':>9} {'bf16/mxfp4':>10}")
    by = {(r["weights"], r["batch"]): r for r in rows}
    for r in rows:
        base = by[("bf16", r["batch"])]
        ratio = f"{base['step_ms'] / r['step_ms']:10.2f}" if r["weights"] == "mxfp4" else " " * 10
        print(f"{r['weights']:8} {r['batch']:5d} {r['expert_bytes'] / 1e9:9.3f} {r['step_ms']:8.2f} {r['cpu_ms']:8.2f} "
              f"{r['experts_read']:12d} {r['read_gb_s']:9.1f} {ratio}")
    with open(args.json, "w") as f:
        json.dump({"case": "gpt-oss experts", "args": vars(args), "load_average": load, "results": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
