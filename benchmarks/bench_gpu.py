"""GPU benchmarks, each against a ceiling measured in the same run (scripts/gpu_check.sh runs this).

  ceilings  device-to-device copy bandwidth (bytes read + written per second) and the bf16 matmul
            rate on random data (8192^3), timed with CUDA events, median of many runs.
  decode    bench_one_batch-style decode steps (ModelRunner + CUDA graphs, sampling included) at
            batch 1, 32 and 128 over a random-filled context, against the memory floor:
            (weight bytes + KV bytes read per step) / copy bandwidth.
  prefill   one extend of batch x input_len tokens, against FLOPs / measured matmul rate.
  offline   the in-process scheduler (overlap, radix cache, CUDA graphs) on N prompts with input
            and output lengths U[100, 1024], ignore_eos (bench_offline_throughput's workload).
  profile   (--profile-batch-sizes) the decode step under torch.profiler: per-kernel device time
            and launch counts, written to --profile-file (where a step's time goes vs its floor).
  variants  side by side in the same process (--variants): `graphs_off` rebuilds the scheduler
            without CUDA graphs and repeats the decode steps; `overlap_off` runs a smaller offline
            workload (--compare-prompts) with the overlap loop and then without it.

The model has the shape of Llama-3-8B in bfloat16 with random weights generated on the device (no
checkpoint is written or read: the loader's weight iterator is replaced for this process).
`--model tiny --device cpu` runs every phase on a toy shape on the CPU, to check the plumbing.

    python benchmarks/bench_gpu.py --result-file gpu.json --table-file gpu_table.txt
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, Iterator, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

logger = logging.getLogger("bench_gpu")

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                 rope_theta=10000.0, rms_norm_eps=1e-5),
}


# ---------------------------------------------------------------------------- timing
def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], None], device: str, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of fn over `iters` runs (CUDA events on the GPU)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure_ceilings(device: str, copy_bytes: int, matmul_n: int) -> Dict[str, float]:
    """Copy bandwidth (read + write bytes / s) and bf16 matmul FLOP/s, on random data, rotating
    buffers so that no run is served from the L2 cache. The buffers go when this returns (the KV
    pool is sized later, after an empty_cache)."""
    n = copy_bytes // 2
    srcs = [torch.randn(n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    dst = torch.empty_like(srcs[0])
    turn = [0]

    def copy() -> None:
        turn[0] ^= 1
        dst.copy_(srcs[turn[0]])

    copy_ms = time_ms(copy, device, iters=20)
    lhs = [torch.randn(matmul_n, matmul_n, device=device, dtype=torch.bfloat16) for _ in range(2)]
    rhs = torch.randn(matmul_n, matmul_n, device=device, dtype=torch.bfloat16)

    def matmul() -> None:
        turn[0] ^= 1
        torch.mm(lhs[turn[0]], rhs)

    mm_ms = time_ms(matmul, device, iters=20)
    return {
        "copy_bandwidth_Bps": 2 * copy_bytes / (copy_ms / 1e3),
        "copy_ms": copy_ms,
        "matmul_flops": 2 * matmul_n**3 / (mm_ms / 1e3),
        "matmul_ms": mm_ms,
        "matmul_n": matmul_n,
    }


# ---------------------------------------------------------------------------- the model
def write_config(path: str, shape: Dict) -> str:
    config = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                  torch_dtype="bfloat16", tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


def llama_weight_shapes(shape: Dict) -> Iterator[Tuple[str, Tuple[int, ...]]]:
    """Names and shapes of a Hugging Face Llama checkpoint."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield p + "self_attn.q_proj.weight", (h, h)
        yield p + "self_attn.k_proj.weight", (kv, h)
        yield p + "self_attn.v_proj.weight", (kv, h)
        yield p + "self_attn.o_proj.weight", (h, h)
        yield p + "mlp.gate_proj.weight", (i, h)
        yield p + "mlp.up_proj.weight", (i, h)
        yield p + "mlp.down_proj.weight", (h, i)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


@contextlib.contextmanager
def random_weights(shape: Dict, device: str, seed: int = 0) -> Iterator[None]:
    """Make the loader read random weights made on `device` instead of safetensors files."""
    import engine.model_loader.loader as loader

    def iterator(_path: str):
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, dims in llama_weight_shapes(shape):
            if len(dims) == 1:  # norms
                yield name, torch.ones(dims, device=device, dtype=torch.bfloat16)
            else:  # HF's initializer_range; never zeros (METHOD.md: zeros time faster)
                yield name, (torch.randn(dims, device=device, generator=gen) * 0.02).to(torch.bfloat16)

    original = loader.safetensors_weights_iterator
    loader.safetensors_weights_iterator = iterator
    try:
        yield
    finally:
        loader.safetensors_weights_iterator = original


def weight_bytes(model: torch.nn.Module) -> Tuple[int, int]:
    """(all parameter bytes, embedding bytes); a decode step reads all but the embedding table."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.model.embed_tokens.weight
    return total, embed.numel() * embed.element_size()


# ---------------------------------------------------------------------------- decode and prefill
def bench_decode(runner, bs: int, context_len: int, steps: int) -> Dict[str, float]:
    """Median latency of one decode step (forward + greedy sampling + sync) at `context_len`."""
    from bench_one_batch import OneBatch

    device = runner.device
    driver = OneBatch(runner)
    rows = runner.req_to_token_pool.alloc(bs)
    assert rows is not None, "not enough request slots"
    driver.rows = torch.tensor(rows, dtype=torch.int64)
    driver.seq_lens = torch.full((bs,), context_len, dtype=torch.int64)
    out_loc = driver.allocator.alloc_extend(torch.zeros(bs, dtype=torch.int64), driver.seq_lens,
                                            torch.full((bs,), -1, dtype=torch.int64), bs * context_len)
    assert out_loc is not None, "not enough KV slots"
    driver.table[driver.rows.to(driver.table.device), :context_len] = out_loc.view(bs, context_len).to(driver.table)
    tokens = torch.randint(0, runner.model_config.vocab_size, (bs,), device=device)
    latencies = []
    for step in range(steps + 3):
        _sync(device)
        t = time.perf_counter()
        tokens = driver.decode(tokens)
        _sync(device)
        if step >= 3:  # the first steps touch fresh KV pages and graph memory
            latencies.append((time.perf_counter() - t) * 1e3)
    driver.release()
    return {"median_ms": statistics.median(latencies), "context_len": context_len + steps // 2}


def decode_floor_ms(runner, bs: int, context_len: int, copy_bw: float) -> Tuple[float, float]:
    """(floor ms, bytes per step): weights read once (not the embedding table) + every request's KV."""
    total, embed = weight_bytes(runner.model)
    kv = bs * context_len * runner.kv_bytes_per_token()
    moved = total - embed + kv
    return moved / copy_bw * 1e3, moved


def prefill_flops(shape: Dict, bs: int, input_len: int) -> float:
    h, i, v, layers = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    linear_params = layers * (2 * h * h + 2 * kv * h + 3 * h * i)
    tokens = bs * input_len
    # Causal attention: QK^T and PV over about L^2 / 2 pairs per sequence and layer.
    attention = layers * 2 * 2 * h * (input_len * input_len / 2) * bs
    lm_head = 2 * bs * v * h  # only the last position of each request is projected
    return 2 * linear_params * tokens + attention + lm_head


def bench_prefill(runner, bs: int, input_len: int, repeats: int) -> float:
    """Median seconds of one extend of bs x input_len tokens (sampling included)."""
    from bench_one_batch import OneBatch

    device = runner.device
    times = []
    for r in range(repeats + 1):
        driver = OneBatch(runner)
        ids = torch.randint(0, runner.model_config.vocab_size, (bs, input_len), device=device)
        _sync(device)
        t = time.perf_counter()
        driver.prefill(ids)
        _sync(device)
        if r > 0:  # the first one compiles the extend kernel
            times.append(time.perf_counter() - t)
        driver.release()
    return statistics.median(times)


# ---------------------------------------------------------------------------- offline throughput
def bench_offline(scheduler, num_prompts: int, in_range, out_range, vocab: int, deadline_s: float, seed: int,
                  tag: str = "o"):
    from bench_offline_throughput import RunResult, random_workload

    from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput

    workload = random_workload(num_prompts, in_range, out_range, vocab, seed)
    step = scheduler.step_overlap if scheduler.enable_overlap else scheduler.step
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens)):
        scheduler.add_request(TokenizedGenerateReqInput(
            rid=f"{tag}{i}", input_ids=p, stream=True,
            sampling_params={"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}))
    first: Dict[str, float] = {}
    last: Dict[str, float] = {}
    itl: List[float] = []
    e2e: List[float] = []
    out_tokens = 0
    finished_input = 0
    timed_out = False
    while scheduler.has_work():
        if time.perf_counter() - start > deadline_s:
            timed_out = True
            break
        step()
        now = time.perf_counter() - start
        for msg in scheduler.outbox:
            if not isinstance(msg, BatchTokenIDOutput):
                continue
            for rid, ids, fr in zip(msg.rids, msg.output_ids, msg.finished_reasons):
                if ids:
                    if rid not in first:
                        first[rid] = now
                    else:
                        itl.extend([(now - last[rid]) / len(ids)] * len(ids))
                    last[rid] = now
                    out_tokens += len(ids)
                if fr is not None:
                    e2e.append(now)
                    finished_input += len(workload.prompts[int(rid[len(tag):])])
        scheduler.outbox.clear()
    duration = time.perf_counter() - start
    # Counted over what was done (all of it unless the deadline cut the run short).
    input_tokens = sum(map(len, workload.prompts)) if not timed_out else finished_input
    result = RunResult("engine", duration, input_tokens, out_tokens, ttft=list(first.values()), e2e=e2e, itl=itl)
    metrics = result.metrics()
    metrics.update(completed=len(e2e), num_prompts=num_prompts, timed_out=timed_out)
    return metrics


def profile_decode(runner, bs: int, context_len: int, steps: int, row_limit: int = 40) -> str:
    """Kernel table of `steps` decode steps at batch `bs` (after the same warm-up as bench_decode)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        bench_decode(runner, bs, context_len, steps)
    sort_by = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=row_limit)
    return f"decode bs={bs} context {context_len}, {steps} timed steps (+3 warm-up), sorted by {sort_by}\n{table}\n"


# ---------------------------------------------------------------------------- main
def free_device_memory() -> None:
    """After the caller dropped its last reference to a scheduler (its forward thread stopped):
    give its weights, KV pool and graphs back to the device before the next one is built."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build_scheduler(model_dir: str, shape: Dict, args, disable_cuda_graph: bool = False,
                    disable_overlap: bool = False):
    from engine.scheduler.scheduler import Scheduler
    from engine.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=model_dir, dtype="bfloat16", device=args.device, log_level="warning",
        cuda_graph_max_bs=args.cuda_graph_max_bs, disable_cuda_graph=args.disable_cuda_graph or disable_cuda_graph,
        disable_overlap_schedule=disable_overlap,
        max_total_tokens=args.max_total_tokens, mem_fraction_static=args.mem_fraction_static,
        attention_backend=args.attention_backend,
    )
    with random_weights(shape, server_args.device if server_args.device == "cpu" else "cuda", args.seed):
        return Scheduler(server_args)


def main(argv: Optional[List[str]] = None) -> Dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--phases", default="ceilings,decode,prefill,offline")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--cuda-graph-max-bs", type=int, default=160)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--max-total-tokens", type=int, default=None)
    p.add_argument("--copy-gib", type=float, default=4.0)
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--decode-batch-sizes", default="1,32,128")
    p.add_argument("--decode-context", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=20)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    p.add_argument("--offline-deadline-s", type=float, default=240.0,
                   help="stop the offline run after this long and report what completed")
    p.add_argument("--variants", default="",
                   help="comma-separated, run after the main phases: graphs_off (decode without CUDA graphs), "
                        "overlap_off (a --compare-prompts offline run with the overlap loop, then without)")
    p.add_argument("--compare-prompts", type=int, default=200)
    p.add_argument("--profile-batch-sizes", default="",
                   help="comma-separated decode batch sizes to profile (kernel table to --profile-file)")
    p.add_argument("--profile-file", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    p.add_argument("--table-file", default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    phases = set(args.phases.split(","))
    device = args.device
    shape = SHAPES[args.model]
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    result: Dict = {"model": args.model, "device": device, "phases": sorted(phases), "args": vars(args)}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "memory_GiB": props.total_memory / 2**30,
                         "sm_count": props.multi_processor_count, "torch": torch.__version__}
    t0 = time.perf_counter()
    if "ceilings" in phases or "decode" in phases or "prefill" in phases:
        result["ceilings"] = measure_ceilings(device, int(args.copy_gib * 2**30), args.matmul_n)
        logger.info("ceilings: %s", result["ceilings"])

    tmp = tempfile.TemporaryDirectory(prefix="bench-gpu-")
    model_dir = write_config(tmp.name, shape)
    t = time.perf_counter()
    scheduler = build_scheduler(model_dir, shape, args)
    runner = scheduler.worker.model_runner
    result["startup_s"] = time.perf_counter() - t
    total_bytes, embed_bytes = weight_bytes(runner.model)
    result["weights_GB"] = total_bytes / 1e9
    result["kv_pool_tokens"] = runner.max_total_num_tokens
    result["cuda_graphs"] = runner.cuda_graph_runner is not None
    # Random KV everywhere: attention must not read zeros (they can be faster than real data).
    with torch.inference_mode():
        for buf in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer:
            buf.normal_()

    copy_bw = result.get("ceilings", {}).get("copy_bandwidth_Bps")
    if "decode" in phases:
        result["decode"] = {}
        for bs in [int(x) for x in args.decode_batch_sizes.split(",")]:
            r = bench_decode(runner, bs, args.decode_context, args.decode_steps)
            floor_ms, moved = decode_floor_ms(runner, bs, r["context_len"], copy_bw)
            r.update(floor_ms=floor_ms, bytes_per_step=moved, floor_over_measured=floor_ms / r["median_ms"],
                     tokens_per_s=bs / (r["median_ms"] / 1e3))
            result["decode"][str(bs)] = r
            logger.info("decode bs=%d: %s", bs, r)
    if args.profile_batch_sizes:
        tables = [profile_decode(runner, int(bs), args.decode_context, 10) for bs in args.profile_batch_sizes.split(",")]
        if args.profile_file:
            with open(args.profile_file, "w") as f:
                f.write("\n".join(tables))
        else:
            print("\n".join(tables))
    if "prefill" in phases:
        seconds = bench_prefill(runner, args.prefill_batch, args.prefill_len, repeats=3)
        flops = prefill_flops(shape, args.prefill_batch, args.prefill_len)
        achieved = flops / seconds
        result["prefill"] = {"batch": args.prefill_batch, "input_len": args.prefill_len, "seconds": seconds,
                             "tokens_per_s": args.prefill_batch * args.prefill_len / seconds,
                             "flops": flops, "achieved_flops": achieved,
                             "fraction_of_matmul_rate": achieved / result["ceilings"]["matmul_flops"]}
        logger.info("prefill: %s", result["prefill"])
    if "offline" in phases:
        result["offline"] = bench_offline(scheduler, args.num_prompts, args.input_len, args.output_len,
                                          shape["vocab_size"], args.offline_deadline_s, args.seed)
        logger.info("offline: %s", result["offline"])
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - {"graphs_off", "overlap_off"}
    if unknown:
        raise SystemExit(f"unknown --variants {sorted(unknown)}")
    if "overlap_off" in variants:
        result["overlap"] = {"on": bench_offline(scheduler, args.compare_prompts, args.input_len, args.output_len,
                                                 shape["vocab_size"], args.offline_deadline_s, args.seed + 1, tag="c")}
    del runner
    scheduler.forward_stream.shutdown()
    del scheduler
    free_device_memory()
    if "graphs_off" in variants:
        scheduler = build_scheduler(model_dir, shape, args, disable_cuda_graph=True)
        result["graphs_off_decode"] = {}
        for bs in [int(x) for x in args.decode_batch_sizes.split(",")]:
            r = bench_decode(scheduler.worker.model_runner, bs, args.decode_context, args.decode_steps)
            result["graphs_off_decode"][str(bs)] = r
            logger.info("decode without CUDA graphs bs=%d: %s", bs, r)
        scheduler.forward_stream.shutdown()
        del scheduler
        free_device_memory()
    if "overlap_off" in variants:
        scheduler = build_scheduler(model_dir, shape, args, disable_overlap=True)
        result["overlap"]["off"] = bench_offline(scheduler, args.compare_prompts, args.input_len, args.output_len,
                                                 shape["vocab_size"], args.offline_deadline_s, args.seed + 1,
                                                 tag="c")
        logger.info("overlap on/off: %s", result["overlap"])
        scheduler.forward_stream.shutdown()
        del scheduler
        free_device_memory()
    result["total_s"] = time.perf_counter() - t0
    tmp.cleanup()

    table = format_table(result)
    print(table)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2, default=str)
    if args.table_file:
        with open(args.table_file, "w") as f:
            f.write(table + "\n")
    return result


def format_table(r: Dict) -> str:
    gpu = r.get("gpu", {}).get("name", r["device"])
    lines = [f"GPU benchmarks: {r['model']} bf16 random weights ({r.get('weights_GB', 0):.1f} GB) on {gpu}; "
             f"KV pool {r.get('kv_pool_tokens')} tokens; CUDA graphs {'on' if r.get('cuda_graphs') else 'off'}",
             f"| {'measurement':<38} | {'measured':>14} | {'ceiling / floor':>16} | {'ratio':>7} |",
             f"|{'-' * 40}|{'-' * 16}|{'-' * 18}|{'-' * 9}|"]

    def row(name: str, measured: str, ceiling: str = "", ratio: str = "") -> None:
        lines.append(f"| {name:<38} | {measured:>14} | {ceiling:>16} | {ratio:>7} |")

    c = r.get("ceilings")
    if c:
        row("copy bandwidth (read+write)", f"{c['copy_bandwidth_Bps'] / 1e12:.2f} TB/s")
        row(f"bf16 matmul {c['matmul_n']}^3 (random data)", f"{c['matmul_flops'] / 1e12:.0f} TFLOP/s")
    for bs, d in r.get("decode", {}).items():
        row(f"decode step bs={bs} ctx~{d['context_len']} (ms)", f"{d['median_ms']:.2f}",
            f"{d['floor_ms']:.2f} floor", f"{d['floor_over_measured']:.0%}")
    pf = r.get("prefill")
    if pf:
        row(f"prefill {pf['batch']}x{pf['input_len']} (tok/s)", f"{pf['tokens_per_s']:.0f}",
            f"{c['matmul_flops'] / 1e12:.0f} TFLOP/s", f"{pf['fraction_of_matmul_rate']:.0%}")
        row("prefill achieved (TFLOP/s)", f"{pf['achieved_flops'] / 1e12:.0f}")
    off = r.get("offline")
    if off:
        done = f"{off['completed']}/{off['num_prompts']}" + (" (deadline)" if off["timed_out"] else "")
        row(f"offline {done} req, duration (s)", f"{off['duration_s']:.1f}")
        row("offline output throughput (tok/s)", f"{off['output_throughput']:.0f}")
        row("offline total throughput (tok/s)", f"{off['total_throughput']:.0f}")
        row("offline request throughput (req/s)", f"{off['request_throughput']:.2f}")
        if "median_ttft_ms" in off:
            row("offline median TTFT / ITL (ms)", f"{off['median_ttft_ms']:.0f} / {off.get('median_itl_ms', 0):.1f}")
    for bs, d in r.get("graphs_off_decode", {}).items():
        on = r.get("decode", {}).get(bs)
        row(f"decode bs={bs} without CUDA graphs (ms)", f"{d['median_ms']:.2f}",
            f"{on['median_ms']:.2f} with" if on else "", f"{d['median_ms'] / on['median_ms']:.2f}x" if on else "")
    ov = r.get("overlap", {})
    if "on" in ov and "off" in ov:
        n = f"{ov['on']['completed']}/{ov['on']['num_prompts']}"
        row(f"offline {n} req, overlap on (tok/s)", f"{ov['on']['output_throughput']:.0f}")
        row(f"offline {n} req, overlap off (tok/s)", f"{ov['off']['output_throughput']:.0f}", "",
            f"{ov['on']['output_throughput'] / ov['off']['output_throughput']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    main(sys.argv[1:])
