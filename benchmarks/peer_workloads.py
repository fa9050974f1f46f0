"""The workloads of the peer benchmark (bench_peers.py), shared by every system it measures.

Standard library only: this module is imported by the offline runner inside vLLM's own virtual
environment as well, so every system draws exactly the same prompts. Prompts are token-id lists
(random ids in [3, 32000), away from the special ids 0-2); outputs are greedy, EOS ignored, and
every request generates exactly its `output_len` tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List

VOCAB_SIZE = 32000
FIRST_ID = 3  # <unk>, <s>, </s> come before it


@dataclass
class OfflineWorkload:
    """Prompts submitted all at once to an offline API; tok/s = output tokens / wall time."""

    name: str
    prompts: List[List[int]]
    output_len: int
    description: str

    @property
    def output_tokens(self) -> int:
        return self.output_len * len(self.prompts)


def _ids(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(FIRST_ID, VOCAB_SIZE) for _ in range(n)]


def random_batch(batch: int, input_len: int = 128, output_len: int = 128, seed: int = 1234) -> OfflineWorkload:
    """`batch` prompts of `input_len` random ids; batch b is a prefix of batch b' > b (same seed)."""
    rng = random.Random(seed)
    prompts = [_ids(rng, input_len) for _ in range(batch)]
    return OfflineWorkload(f"offline_{batch}", prompts, output_len,
                           f"offline, {batch} x {input_len} in / {output_len} out")


def shared_prefix(groups: int = 8, per_group: int = 16, system_len: int = 1024, question_len: int = 64,
                  output_len: int = 64, seed: int = 7) -> OfflineWorkload:
    """`groups` system prompts, each followed by `per_group` different questions; grouped in order."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        system = _ids(rng, system_len)
        for _ in range(per_group):
            prompts.append(system + _ids(rng, question_len))
    name = "shared_prefix" if system_len == 1024 else f"prefix_{system_len}"
    return OfflineWorkload(name, prompts, output_len,
                           f"shared prefix, {groups} groups x {per_group}, {system_len}-token system prompt "
                           f"+ {question_len}-token question, {output_len} out")


def offline_workload(name: str) -> OfflineWorkload:
    """`offline_<B>` (B x 128/128), `shared_prefix`, or `prefix_<L>` (the shared-prefix workload with
    an L-token system prompt, for the sweep of the plot)."""
    if name.startswith("offline_"):
        return random_batch(int(name.split("_", 1)[1]))
    if name == "shared_prefix":
        return shared_prefix()
    if name.startswith("prefix_"):
        return shared_prefix(system_len=int(name.split("_", 1)[1]))
    raise ValueError(f"unknown offline workload {name!r}")


# Server workloads (run against each system's OpenAI-compatible server by bench_peers.py).
@dataclass
class ServerWorkload:
    name: str
    num_prompts: int
    concurrency: int  # 0: Poisson arrivals at request_rate, no cap
    stream: bool
    description: str
    request_rate: float = float("inf")


SERVER_WORKLOADS: Dict[str, ServerWorkload] = {
    "server_16": ServerWorkload("server_16", 16, 16, False,
                                "OpenAI server, 16 concurrent /v1/completions, 128 in / 128 out"),
    "server_1": ServerWorkload("server_1", 4, 1, False, "OpenAI server, 1 at a time (4 requests), 128 / 128"),
    "stream_64": ServerWorkload("stream_64", 64, 64, True, "streaming, 64 concurrent streams, 128 / 128"),
    "poisson": ServerWorkload("poisson", 120, 0, True,
                              "Poisson 4 req/s, 120 random prompts of 384-640 tokens, 96-160 out, streaming",
                              request_rate=4.0),
}

# The Poisson workload's lengths in SGLang's random-dataset terms: uniform in [len * ratio, len].
POISSON_INPUT_LEN, POISSON_OUTPUT_LEN, POISSON_RANGE_RATIO = 640, 160, 0.6
