"""Speculative decoding on/off, side by side in one run (issue 36), in-process (no HTTP).

Algorithms (--algorithms, default both):
  NGRAM       drafts from the request's own prompt and output;
  STANDALONE  a draft model made from the target's first --draft-layers layers (its embedding,
              final norm and lm_head too), saved as a model directory of its own.
  STANDALONE_TREE  the same draft with tree drafts: --speculative-eagle-topk --tree-topk and
              --speculative-num-draft-tokens --tree-draft-tokens (SGLang's EAGLE default 4 and 8).

Workloads (greedy, ignore_eos):
  copy    each prompt is a random prompt plus the first --copy-len tokens of the target's own
          greedy continuation of it; the reference output is the rest of that continuation, so
          the text the drafter copies from is the target's own and the output is known exactly.
  random  random prompts: little for the drafter to copy (acceptance is whatever it is).
  copy-N% (--copy-noise N ...) the copy workload with N% of the copied prompt tokens replaced by
          random ones: each replaced token breaks the n-gram match, so acceptance falls with N
          (the sweep behind the plot of speed-up against accept length).

For each algorithm, workload and batch size (--batch-sizes, default 1 and 16) the same requests run
with speculation off (a default server: the overlap loop) and on (the speculating server as users
start it: overlap on too; --no-overlap runs both in the normal loop, the comparison made before
speculation ran overlapped); the table reports output tokens/s, the ratio on/off, the mean accept
length (tokens per request per verify step), the drafter's share of the wall time (NGRAM: drafting
and KV bookkeeping on the scheduling thread; STANDALONE: that plus the draft model's forwards: its
drafts, its catch-up over the tokens decoded plainly and its step after verification), ITL, and
whether every output equals the reference (the run without speculation), and how many verify steps
the measured requests took (the speculation switch decodes plainly where drafts do not pay). --spec-threshold sets
--speculative-batch-size-threshold for the "on" runs (default: the server's default);
--always-speculate sets --disable-speculative-adaptive (every eligible step verifies). Each run
starts with a warm-up request of --warmup-len tokens, whose steps are not measured: the speculation
switch learns its costs there, as a server that has run for a while has.

--verify-cost instead measures what a verify forward costs against a plain decode forward of the
same batch (the fastest of 9 interleaved runs each, a 96-token context): the accept length a verify
step must reach to pay, per batch size, which --speculative-batch-size-threshold's CPU default
comes from.

  python benchmarks/bench_speculative.py                      # builtin model, table + JSON
  python benchmarks/bench_speculative.py --model 100m --out-len 128 --json out.json
  python benchmarks/bench_speculative.py --verify-cost --batch-sizes 1 2 4 8 16 32
  python benchmarks/bench_speculative.py --algorithms NGRAM --copy-noise 5 10 20 40 --plot out.png
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import resolve_model  # noqa: E402
from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput  # noqa: E402
from engine.scheduler.overlap_utils import scheduling_thread  # noqa: E402
from engine.scheduler.scheduler import Scheduler  # noqa: E402
from engine.server_args import ServerArgs  # noqa: E402


@dataclass
class Run:
    outputs: List[List[int]]
    duration: float
    output_tokens: int
    itl: List[float] = field(default_factory=list)
    accept_length: Optional[float] = None
    draft_share: Optional[float] = None
    verify_steps: int = 0  # of the measured requests (the speculation switch may decode plainly)


def run(model_path: str, prompts: List[List[int]], out_len: int, spec: Optional[Dict[str, Any]],
        args: argparse.Namespace) -> Run:
    """`spec`: the speculative ServerArgs of the "on" run, None for "off"."""
    with scheduling_thread():  # as in the scheduler process
        return _run(model_path, prompts, out_len, spec, args)


def spec_args(algo: str, draft_path: str, args: argparse.Namespace) -> Dict[str, Any]:
    common: Dict[str, Any] = {"speculative_algorithm": algo}
    if args.spec_threshold is not None:
        common["speculative_batch_size_threshold"] = args.spec_threshold
    if args.always_speculate:
        common["disable_speculative_adaptive"] = True
    if algo == "NGRAM":
        return dict(common, speculative_num_draft_tokens=args.num_draft_tokens)
    if algo == "STANDALONE_TREE":
        return dict(common, speculative_algorithm="STANDALONE", speculative_draft_model_path=draft_path,
                    speculative_num_steps=args.num_steps, speculative_eagle_topk=args.tree_topk,
                    speculative_num_draft_tokens=args.tree_draft_tokens)
    return dict(common, speculative_draft_model_path=draft_path, speculative_num_steps=args.num_steps)


def layer_draft_dir(model_path: str, layers: int) -> str:
    """A draft model of the target's first `layers` layers (embedding, final norm and lm_head kept),
    written next to the cache of benchmark models once."""
    import shutil

    from safetensors.torch import load_file, save_file

    root = os.environ.get("ENGINE_CACHE_DIR", os.path.expanduser("~/.cache/engine"))
    out = os.path.join(root, "bench-models", f"draft-{layers}l-{os.path.basename(os.path.normpath(model_path))}")
    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    tmp = out + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    weights: Dict[str, Any] = {}
    for name in sorted(os.listdir(model_path)):
        src = os.path.join(model_path, name)
        if name.endswith(".safetensors"):
            weights.update(load_file(src))
        elif name not in ("config.json", "model.safetensors.index.json") and os.path.isfile(src):
            shutil.copy(src, tmp)  # the tokenizer files, generation config
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    with open(os.path.join(model_path, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file({k: v.contiguous() for k, v in keep.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out


def _run(model_path: str, prompts: List[List[int]], out_len: int, spec: Optional[Dict[str, Any]],
         args: argparse.Namespace) -> Run:
    # Both runs as users start them: overlap on unless --no-overlap (the old normal-loop comparison).
    server_args = ServerArgs(model_path=model_path, device="cpu", log_level="warning", dtype=args.dtype,
                             max_total_tokens=args.max_total_tokens, max_running_requests=len(prompts),
                             disable_overlap_schedule=args.no_overlap, chunked_prefill_size=-1, **(spec or {}))
    scheduler = Scheduler(server_args)
    step = scheduler.step_overlap if scheduler.enable_overlap else scheduler.step
    drafting = [0.0]
    if scheduler.spec is not None:
        # Time the scheduling-thread side of each verify step (drafting, slots, acceptance bookkeeping).
        spec_obj = scheduler.spec
        prepare, process = spec_obj.prepare, spec_obj.process

        def timed_prepare(batch, in_flight=False):
            t = time.perf_counter()
            try:
                return prepare(batch, in_flight)
            finally:
                drafting[0] += time.perf_counter() - t

        def timed_process(batch, step):
            t = time.perf_counter()
            try:
                return process(batch, step)
            finally:
                drafting[0] += time.perf_counter() - t

        spec_obj.prepare, spec_obj.process = timed_prepare, timed_process  # type: ignore[method-assign]
    greedy = {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}
    scheduler.add_request(TokenizedGenerateReqInput(rid="warmup", input_ids=prompts[0],
                                                    sampling_params=dict(greedy, max_new_tokens=args.warmup_len)))
    while scheduler.has_work():
        step()
    scheduler.flush_cache()
    scheduler.outbox.clear()
    drafting[0] = 0.0
    if scheduler.spec is not None:
        scheduler.spec.reset_stats()  # count the measured requests only
    outputs: Dict[str, List[int]] = {str(i): [] for i in range(len(prompts))}
    last: Dict[str, float] = {}
    itl: List[float] = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        scheduler.add_request(TokenizedGenerateReqInput(rid=str(i), input_ids=p, stream=True, sampling_params=greedy))
    while scheduler.has_work():
        step()
        now = time.perf_counter()
        for msg in scheduler.outbox:
            if not isinstance(msg, BatchTokenIDOutput):
                continue
            for rid, ids in zip(msg.rids, msg.output_ids):
                if ids and rid in last:
                    itl.extend([(now - last[rid]) / len(ids)] * len(ids))
                if ids:
                    last[rid] = now
                outputs[rid].extend(ids)
        scheduler.outbox.clear()
    duration = time.perf_counter() - start
    state = scheduler.internal_state()
    if scheduler.spec is not None:
        # The draft model's forwards on the forward thread: its drafts, catch-up and after-verify step.
        drafting[0] += scheduler.spec.stats.draft_seconds
    scheduler.shutdown()
    outs = [outputs[str(i)] for i in range(len(prompts))]
    return Run(outs, duration, sum(map(len, outs)), itl, accept_length=state.get("avg_spec_accept_length"),
               draft_share=drafting[0] / duration if scheduler.spec is not None else None,
               verify_steps=int(state.get("spec_verify_ct", 0)))


def workloads(model_path: str, vocab: int, batch: int, args: argparse.Namespace) -> Dict[str, List[List[int]]]:
    rng = random.Random(args.seed + batch)
    bases = [[rng.randrange(10, vocab - 10) for _ in range(args.prompt_len)] for _ in range(batch)]
    # The target's own greedy continuation (speculation off), long enough to copy from and to continue.
    full = run(model_path, bases, args.copy_len + args.out_len, None, args).outputs
    copies = [b + f[:args.copy_len] for b, f in zip(bases, full)]
    out = {"copy": copies}
    for noise in args.copy_noise:
        noisy = [list(c) for c in copies]
        for c in noisy:
            for j in range(args.prompt_len, len(c)):  # the copied part only
                if rng.random() < noise / 100:
                    c[j] = rng.randrange(10, vocab - 10)
        out[f"copy-{noise:g}%"] = noisy
    out["random"] = bases
    return out


def fastest(runs: List[Run]) -> Run:
    """On a shared machine the slower runs measure the neighbours."""
    return min(runs, key=lambda r: r.duration)


def verify_cost(model_path: str, args: argparse.Namespace) -> None:
    """Decode vs TARGET_VERIFY forward times of the same requests (see the module doc)."""
    import torch

    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
    from engine.model_executor.model_runner import ModelRunner

    ctx, drafts = 96, (3, args.num_draft_tokens - 1)
    rows_needed = max(args.batch_sizes)
    server_args = ServerArgs(model_path=model_path, device="cpu", log_level="warning", dtype=args.dtype,
                             max_total_tokens=(rows_needed + 1) * (ctx + 64), max_running_requests=rows_needed)
    config = ModelConfig.from_pretrained(model_path, dtype=args.dtype, device="cpu")
    runner = ModelRunner(config, server_args)
    width = ctx + max(drafts) + 1
    table = runner.req_to_token_pool.req_to_token
    for r in range(1, rows_needed + 1):  # row r owns slots r * width + [0, width): no allocator needed
        table[r, :width] = torch.arange(r * width, (r + 1) * width, dtype=table.dtype)

    def forward(batch: ModelWorkerBatch) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            runner.forward(ForwardBatch.init_new(batch, runner))
        return time.perf_counter() - start

    def batch_of(bs: int, k: int) -> ModelWorkerBatch:
        """k = -1: the prompt's extend; 0: a decode step; k > 0: a verify step with k drafts."""
        rows = list(range(1, bs + 1))
        n = ctx if k < 0 else k + 1
        prefix = 0 if k < 0 else ctx
        slots = torch.cat([torch.arange(r * width + prefix, r * width + prefix + n) for r in rows])
        common = dict(input_ids=torch.full((bs * n,), 5, dtype=torch.int64), req_pool_indices=torch.tensor(rows),
                      seq_lens=torch.full((bs,), prefix + n), seq_lens_cpu=[prefix + n] * bs, out_cache_loc=slots)
        if k == 0:
            return ModelWorkerBatch(forward_mode=ForwardMode.DECODE, **common)
        return ModelWorkerBatch(forward_mode=ForwardMode.EXTEND if k < 0 else ForwardMode.TARGET_VERIFY,
                                extend_num_tokens=bs * n, extend_seq_lens=[n] * bs, extend_prefix_lens=[prefix] * bs,
                                **common)

    rows = []
    for bs in args.batch_sizes:
        forward(batch_of(bs, -1))
        times: Dict[int, List[float]] = {k: [] for k in (0,) + drafts}
        for _ in range(9):
            for k in times:
                times[k].append(forward(batch_of(bs, k)))
        decode = min(times[0])
        ratios = {k: min(times[k]) / decode for k in drafts}
        rows.append({"batch": bs, "decode_ms": 1000 * decode, **{f"verify_{k}_drafts_x": v for k, v in ratios.items()}})
        print(f"bs {bs:3d}  decode {1000 * decode:7.2f} ms  " + "  ".join(
            f"verify with {k} drafts x{v:.2f}" for k, v in ratios.items()), flush=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "verify_cost": rows}, f, indent=2)
    print(f"\nwrote {args.json}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin", help="builtin | tiny | 100m | a model directory")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--copy-len", type=int, default=64)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--algorithms", nargs="+", default=["NGRAM", "STANDALONE", "STANDALONE_TREE"],
                    choices=["NGRAM", "STANDALONE", "STANDALONE_TREE"])
    ap.add_argument("--tree-topk", type=int, default=4, help="STANDALONE_TREE: --speculative-eagle-topk")
    ap.add_argument("--tree-draft-tokens", type=int, default=8, help="STANDALONE_TREE: --speculative-num-draft-tokens")
    ap.add_argument("--num-draft-tokens", type=int, default=12, help="NGRAM")
    ap.add_argument("--num-steps", type=int, default=3, help="STANDALONE (SGLang's default)")
    ap.add_argument("--draft-layers", type=int, default=1, help="STANDALONE: the target's first layers")
    ap.add_argument("--spec-threshold", type=int, default=None, help="--speculative-batch-size-threshold")
    ap.add_argument("--always-speculate", action="store_true", help="--disable-speculative-adaptive")
    ap.add_argument("--warmup-len", type=int, default=32, help="output tokens of each run's warm-up request")
    ap.add_argument("--max-total-tokens", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each configuration; the fastest is kept")
    ap.add_argument("--no-overlap", action="store_true",
                    help="both runs with --disable-overlap-schedule (the comparison before speculation ran overlapped)")
    ap.add_argument("--verify-cost", action="store_true", help="measure verify vs decode forwards only")
    ap.add_argument("--copy-noise", type=float, nargs="*", default=[],
                    help="percentages: copy workloads with that share of the copied tokens randomised")
    ap.add_argument("--plot", default=None, help="write a PNG of speed-up against mean accept length")
    ap.add_argument("--json", default="bench_speculative.json")
    args = ap.parse_args()
    model_path, vocab = resolve_model(args.model, args.dtype)
    if args.verify_cost:
        with scheduling_thread():
            verify_cost(model_path, args)
        return
    uses_draft = {"STANDALONE", "STANDALONE_TREE"} & set(args.algorithms)
    draft_path = layer_draft_dir(model_path, args.draft_layers) if uses_draft else ""
    rows = []
    for batch in args.batch_sizes:
        for name, prompts in workloads(model_path, vocab, batch, args).items():
            # Off and on alternate, so a busy spell of a shared machine hits both alike.
            runs: Dict[str, List[Run]] = {"off": [], **{algo: [] for algo in args.algorithms}}
            for _ in range(args.repeats):
                runs["off"].append(run(model_path, prompts, args.out_len, None, args))
                for algo in args.algorithms:
                    runs[algo].append(run(model_path, prompts, args.out_len, spec_args(algo, draft_path, args), args))
            off = fastest(runs["off"])
            for algo in args.algorithms:
                on = fastest(runs[algo])
                rows.append({
                    "algorithm": algo, "workload": name, "batch": batch,
                    "off_tok_s": off.output_tokens / off.duration, "on_tok_s": on.output_tokens / on.duration,
                    "speedup": (on.output_tokens / on.duration) / (off.output_tokens / off.duration),
                    "accept_length": on.accept_length or 0.0, "draft_share": on.draft_share or 0.0,
                    "verify_steps": on.verify_steps,
                    "off_median_itl_ms": 1000 * statistics.median(off.itl) if off.itl else None,
                    "on_median_itl_ms": 1000 * statistics.median(on.itl) if on.itl else None,
                    "exact": on.outputs == off.outputs,
                })
                r = rows[-1]
                print(f"{algo:<16} {name:<7} bs={batch:<3} off {r['off_tok_s']:8.1f} tok/s  on {r['on_tok_s']:8.1f} "
                      f"tok/s  x{r['speedup']:.2f}  accept {r['accept_length']:.2f}  draft share "
                      f"{100 * r['draft_share']:.1f}%  verify steps {r['verify_steps']}  exact {r['exact']}",
                      flush=True)
    print()
    print(f"{'algorithm':<17}{'workload':<9}{'batch':>6}{'off tok/s':>11}{'on tok/s':>10}{'on/off':>8}"
          f"{'accept':>8}{'draft%':>8}{'ITL off':>9}{'ITL on':>8}{'exact':>7}")
    for r in rows:
        print(f"{r['algorithm']:<17}{r['workload']:<9}{r['batch']:>6}{r['off_tok_s']:>11.1f}{r['on_tok_s']:>10.1f}"
              f"{r['speedup']:>8.2f}{r['accept_length']:>8.2f}{100 * r['draft_share']:>8.1f}"
              f"{r['off_median_itl_ms']:>9.2f}{r['on_median_itl_ms']:>8.2f}{str(r['exact']):>7}")
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    print(f"\nwrote {args.json}")
    if args.plot:
        plot(rows, args.plot)


def plot(rows: List[Dict[str, Any]], path: str) -> None:
    """Speed-up (on/off output tokens/s) against mean accept length, a series per algorithm and batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, batch in sorted({(r["algorithm"], r["batch"]) for r in rows}):
        pts = sorted((r["accept_length"], r["speedup"]) for r in rows if (r["algorithm"], r["batch"]) == (algo, batch))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="none", label=f"{algo}, batch {batch}")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("mean accept length (tokens per request per verify step)")
    ax.set_ylabel("output tokens/s, speculation on / off")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
