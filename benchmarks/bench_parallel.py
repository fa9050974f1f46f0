"""Tensor and data parallelism, side by side on this machine.

1. TP: one static batch (prefill, then greedy decode steps) through ModelRunner at tp=1 and tp=2,
   each rank in its own spawned process (gloo on the CPU). Reports the median decode step and
   prefill time and, for tp=2, the time per step spent inside the model's collectives
   (all-reduce after every row-parallel layer, all-gather of the logits). CPU threads: tp=1 gets
   every core, each tp=2 rank gets half of them (what the server does).
2. DP: bench_serving's CLI against a launched server at --dp-size 1 and 2, N concurrent requests.

    python benchmarks/bench_parallel.py --result-file bench_results/parallel.json

On a 2-core CPU expect tp=2 to be slower than tp=1 (the same FLOPs on the same cores, plus two
all-reduces per layer); TP pays off when each rank has its own device or socket.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Dict

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

RANDOM_LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                    num_key_value_heads=8, vocab_size=32000)


def build_model(out_dir: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**RANDOM_LLAMA, max_position_embeddings=4096, tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out_dir)
    return out_dir


def _tp_rank(rank: int, tp: int, port: int, threads: int, args: Dict[str, Any], queue: Any) -> None:
    try:
        torch.set_num_threads(threads)
        from bench_one_batch import OneBatch

        from engine.configs.model_config import ModelConfig
        from engine.distributed import parallel_state as ps
        from engine.model_executor.model_runner import ModelRunner
        from engine.server_args import ServerArgs

        ps.init_distributed_environment(rank, tp, f"tcp://127.0.0.1:{port}", "cpu")
        server_args = ServerArgs(model_path=args["model"], dtype="float32", device="cpu", tp_size=tp,
                                 max_total_tokens=args["batch_size"] * (args["input_len"] + args["output_len"]) + 64,
                                 max_running_requests=args["batch_size"] + 1)
        config = ModelConfig.from_pretrained(args["model"], dtype="float32", device="cpu")
        runner = ModelRunner(config, server_args, tp_rank=rank, tp_size=tp)
        gen = torch.Generator().manual_seed(1)
        input_ids = torch.randint(0, RANDOM_LLAMA["vocab_size"], (args["batch_size"], args["input_len"]), generator=gen)
        result: Dict[str, Any] = {}
        for attempt in ("warmup", "measured"):
            driver = OneBatch(runner)
            ps.comm_stats.reset()
            t0 = time.perf_counter()
            tokens = driver.prefill(input_ids)
            prefill_s = time.perf_counter() - t0
            prefill_comm = ps.comm_stats.seconds
            steps, comms = [], []
            outputs = [tokens.tolist()]
            for _ in range(args["output_len"]):
                ps.comm_stats.reset()
                t = time.perf_counter()
                tokens = driver.decode(tokens)
                steps.append(time.perf_counter() - t)
                comms.append(ps.comm_stats.seconds)
                outputs.append(tokens.tolist())
            driver.release()
            result = dict(prefill_s=prefill_s, prefill_comm_s=prefill_comm,
                          decode_step_s=statistics.median(steps), decode_comm_s=statistics.median(comms),
                          comm_calls_per_step=ps.comm_stats.calls, output_ids=outputs)
        if rank == 0:
            queue.put(("ok", result))
        ps.destroy_distributed_environment()
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def run_tp(tp: int, threads: int, args: Dict[str, Any]) -> Dict[str, Any]:
    from engine.utils.network_utils import get_free_port

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = get_free_port()
    procs = [ctx.Process(target=_tp_rank, args=(r, tp, port, threads, args, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        status, payload = queue.get()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(f"tp={tp} failed:\n{payload}")
    return payload


def run_dp(dp: int, args: argparse.Namespace) -> Dict[str, Any]:
    import bench_serving

    server_args = f"--device cpu --dp-size {dp} --max-total-tokens 65536 --log-level warning"
    argv = ["--launch-server", "--server-args", server_args, "--dataset", "random", "--num-prompts",
            str(args.dp_requests), "--max-concurrency", str(args.dp_requests), "--random-input-len",
            str(args.dp_input_len), "--random-output-len", str(args.dp_output_len), "--disable-tqdm"]
    return bench_serving.main(argv)["metrics"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dp-requests", type=int, default=64)
    ap.add_argument("--dp-input-len", type=int, default=128)
    ap.add_argument("--dp-output-len", type=int, default=64)
    ap.add_argument("--skip-dp", action="store_true")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    report: Dict[str, Any] = {"cores": cores, "model": RANDOM_LLAMA}

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(tmp)
        common = dict(model=model, batch_size=args.batch_size, input_len=args.input_len, output_len=args.output_len)
        tp1 = run_tp(1, cores, common)
        # The same single rank on one thread: what each tp=2 rank has, without the split.
        tp1_1t = run_tp(1, 1, common)
        tp2 = run_tp(2, max(1, cores // 2), common)
    same = tp1.pop("output_ids") == tp2.pop("output_ids") == tp1_1t.pop("output_ids")
    report["tp"] = {"tp1": tp1, "tp1_1thread": tp1_1t, "tp2": tp2, "greedy_outputs_equal": same}
    print(f"\nTP on {cores} CPU cores, random Llama {RANDOM_LLAMA['hidden_size']}h x "
          f"{RANDOM_LLAMA['num_hidden_layers']}L, batch {args.batch_size}, input {args.input_len}, float32")
    print(f"{'':24}{f'tp=1 ({cores}t)':>12}{'tp=1 (1t)':>12}{'tp=2 (1t)':>12}{'tp2/tp1':>10}")
    for key, label in (("prefill_s", "prefill (s)"), ("decode_step_s", "decode step (ms)")):
        scale = 1000 if "decode" in key else 1
        print(f"{label:24}{tp1[key] * scale:12.2f}{tp1_1t[key] * scale:12.2f}{tp2[key] * scale:12.2f}"
              f"{tp2[key] / tp1[key]:10.2f}")
    print(f"{'decode comm / step (ms)':24}{'-':>12}{'-':>12}{tp2['decode_comm_s'] * 1000:12.2f}"
          f"{'':10}  ({tp2['decode_comm_s'] / tp2['decode_step_s']:.0%} of the step, "
          f"{tp2['comm_calls_per_step']} collectives; includes waiting for the slower rank)")
    print(f"{'prefill comm (s)':24}{'-':>12}{'-':>12}{tp2['prefill_comm_s']:12.2f}")
    print(f"greedy outputs equal: {same}")

    if not args.skip_dp:
        dp = {f"dp{n}": run_dp(n, args) for n in (1, 2)}
        report["dp"] = dp
        print(f"\nDP, built-in model, {args.dp_requests} concurrent requests "
              f"(input {args.dp_input_len}, output {args.dp_output_len})")
        print(f"{'':28}{'dp=1':>12}{'dp=2':>12}{'dp2/dp1':>10}")
        for key in ("request_throughput", "output_throughput", "median_ttft_ms", "median_tpot_ms",
                    "median_e2e_latency_ms"):
            a, b = dp["dp1"][key], dp["dp2"][key]
            print(f"{key:28}{a:12.2f}{b:12.2f}{b / a if a else float('nan'):10.2f}")

    if args.result_file:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_file)), exist_ok=True)
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
