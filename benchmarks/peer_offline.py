"""Offline side of the peer benchmark: one system, several workloads, one process.

    python peer_offline.py --system engine|vllm|hf --model DIR --workloads offline_16,shared_prefix

Run by bench_peers.py as a subprocess (vLLM's in its own virtual environment, which is why this file
imports neither the engine nor anything outside the standard library at the top). For each
workload: one short warm-up, then `--reps` timed runs with the prefix cache flushed before each;
the best is kept. Prints one `PEER_RESULT {json}` line per workload.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_workloads import OfflineWorkload, offline_workload  # noqa: E402


def engine_kwargs(flags: str) -> Dict[str, Any]:
    """`--enable-mixed-chunk --chunked-prefill-size 512` -> Engine keyword arguments (typed by ServerArgs)."""
    import dataclasses
    import shlex

    from engine.server_args import ServerArgs

    types = {f.name: f.type for f in dataclasses.fields(ServerArgs)}
    words, kwargs = shlex.split(flags), {}
    i = 0
    while i < len(words):
        name = words[i].lstrip("-").replace("-", "_")
        if types.get(name) in (bool, "bool"):
            kwargs[name], i = True, i + 1
            continue
        value = words[i + 1]
        kind = types.get(name, "str")
        kwargs[name] = int(value) if "int" in str(kind) else float(value) if "float" in str(kind) else value
        i += 2
    return kwargs


class EngineSystem:
    def __init__(self, model: str, kv_tokens: int, max_seqs: int, flags: str = "") -> None:
        from engine import Engine

        self.llm = Engine(model_path=model, dtype="bfloat16", max_total_tokens=kv_tokens, log_level="warning",
                          **engine_kwargs(flags))

    def generate(self, prompts: List[List[int]], output_len: int) -> List[List[int]]:
        sp = dict(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)
        outs = self.llm.generate(input_ids=prompts, sampling_params=[sp] * len(prompts))
        return [o["output_ids"] for o in outs]

    def flush(self) -> None:
        self.llm.flush_cache()

    def close(self) -> None:
        self.llm.shutdown()


class VllmSystem:
    def __init__(self, model: str, kv_tokens: int, max_seqs: int) -> None:
        from vllm import LLM, SamplingParams

        self._params = SamplingParams
        # Same KV size as the engine's pool: bytes = tokens x bytes per token (2 x layers x kv heads
        # x head dim x 2 bytes, given by the caller through kv_tokens * KV_BYTES_PER_TOKEN).
        self.llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, max_num_seqs=max_seqs, seed=0,
                       kv_cache_memory_bytes=kv_tokens * int(os.environ["PEER_KV_BYTES_PER_TOKEN"]),
                       enable_prefix_caching=True)

    def generate(self, prompts: List[List[int]], output_len: int) -> List[List[int]]:
        sp = self._params(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def flush(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        pass


class HfSystem:
    """transformers' generate on static batches; the shared-prefix workload runs one group per call."""

    def __init__(self, model: str, kv_tokens: int, max_seqs: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
        self.max_batch = min(max_seqs, HF_MAX_BATCH)

    def generate(self, prompts: List[List[int]], output_len: int) -> List[List[int]]:
        torch = self.torch
        outs: List[List[int]] = []
        # Runs of equal-length prompts, at most HF_MAX_BATCH per call (no padding needed).
        i = 0
        while i < len(prompts):
            j = i
            while j < len(prompts) and j - i < self.max_batch and len(prompts[j]) == len(prompts[i]):
                j += 1
            ids = torch.tensor(prompts[i:j])
            with torch.inference_mode():
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                          max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0)
            outs.extend(out[:, ids.shape[1]:].tolist())
            i = j
        return outs

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


HF_MAX_BATCH = 64  # a static batch of 64 x 1.1k tokens keeps its KV near 2.5 GB


SYSTEMS: Dict[str, Callable[..., Any]] = {"engine": EngineSystem, "vllm": VllmSystem, "hf": HfSystem}


def run_workload(system: Any, workload: OfflineWorkload, reps: int) -> Dict[str, Any]:
    system.generate([workload.prompts[0][:16]], 4)  # warm-up: first-call costs stay out of the timing
    walls: List[float] = []
    outputs: List[List[int]] = []
    for _ in range(reps):
        system.flush()
        t0 = time.perf_counter()
        outputs = system.generate(workload.prompts, workload.output_len)
        walls.append(time.perf_counter() - t0)
    produced = sum(len(o) for o in outputs)
    if produced != workload.output_tokens:
        raise RuntimeError(f"{workload.name}: {produced} output tokens, expected {workload.output_tokens}")
    return dict(workload=workload.name, wall_s=[round(w, 3) for w in walls], output_tokens=produced,
                out_tok_per_s=round(produced / min(walls), 2), first_output_ids=outputs[0][:8])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workloads", required=True, help="comma-separated names (peer_workloads.offline_workload)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=131072, help="KV pool size in tokens (engine and vLLM)")
    ap.add_argument("--max-seqs", type=int, default=128, help="vLLM max_num_seqs; HF's largest batch")
    ap.add_argument("--engine-args", default="", help="extra engine server flags (engine only)")
    args = ap.parse_args()
    workloads = [offline_workload(name) for name in args.workloads.split(",") if name]
    t0 = time.perf_counter()
    extra = (args.engine_args,) if args.system == "engine" and args.engine_args else ()
    system = SYSTEMS[args.system](args.model, args.kv_tokens, args.max_seqs, *extra)
    print("PEER_READY", json.dumps(dict(system=args.system, init_s=round(time.perf_counter() - t0, 1))), flush=True)
    try:
        for workload in workloads:
            result = run_workload(system, workload, args.reps)
            print("PEER_RESULT", json.dumps(dict(system=args.system, **result)), flush=True)
    finally:
        system.close()


if __name__ == "__main__":
    main()
