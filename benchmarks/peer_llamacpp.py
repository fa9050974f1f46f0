"""Quantized weights against llama.cpp's server (issue 40), side by side in one run.

    python benchmarks/peer_llamacpp.py --llama-bin DIR --convert-python PY --llama-tree TREE \
        --result-file llamacpp.json

The model is bench_peers' `small` Llama (hidden 1024, 8 layers, 16 heads, 8 KV heads, intermediate 2048,
vocab 32000, bfloat16, seed 0). llama.cpp serves it as GGUF files converted from the same checkpoint
(`convert_hf_to_gguf.py` run by --convert-python, which needs llama.cpp's gguf package; its tokenizer is
named "default" because prompts go as token ids: peer_gguf_convert.py), in bf16, Q8_0 (every matrix,
the LM head and the embedding included, in blocks of 32 with an fp16 scale) and Q4_K_M (`llama-quantize`).
The engine serves the bf16 checkpoint as it is, with `--quantization w8a8_int8` (int8 weights, one
scale per output channel; the LM head stays bf16 as in SGLang, or, as `engine-int8-head`, is quantized
too with --quantize-lm-head, as llama.cpp's Q8_0 file quantizes it), and an AWQ checkpoint of the same
weights (4-bit, groups of 128, round to nearest: bench_quant.awq_checkpoint).

Each system is one OpenAI server on 127.0.0.1 at a time (llama.cpp: 16 slots, 512 tokens each, 2 threads
for prompts and generation; the engine: its defaults), driven by bench_peers' client: 128 random token
ids in, 128 out, greedy, EOS ignored, non-streaming /v1/completions, one request at a time (`server_1`)
and 16 at once (`server_16`). Every figure is the best of --reps; --rounds repeats the whole sequence
in the other order. Peak resident memory of each server's process tree is sampled throughout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import bench_peers  # noqa: E402
import bench_serving  # noqa: E402
from peer_procs import TreeMemory, launch  # noqa: E402

logger = logging.getLogger("peer_llamacpp")

# name: (server, weights)
SYSTEMS: Dict[str, Tuple[str, str]] = {
    "engine-bf16": ("engine", "bf16"),
    "engine-int8": ("engine", "int8"),
    "engine-int8-head": ("engine", "int8-head"),
    "engine-int4": ("engine", "int4"),  # float activations: ENGINE_INT4_INT8_ACTIVATIONS=0 (layers/int4.py)
    "engine-int4-a8": ("engine", "int4-a8"),  # int8 activations (the CPU default)
    "engine-int4-a8-head": ("engine", "int4-a8-head"),  # and --quantize-lm-head (an int8 head)
    "llamacpp-bf16": ("llamacpp", "bf16"),
    "llamacpp-q8_0": ("llamacpp", "q8_0"),
    "llamacpp-q4_k_m": ("llamacpp", "q4_k_m"),
}
# The pairs the table compares: (engine system, llama.cpp system).
PAIRS = (("engine-bf16", "llamacpp-bf16"), ("engine-int8", "llamacpp-q8_0"), ("engine-int8-head", "llamacpp-q8_0"),
         ("engine-int4", "llamacpp-q4_k_m"), ("engine-int4-a8", "llamacpp-q4_k_m"),
         ("engine-int4-a8-head", "llamacpp-q4_k_m"))
WORKLOADS = ("server_1", "server_16")
SLOTS, SLOT_CONTEXT = 16, 512


def gguf_file(args: argparse.Namespace, model: str, weights: str) -> str:
    """The GGUF of `weights`, converted (bf16, q8_0) or quantized from the bf16 one (q4_k_m) once."""
    path = os.path.join(args.work_dir, f"small-{weights}.gguf")
    if os.path.exists(path):
        return path
    if weights == "q4_k_m":
        source = gguf_file(args, model, "bf16")
        subprocess.run([os.path.join(args.llama_bin, "llama-quantize"), source, path + ".tmp", "Q4_K_M"],
                       check=True, stdout=subprocess.DEVNULL)
    else:
        subprocess.run([args.convert_python, os.path.join(BENCH_DIR, "peer_gguf_convert.py"), args.llama_tree,
                        model, "--outtype", weights, "--outfile", path + ".tmp"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.replace(path + ".tmp", path)
    return path


def server_command(system: str, args: argparse.Namespace, model: str, port: int) -> List[str]:
    server, weights = SYSTEMS[system]
    if server == "llamacpp":
        return [os.path.join(args.llama_bin, "llama-server"), "-m", gguf_file(args, model, weights),
                "--host", "127.0.0.1", "--port", str(port), "-np", str(SLOTS), "-c", str(SLOTS * SLOT_CONTEXT),
                "--cont-batching", "-t", "2", "-tb", "2", "--alias", bench_peers.SERVED_NAME, *args.llama_args.split()]
    path = model
    extra: List[str] = []
    if weights.startswith("int4"):
        from bench_quant import awq_checkpoint

        path = awq_checkpoint(model)
        extra = ["--quantize-lm-head"] if weights.endswith("-head") else []
    elif weights in ("int8", "int8-head"):
        extra = ["--quantization", "w8a8_int8", *(["--quantize-lm-head"] if weights == "int8-head" else [])]
    return [sys.executable, "-m", "engine.launch_server", "--model-path", path, "--dtype", "bfloat16",
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", bench_peers.SERVED_NAME,
            "--log-level", "warning", *extra]


def run_system(system: str, args: argparse.Namespace, model: str) -> Dict[str, Any]:
    port = bench_serving.find_free_port()
    cmd = server_command(system, args, model, port)
    env = bench_peers.engine_env() if SYSTEMS[system][0] == "engine" else dict(os.environ)
    env["ENGINE_INT4_INT8_ACTIVATIONS"] = str(int(SYSTEMS[system][1].startswith("int4-a8")))
    log_path = os.path.join(args.work_dir, "logs", f"{system}-server.log")
    logger.info("%s: %s", system, " ".join(cmd))
    proc = launch(cmd, env, log_path)
    base_url = f"http://127.0.0.1:{port}"
    results: Dict[str, Any] = {}
    try:
        with TreeMemory(proc.pid) as memory:
            t0 = time.perf_counter()
            bench_serving.wait_for_health(base_url, proc, args.server_timeout)
            results["server_start_s"] = round(time.perf_counter() - t0, 1)
            for name in args.workloads:
                results[name] = bench_peers._server_row(base_url, name, args.reps)
        results["memory_server"] = memory.summary()
    except Exception as exc:  # one system failing must not lose the others' figures
        logger.exception("%s failed (%s); see %s", system, exc, log_path)
    finally:
        bench_serving._stop_server(proc)
    return results


def format_table(report: Dict[str, Any]) -> str:
    results: Dict[str, Dict[str, Any]] = report["results"]

    def tok_s(system: str, workload: str) -> Optional[float]:
        row = results.get(system, {}).get(workload)
        return None if row is None else float(row["out_tok_per_s"])

    lines = ["| system | " + " | ".join(f"{w} tok/s" for w in report["workloads"]) + " | peak RSS GB |",
             "|---|" + "---|" * (len(report["workloads"]) + 1)]
    for system in report["systems"]:
        cells = [f"{v:.1f}" if (v := tok_s(system, w)) is not None else "-" for w in report["workloads"]]
        rss = results.get(system, {}).get("memory_server", {}).get("peak_rss_gb", "-")
        lines.append(f"| {system} | " + " | ".join(cells) + f" | {rss} |")
    lines += ["", "| ratio | " + " | ".join(report["workloads"]) + " |", "|---|" + "---|" * len(report["workloads"])]
    ratios = [*PAIRS, ("engine-int8", "engine-bf16"), ("engine-int8-head", "engine-bf16"), ("engine-int4", "engine-bf16"),
              ("llamacpp-q8_0", "llamacpp-bf16")]
    for a, b in ratios:
        if a not in report["systems"] or b not in report["systems"]:
            continue
        cells = []
        for w in report["workloads"]:
            x, y = tok_s(a, w), tok_s(b, w)
            cells.append(f"{x / y:.2f}x" if x and y else "-")
        lines.append(f"| {a} / {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", required=True, help="the folder holding llama-server and llama-quantize")
    ap.add_argument("--llama-tree", required=True, help="llama.cpp's source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--convert-python", default=sys.executable,
                    help="a python with llama.cpp's gguf package (its gguf-py folder) installed")
    ap.add_argument("--work-dir", default=os.path.expanduser("~/.cache/engine/peers-llamacpp"))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"subset of {','.join(WORKLOADS)}")
    ap.add_argument("--reps", type=int, default=2, help="timed runs per workload (best kept)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat everything, alternating system order")
    ap.add_argument("--llama-args", default="",
                    help="more llama-server arguments, e.g. --no-repack: b11434's AMX kernels stop on an illegal "
                         "instruction on the 2-core Xeon with AMX; without repacking its AVX512-VNNI ones run")
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--result-file", default=None, help="JSON results (the table goes next to it as .md)")
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    bad = [s for s in args.systems if s not in SYSTEMS] + [w for w in args.workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown systems or workloads {bad}")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    os.makedirs(os.path.join(args.work_dir, "logs"), exist_ok=True)
    model = bench_peers.prepare_model(args.work_dir, "small")
    results: Dict[str, Dict[str, Any]] = {s: {} for s in args.systems}
    started = datetime.datetime.now().isoformat(timespec="seconds")
    for round_index in range(args.rounds):
        order = args.systems if round_index % 2 == 0 else list(reversed(args.systems))
        for system in order:
            bench_peers.merge_best(results[system], run_system(system, args, model))
    report = dict(started=started, finished=datetime.datetime.now().isoformat(timespec="seconds"),
                  cpu=bench_peers.cpu_description(), load_average=os.getloadavg(), systems=args.systems,
                  workloads=args.workloads, reps=args.reps, rounds=args.rounds, llama_args=args.llama_args,
                  results=results)
    table = format_table(report)
    print(table)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.splitext(args.result_file)[0] + ".md", "w") as f:
            f.write(table + "\n")
    return report


if __name__ == "__main__":
    main()
