"""Constrained decoding: throughput of JSON-schema requests against the same requests
unconstrained, and grammar compile time (first use and cached).

The scheduler runs in-process (as in bench_offline_throughput, overlap loop on by default). The
constrained run goes first; the free run then asks each request for exactly the number of tokens
its constrained twin produced (ignore_eos), so both runs decode the same tokens and the ratio of
their output throughputs is the cost of the grammar (mask fill, mask application, matcher
advance, delayed sampling under overlap). The two runs alternate `--repeats` times; the table
reports the median of each, and the ratio is the median of the per-repeat ratios (a constrained
run and the free run right after it see about the same machine load).

Examples:
  python benchmarks/bench_grammar.py                        # built-in model, 64 requests
  python benchmarks/bench_grammar.py --model small          # a 141M random Llama (built-in tokenizer)
  python benchmarks/bench_grammar.py --disable-overlap-schedule --any-whitespace
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_models import resolve_model  # noqa: E402
from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput  # noqa: E402
from engine.scheduler.overlap_utils import scheduling_thread  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402

# An extraction-style schema: nested object, bounded strings, numbers, enums, an array.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,10}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "address", "tags", "active"],
    "additionalProperties": False,
}


def _prompts(tokenizer: Any, n: int) -> List[List[int]]:
    return [tokenizer.encode(f"Record {i}: extract the person as JSON.", add_special_tokens=False)
            for i in range(n)]


def _run(scheduler: Scheduler, prompts: List[List[int]], params: List[Dict[str, Any]]) -> Tuple[float, List[int]]:
    """Submit all requests at once; (seconds until the last finishes, output tokens per request)."""
    scheduler.flush_cache()  # no prefix hits carried from the previous run
    start = time.perf_counter()
    for i, (p, sp) in enumerate(zip(prompts, params)):
        scheduler.add_request(TokenizedGenerateReqInput(rid=str(i), input_ids=p, sampling_params=sp))
    lengths = [0] * len(prompts)
    while scheduler.has_work():
        scheduler.step_overlap() if scheduler.enable_overlap else scheduler.step()
        for msg in scheduler.outbox:
            if isinstance(msg, BatchTokenIDOutput):
                for rid, ids in zip(msg.rids, msg.output_ids):
                    lengths[int(rid)] += len(ids)
        scheduler.outbox.clear()
    return time.perf_counter() - start, lengths


def compile_times(scheduler: Scheduler, schema: str) -> Dict[str, float]:
    """Milliseconds: building the backend (tokenizer index), compiling `schema` the first time,
    and a cache hit (what a request with a known schema pays)."""
    from engine.constrained.grammar_manager import create_grammar_backend

    args = scheduler.server_args
    start = time.perf_counter()
    backend, reason = create_grammar_backend("xgrammar", scheduler.tokenizer, scheduler.vocab_size,
                                             sorted(scheduler.eos_token_ids),
                                             any_whitespace=not args.constrained_json_disable_any_whitespace)
    assert backend is not None, reason
    built = time.perf_counter()
    _, future = backend.get_cached_or_future_value(("json_schema", schema))
    entry = future.result()
    backend.set_cache(("json_schema", schema), entry)
    compiled = time.perf_counter()
    cached_runs = []
    for _ in range(100):
        t0 = time.perf_counter()
        hit, _ = backend.get_cached_or_future_value(("json_schema", schema))
        hit.grammar.copy()
        cached_runs.append(time.perf_counter() - t0)
    regex_start = time.perf_counter()
    backend.dispatch_regex(r"[0-9]{3}-[0-9]{4}|[A-Z][a-z]+ [A-Z][a-z]+")
    regex_done = time.perf_counter()
    backend.dispatch_ebnf('root ::= item ("," item)*\nitem ::= [a-z]+ "=" [0-9]+')
    ebnf_done = time.perf_counter()
    backend.shutdown()
    return {
        "backend_init_ms": 1000 * (built - start),
        "json_schema_first_compile_ms": 1000 * (compiled - built),
        "json_schema_cached_ms": 1000 * statistics.median(cached_runs),
        "regex_first_compile_ms": 1000 * (regex_done - regex_start),
        "ebnf_first_compile_ms": 1000 * (ebnf_done - regex_done),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin", help="builtin | tiny | 100m | small | a model directory")
    ap.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's, else the "
                                                      "built-in model's for the random Llamas)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--any-whitespace", action="store_true",
                    help="free whitespace in JSON (the server default); off: compact JSON, as with "
                         "--constrained-json-disable-any-whitespace")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads of the forward (default: torch's); 1 is steadier on a busy machine")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    model_path, _ = resolve_model(args.model, args.dtype)
    tokenizer_path = args.tokenizer
    if tokenizer_path is None and not os.path.exists(os.path.join(model_path, "tokenizer.json")):
        from engine.builtin_model import ensure_builtin_model

        tokenizer_path = ensure_builtin_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
    server_args = ServerArgs(
        model_path=model_path, tokenizer_path=tokenizer_path, device="cpu", dtype=args.dtype,
        max_total_tokens=64 * 1024, max_running_requests=max(64, args.num_prompts), log_level="warning",
        disable_overlap_schedule=args.disable_overlap_schedule,
        constrained_json_disable_any_whitespace=not args.any_whitespace)
    schema = json.dumps(SCHEMA)
    prompts = _prompts(tokenizer, args.num_prompts)
    with scheduling_thread():  # as in the scheduler process
        scheduler = Scheduler(server_args, tokenizer=tokenizer)
        compile_ms = compile_times(scheduler, schema)
        constrained = [{"max_new_tokens": args.max_new_tokens, "temperature": 0.8, "sampling_seed": i,
                        "json_schema": schema} for i in range(len(prompts))]
        _run(scheduler, prompts[:4], constrained[:4])  # warm-up: compile, first forwards
        times: Dict[str, List[float]] = {"constrained": [], "free": []}
        tokens = 0
        valid = 0
        for _ in range(args.repeats):
            seconds, lengths = _run(scheduler, prompts, constrained)
            times["constrained"].append(seconds)
            free = [{"max_new_tokens": n, "temperature": 0.8, "sampling_seed": i, "ignore_eos": True}
                    for i, n in enumerate(lengths)]
            seconds_free, free_lengths = _run(scheduler, prompts, free)
            assert free_lengths == lengths, "the free run must decode exactly the constrained run's tokens"
            times["free"].append(seconds_free)
            tokens = sum(lengths)
        # How many constrained outputs were complete JSON (the rest ran into max_new_tokens).
        valid = sum(1 for n in lengths if n < args.max_new_tokens)
        scheduler.shutdown()

    median = {k: statistics.median(v) for k, v in times.items()}
    throughput = {k: tokens / median[k] for k in median}
    ratio = statistics.median(f / c for c, f in zip(times["constrained"], times["free"]))
    print(f"model={args.model} prompts={len(prompts)} output tokens per run={tokens} "
          f"(complete JSON: {valid}/{len(prompts)}) overlap={not args.disable_overlap_schedule} "
          f"threads={torch.get_num_threads()} repeats={args.repeats}")
    print(f"{'run':<14}{'seconds (median)':>18}{'output tok/s':>14}   all runs (s)")
    for k in ("free", "constrained"):
        print(f"{k:<14}{median[k]:>18.2f}{throughput[k]:>14.1f}   {', '.join(f'{t:.2f}' for t in times[k])}")
    print(f"constrained / free output throughput (median of per-repeat ratios): {ratio:.3f} (target >= 0.85)")
    for key, value in compile_ms.items():
        print(f"{key:<30}{value:>10.3f} ms")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"args": vars(args), "seconds": times, "output_tokens": tokens, "throughput": throughput,
                       "ratio": ratio, "compile_ms": compile_ms}, f, indent=2)


if __name__ == "__main__":
    main()
