"""The Sampler's time per decode step, for the sampling settings users send, on a 32k vocabulary.

Greedy decoding never reaches the filtering and noise of the sampler, so no throughput benchmark
of ours sees them; a user who sends temperature 0.7 and top_p 0.9 does, every step. For batch
sizes 16 and 64 and two kinds of logits:

  peaky  like a trained language model: a few dozen likely tokens over a flat tail (the nucleus of
         top_p 0.9 has tens of tokens), so top-k / top-p rows are settled among the candidates
  flat   like a random-weight model: the nucleus spans most of the vocabulary (the full sort)

it times Sampler() on the same logits, best of --repeats, and prints ms per call.

  python benchmarks/bench_sampler.py
  python benchmarks/bench_sampler.py --batch-sizes 16 64 --vocab 32000 --result-file sampler.json
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import torch

from engine.layers.logits_processor import LogitsProcessorOutput
from engine.layers.sampler import Sampler
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams

SETTINGS = {
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 40": dict(temperature=0.7, top_k=40),
    "temperature 0.7": dict(temperature=0.7),
    "temperature 0.7, top_p 0.9, seeded": dict(temperature=0.7, top_p=0.9, sampling_seed=7),
    "greedy": dict(temperature=0.0),
}


class _Req:
    """What SamplingBatchInfo.from_reqs reads of a request."""

    def __init__(self, params: Dict) -> None:
        self.sampling_params = SamplingParams(**params)
        self.sampling_params.verify()
        self.sampling_params.normalize()
        self.origin_input_ids: List[int] = [1, 2, 3]
        self.output_ids: List[int] = []
        self.eos_token_ids: set = set()
        self.custom_logit_processor = None


def make_logits(bs: int, vocab: int, kind: str, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "flat":
        return torch.randn(bs, vocab, generator=gen) * 0.3
    logits = torch.randn(bs, vocab, generator=gen)
    head = torch.randint(0, vocab, (bs, 40), generator=gen)
    return logits.scatter_add_(1, head, torch.rand(bs, 40, generator=gen) * 8 + 4)


def time_sampler(bs: int, vocab: int, kind: str, params: Dict, repeats: int) -> float:
    info = SamplingBatchInfo.from_reqs([_Req(params) for _ in range(bs)], vocab, "cpu")
    logits = make_logits(bs, vocab, kind)
    sampler = Sampler()
    best = float("inf")
    for i in range(repeats + 2):
        out = LogitsProcessorOutput(next_token_logits=logits.clone())
        t = time.perf_counter()
        sampler(out, info, False, None)
        if i >= 2:  # warm-up
            best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    rows = []
    print(f"Sampler, ms per call (best of {args.repeats}), vocabulary {args.vocab}, "
          f"{torch.get_num_threads()} threads")
    print(f"| batch | logits | {' | '.join(SETTINGS)} |")
    print("|---|---|" + "---|" * len(SETTINGS))
    for bs in args.batch_sizes:
        for kind in ("peaky", "flat"):
            ms = {name: time_sampler(bs, args.vocab, kind, params, args.repeats) for name, params in SETTINGS.items()}
            rows.append({"batch": bs, "logits": kind, "ms": ms})
            print(f"| {bs} | {kind} | " + " | ".join(f"{v:.2f}" for v in ms.values()) + " |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({"vocab": args.vocab, "threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
