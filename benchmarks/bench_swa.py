"""Sliding-window attention (issue 39): a long-context workload on a random windowed model against the same
model run as full attention, side by side in one run, in-process (no HTTP).

Both checkpoints hold the same random weights (Mistral-shaped: --layers layers of hidden --hidden); the
windowed one's config says sliding_window --window, the full one's says none. Each decodes --out-len
greedy tokens (ignore_eos) after --batch prompts of --prompt-len random tokens (chunked prefill of
--chunk). The table reports, per model: the median decode step at the start and at the end of the
decode (the context grew by out-len meanwhile) and their ratio (flat in context: about 1), decode
tokens/s, and the KV memory: the most KV slots held at once (read from the allocator after every step)
and the most the windowed layers held, with their bytes. The windowed model runs with the hybrid pool
(mem_cache/swa_pool.py: --disable-radix-cache, page size 1, torch_native), whose windowed layers keep
what their windows still see; the full model keeps every token. `windowed-torch` is the windowed model
again with the native attention kernels switched off: its windowed layers take the torch path
(layers/attention/windowed.py) instead of the decode kernel's masked rows (kernel_rows.py).

  python benchmarks/bench_swa.py                                   # table + bench_swa.json
  python benchmarks/bench_swa.py --prompt-len 512 --out-len 32     # a quick check
  python benchmarks/bench_swa.py --models windowed,windowed-torch --prompt-len 4096 --out-len 32  # kernel vs torch
  python benchmarks/bench_swa.py --layer-contexts 1024,4096        # one windowed layer's decode attention

--layer-contexts times one windowed layer's decode attention alone (--batch requests at each context,
the model's head shape and window, a float32 pool), the kernel's masked rows against the torch path,
interleaved, fastest of --layer-repeats each: on a shared machine the fastest run is the one least
disturbed, where whole steps' medians swing with the load.
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
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine.io_struct import TokenizedGenerateReqInput  # noqa: E402
from engine.kernels import library  # noqa: E402
from engine.scheduler.overlap_utils import scheduling_thread  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402


def _config(args: argparse.Namespace, window: Optional[int]) -> Dict:
    return dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                intermediate_size=args.hidden * 3, vocab_size=args.vocab, max_position_embeddings=16384,
                rms_norm_eps=1e-5, rope_theta=1e6, tie_word_embeddings=False, hidden_act="silu",
                torch_dtype=args.dtype, sliding_window=window)


def _weights(args: argparse.Namespace) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    dtype = getattr(torch, args.dtype)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) / dims[-1] ** 0.5).to(dtype)

    h, d = args.hidden, args.hidden // args.heads
    w = {"model.embed_tokens.weight": rand(args.vocab, h), "lm_head.weight": rand(args.vocab, h),
         "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(args.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(args.heads * d, h)
        w[p + "self_attn.k_proj.weight"] = rand(args.kv_heads * d, h)
        w[p + "self_attn.v_proj.weight"] = rand(args.kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, args.heads * d)
        w[p + "input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        w[p + "mlp.gate_proj.weight"] = rand(3 * h, h)
        w[p + "mlp.up_proj.weight"] = rand(3 * h, h)
        w[p + "mlp.down_proj.weight"] = rand(h, 3 * h)
    return w


def checkpoints(args: argparse.Namespace) -> Dict[str, str]:
    """{"windowed": dir, "full": dir}: one weights file, two configs."""
    from safetensors.torch import save_file

    root = os.path.join(args.dir, f"l{args.layers}_h{args.hidden}_{args.dtype}")
    weights = os.path.join(root, "model.safetensors")
    if not os.path.exists(weights):
        os.makedirs(root, exist_ok=True)
        save_file(_weights(args), weights + ".tmp", metadata={"format": "pt"})
        os.replace(weights + ".tmp", weights)
    paths = {}
    for name, window in (("windowed", args.window), ("full", None)):
        path = os.path.join(root, f"{name}_{window}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(_config(args, window), f)
        link = os.path.join(path, "model.safetensors")
        if not os.path.exists(link):
            os.symlink(weights, link)
        paths[name] = path
    return paths


@dataclass
class Result:
    model: str
    first_steps_ms: float  # median decode step over the first quarter of the decode
    last_steps_ms: float  # and over the last quarter
    decode_tok_s: float
    peak_kv_slots: int  # full-pool slots
    peak_window_layer_slots: int  # slots the windowed layers held (the hybrid pool's; else the full pool's)
    window_layers_kv_bytes: int  # what the windowed layers' K/V took at that peak
    window_bound_kv_bytes: int  # each request's window, for comparison


def _run(path: str, prompts: List[List[int]], args: argparse.Namespace) -> Result:
    total = len(prompts) * (args.prompt_len + args.out_len + 64) + 1024
    server_args = ServerArgs(model_path=path, device="cpu", log_level="warning", dtype=args.dtype,
                             max_total_tokens=total, max_running_requests=len(prompts),
                             disable_overlap_schedule=True, chunked_prefill_size=args.chunk, disable_radix_cache=True)
    scheduler = Scheduler(server_args)
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator

    allocator = scheduler.kv.token_to_kv_pool_allocator
    capacity = allocator.available_size()
    hybrid = allocator if isinstance(allocator, SWATokenToKVPoolAllocator) else None
    greedy = {"max_new_tokens": args.out_len, "temperature": 0.0, "ignore_eos": True}
    for i, p in enumerate(prompts):
        scheduler.add_request(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=p, sampling_params=greedy))
    steps: List[float] = []
    peak = peak_window = 0
    while scheduler.has_work():
        t = time.perf_counter()
        batch = scheduler.step()
        dt = time.perf_counter() - t
        if batch is not None and batch.forward_mode.is_decode():
            steps.append(dt)
        peak = max(peak, capacity - allocator.available_size())
        window_held = (hybrid.swa.size - hybrid.swa_available_size()) if hybrid is not None else \
            capacity - allocator.available_size()
        peak_window = max(peak_window, window_held)
        scheduler.outbox.clear()
    scheduler.shutdown()
    quarter = max(1, len(steps) // 4)
    d = args.hidden // args.heads
    per_slot = 2 * args.kv_heads * d * torch.finfo(getattr(torch, args.dtype)).bits // 8 * args.layers
    bound = len(prompts) * args.window * per_slot
    return Result(os.path.basename(path).split("_")[0], statistics.median(steps[:quarter]) * 1e3,
                  statistics.median(steps[-quarter:]) * 1e3, len(prompts) / statistics.median(steps), peak,
                  peak_window, peak_window * per_slot, bound)


def layer_decode(args: argparse.Namespace, context: int) -> Dict[str, float]:
    """{"kernel": ms, "torch": ms}: the fastest of --layer-repeats decode attentions of one windowed layer."""
    from engine.layers.attention import windowed
    from engine.layers.attention.kernel_rows import KernelRows
    from engine.layers.radix_attention import RadixAttention
    from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    gen = torch.Generator().manual_seed(0)
    dim = args.hidden // args.heads
    slots = args.batch * context
    pool = MHATokenToKVPool(slots, 1, torch.float32, args.kv_heads, dim, 1)
    every = torch.arange(1, slots + 1)
    pool.set_kv_buffer(0, every, torch.randn(slots, args.kv_heads, dim, generator=gen),
                       torch.randn(slots, args.kv_heads, dim, generator=gen))
    reqs = ReqToTokenPool(args.batch, context)
    reqs.req_to_token[1:] = every.view(args.batch, context).to(torch.int32)
    seq_lens = [context] * args.batch
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=args.batch,
                      input_ids=torch.zeros(args.batch, dtype=torch.int64), positions=torch.tensor(seq_lens) - 1,
                      req_pool_indices=torch.arange(1, args.batch + 1), seq_lens=torch.tensor(seq_lens),
                      seq_lens_cpu=seq_lens, out_cache_loc=every[:args.batch], seq_lens_sum=sum(seq_lens),
                      req_to_token_pool=reqs, token_to_kv_pool=pool)
    layer = RadixAttention(args.heads, dim, dim ** -0.5, args.kv_heads, 0, sliding_window_size=args.window)
    q = torch.randn(args.batch, args.heads * dim, generator=gen)
    rows = KernelRows(fb)  # a forward builds the tables once for all its windowed layers
    paths = {"kernel": lambda: rows.attend(q, layer), "torch": lambda: windowed.windowed_decode(q, layer, fb)}
    best = {name: float("inf") for name in paths}
    with torch.inference_mode():
        for _ in range(args.layer_repeats):
            for name, run in paths.items():
                t = time.perf_counter()
                run()
                best[name] = min(best[name], (time.perf_counter() - t) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--out-len", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "engine_bench_swa"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="bench_swa.json")
    ap.add_argument("--models", default="windowed,full", help="of windowed, windowed-torch, full")
    ap.add_argument("--layer-contexts", default="", help="comma-separated contexts: time one layer's decode only")
    ap.add_argument("--layer-repeats", type=int, default=50)
    args = ap.parse_args()
    if args.layer_contexts:
        rows = {int(c): layer_decode(args, int(c)) for c in args.layer_contexts.split(",")}
        print(f"\nOne windowed layer's decode attention: {args.heads} heads / {args.kv_heads} KV heads of "
              f"{args.hidden // args.heads}, window {args.window}, batch {args.batch}, float32; fastest of "
              f"{args.layer_repeats}")
        print(f"{'context':>8} {'kernel ms':>10} {'torch ms':>9} {'torch / kernel':>14}")
        for context, best in rows.items():
            print(f"{context:8d} {best['kernel']:10.3f} {best['torch']:9.3f} {best['torch'] / best['kernel']:14.1f}")
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "layer_decode_ms": rows}, f, indent=2)
        return
    models = args.models.split(",")
    if not models or set(models) - {"windowed", "windowed-torch", "full"}:
        ap.error(f"--models takes windowed, windowed-torch and full, got {args.models!r}")
    paths = checkpoints(args)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, args.vocab - 10) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    results: List[Result] = []
    switches = library.switches()
    with scheduling_thread():  # as in the scheduler process
        for model in models:
            kernels = switches[library.Family.ATTENTION]
            switches[library.Family.ATTENTION] = kernels and model != "windowed-torch"
            try:
                results.append(_run(paths[model.split("-")[0]], prompts, args))
            finally:
                switches[library.Family.ATTENTION] = kernels
            results[-1].model = model
    print(f"\nMistral-shaped {args.layers} layers, hidden {args.hidden}, {args.dtype}, window {args.window}; "
          f"batch {args.batch}, prompt {args.prompt_len}, {args.out_len} tokens, chunk {args.chunk}")
    print(f"{'model':14} {'first ms':>9} {'last ms':>8} {'last/first':>10} {'tok/s':>8} {'peak slots':>10} "
          f"{'windowed-layer slots':>20} {'their MiB':>9} {'window-bound MiB':>16}")
    for r in results:
        print(f"{r.model:14} {r.first_steps_ms:9.2f} {r.last_steps_ms:8.2f} {r.last_steps_ms / r.first_steps_ms:10.2f} "
              f"{r.decode_tok_s:8.1f} {r.peak_kv_slots:10d} {r.peak_window_layer_slots:20d} "
              f"{r.window_layers_kv_bytes / 2**20:9.1f} {r.window_bound_kv_bytes / 2**20:16.1f}")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "results": [asdict(r) for r in results]}, f, indent=2)


if __name__ == "__main__":
    main()
