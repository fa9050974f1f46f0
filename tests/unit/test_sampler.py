"""Sampler: greedy, masks, seeded reproducibility, distributions and logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Set

import pytest
import torch

from engine.layers.logits_processor import LogitsProcessorOutput
from engine.layers.sampler import Sampler, seeded_exponential, top_k_top_p_min_p_renorm
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams

VOCAB = 64


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: List[int] = field(default_factory=list)
    output_ids: List[int] = field(default_factory=list)
    eos_token_ids: Set[int] = field(default_factory=set)
    custom_logit_processor: Optional[str] = None


def make_req(output=(), **params) -> FakeReq:
    sp = SamplingParams(**params)
    sp.verify()
    sp.normalize()
    return FakeReq(sp, [1, 2, 3], list(output))


def run(
    reqs: List[FakeReq],
    logits: torch.Tensor,
    vocab: int = VOCAB,
    return_logprob: bool = False,
    top_logprobs_nums: Optional[List[int]] = None,
    info: Optional[SamplingBatchInfo] = None,
):
    info = info or SamplingBatchInfo.from_reqs(reqs, vocab, "cpu")
    out = LogitsProcessorOutput(next_token_logits=logits.clone())
    ids = Sampler()(out, info, return_logprob, top_logprobs_nums)
    return ids, out, info


def fixed_logits(bs: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(bs, vocab, generator=gen) * 2


def test_greedy_is_argmax_and_uses_fast_path() -> None:
    logits = fixed_logits(5)
    reqs = [make_req(temperature=0.0) for _ in range(5)]
    ids, _, info = run(reqs, logits)
    assert info.is_all_greedy
    assert ids.tolist() == logits.argmax(-1).tolist()
    assert ids.dtype == torch.int64


def test_top_k_one_equals_greedy_at_any_temperature() -> None:
    logits = fixed_logits(4, seed=1)
    ids, _, _ = run([make_req(top_k=1, temperature=5.0) for _ in range(4)], logits)
    assert ids.tolist() == logits.argmax(-1).tolist()


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = fixed_logits(6, seed=2)
    reqs = [make_req(temperature=0.0 if i % 2 == 0 else 1.5) for i in range(6)]
    for trial in range(5):
        torch.manual_seed(trial)
        ids, _, info = run(reqs, logits)
        assert not info.is_all_greedy
        assert ids[0::2].tolist() == logits.argmax(-1)[0::2].tolist()


PROBS = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


def masks(top_k: int = 4, top_p: float = 1.0, min_p: float = 0.0, probs: torch.Tensor = PROBS) -> List[float]:
    bs = probs.shape[0]
    out = top_k_top_p_min_p_renorm(
        probs.clone(),
        torch.full((bs,), top_k, dtype=torch.int64),
        torch.full((bs,), top_p),
        torch.full((bs,), min_p),
    )
    return [round(v, 6) for v in out[0].tolist()]


def test_top_p_mask_exact() -> None:
    assert masks(top_p=0.8) == [0.625, 0.375, 0.0, 0.0]  # 0.5 + 0.3 reaches 0.8: two tokens
    assert masks(top_p=0.81) == [round(0.5 / 0.95, 6), round(0.3 / 0.95, 6), round(0.15 / 0.95, 6), 0.0]
    assert masks(top_p=0.5) == [1.0, 0.0, 0.0, 0.0]
    assert masks(top_p=0.1) == [1.0, 0.0, 0.0, 0.0]  # the top token always survives
    assert masks(top_p=1.0) == [0.5, 0.3, 0.15, 0.05]


def test_top_k_and_min_p_masks_exact() -> None:
    assert masks(top_k=2) == [0.625, 0.375, 0.0, 0.0]
    assert masks(top_k=3) == [round(0.5 / 0.95, 6), round(0.3 / 0.95, 6), round(0.15 / 0.95, 6), 0.0]
    # min_p 0.2 keeps p >= 0.1; min_p 0.7 keeps p >= 0.35
    assert masks(min_p=0.2) == [round(0.5 / 0.95, 6), round(0.3 / 0.95, 6), round(0.15 / 0.95, 6), 0.0]
    assert masks(min_p=0.7) == [1.0, 0.0, 0.0, 0.0]


def test_top_p_applies_to_top_k_renormalised_distribution() -> None:
    # After top-k 2 the mass is [0.625, 0.375]: top_p 0.6 is reached by the first token alone
    # (on the raw distribution 0.5 < 0.6 would have kept two).
    assert masks(top_k=2, top_p=0.6) == [1.0, 0.0, 0.0, 0.0]
    assert masks(top_k=4, top_p=0.6) == [0.625, 0.375, 0.0, 0.0]


def test_masks_are_per_row() -> None:
    probs = PROBS.repeat(3, 1)
    out = top_k_top_p_min_p_renorm(
        probs, torch.tensor([1, 4, 4]), torch.tensor([1.0, 0.8, 1.0]), torch.tensor([0.0, 0.0, 0.2])
    )
    assert (out > 0).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, True, True, False],
    ]


def _empirical(ids: torch.Tensor, vocab: int) -> List[float]:
    return (torch.bincount(ids, minlength=vocab).float() / ids.numel()).tolist()


def test_sampling_frequencies_follow_masked_distribution() -> None:
    n = 10000
    logits = PROBS.log().repeat(n, 1)
    torch.manual_seed(0)
    ids, _, _ = run([make_req(top_p=0.8)] * n, logits, vocab=4)
    freq = _empirical(ids, 4)
    assert freq[2] == 0.0 and freq[3] == 0.0
    assert abs(freq[0] - 0.625) < 0.02 and abs(freq[1] - 0.375) < 0.02

    # temperature 2 flattens: p ~ sqrt(probs)
    ids, _, _ = run([make_req(temperature=2.0)] * n, logits, vocab=4)
    expected = PROBS[0].sqrt() / PROBS[0].sqrt().sum()
    for got, want in zip(_empirical(ids, 4), expected.tolist()):
        assert abs(got - want) < 0.02


def test_seeded_noise_is_unbiased_across_seeds() -> None:
    n = 10000
    logits = PROBS.log().repeat(n, 1)
    reqs = [make_req(sampling_seed=s) for s in range(n)]
    ids, _, _ = run(reqs, logits, vocab=4)
    for got, want in zip(_empirical(ids, 4), PROBS[0].tolist()):
        assert abs(got - want) < 0.02
    noise = seeded_exponential(torch.arange(4), torch.zeros(4, dtype=torch.int64), 50000)
    assert abs(noise.mean().item() - 1.0) < 0.02 and (noise > 0).all()


def _decode_loop(reqs: List[FakeReq], steps: int, logits_seed: int = 7) -> List[List[int]]:
    """Sample `steps` tokens per request; the logits depend only on (request, step)."""
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu")
    out: List[List[int]] = [[] for _ in reqs]
    for step in range(steps):
        logits = torch.stack([fixed_logits(1, seed=logits_seed + step)[0] for _ in reqs]) * 0.2
        ids, _, _ = run(reqs, logits, info=info)
        for row, token in enumerate(ids.tolist()):
            out[row].append(token)
    return out


def test_seeded_sampling_reproducible_and_independent_of_batch() -> None:
    alone = _decode_loop([make_req(sampling_seed=1234, temperature=1.0)], 6)[0]
    torch.manual_seed(99)  # a different global RNG state must not matter
    crowd = [make_req(temperature=1.3), make_req(sampling_seed=5), make_req(sampling_seed=1234), make_req(top_k=5)]
    in_batch = _decode_loop(crowd, 6)
    assert in_batch[2] == alone
    other_seed = _decode_loop([make_req(sampling_seed=1235)], 6)[0]
    assert other_seed != alone  # flat logits over 64 tokens: a 6-token collision is ~impossible


def test_seeded_sampling_survives_retraction_rebuild() -> None:
    full = _decode_loop([make_req(sampling_seed=77, frequency_penalty=0.5)], 5)[0]
    # Rebuild after 3 tokens (as after retraction) and continue with the same per-step logits.
    req = make_req(sampling_seed=77, frequency_penalty=0.5, output=full[:3])
    info = SamplingBatchInfo.from_reqs([req], VOCAB, "cpu")
    rest = []
    for step in (3, 4):
        ids, _, _ = run([req], fixed_logits(1, seed=7 + step) * 0.2, info=info)
        rest.append(ids.item())
    assert full[3:] == rest


def test_logprobs_are_log_softmax_of_penalised_untempered_logits() -> None:
    logits = fixed_logits(3, seed=4)
    reqs = [
        make_req(temperature=0.0, frequency_penalty=1.0, output=[int(logits[0].argmax())]),
        make_req(temperature=0.5),
        make_req(temperature=2.0, logit_bias={"3": 5.0}),
    ]
    ids, out, _ = run(reqs, logits, return_logprob=True, top_logprobs_nums=[0, 3, 1])
    penalised = logits.clone()
    penalised[0, reqs[0].output_ids[0]] -= 1.0
    penalised[2, 3] += 5.0
    reference = torch.log_softmax(penalised, dim=-1)
    assert ids[0].item() == int(penalised[0].argmax())  # the penalty moved the greedy choice
    torch.testing.assert_close(out.next_token_logprobs, reference.gather(1, ids.view(-1, 1)).view(-1))
    assert out.next_token_top_logprobs_val[0] == [] and out.next_token_top_logprobs_idx[0] == []
    top3 = reference[1].topk(3)
    assert out.next_token_top_logprobs_idx[1] == top3.indices.tolist()
    assert out.next_token_top_logprobs_val[1] == pytest.approx(top3.values.tolist())
    assert out.next_token_top_logprobs_idx[2] == [int(reference[2].argmax())]
    assert all(math.isfinite(v) for v in out.next_token_top_logprobs_val[1])


def test_no_logprobs_leaves_fields_empty() -> None:
    _, out, _ = run([make_req()], fixed_logits(1))
    assert out.next_token_logprobs is None and out.next_token_top_logprobs_val is None


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(2, VOCAB + 8)
    logits[:, VOCAB:] = 100.0  # padding of the LM head must not win
    ids, _, _ = run([make_req(temperature=0.0), make_req()], logits)
    assert (ids < VOCAB).all()


def test_min_new_tokens_blocks_eos_in_sampler() -> None:
    logits = torch.full((1, VOCAB), -10.0)
    logits[0, 0] = 10.0  # EOS overwhelmingly likely
    req = make_req(min_new_tokens=2, temperature=0.0)
    req.eos_token_ids = {0}
    info = SamplingBatchInfo.from_reqs([req], VOCAB, "cpu")
    got = [run([req], logits, info=info)[0].item() for _ in range(3)]
    assert got[0] != 0 and got[1] != 0 and got[2] == 0
    assert info.output_lens.tolist() == [3]


def test_empty_batch() -> None:
    ids, out, _ = run([], torch.zeros(0, VOCAB), return_logprob=True, top_logprobs_nums=[])
    assert ids.shape == (0,) and out.next_token_top_logprobs_val == []


def test_seeded_noise_is_never_zero_so_masked_tokens_are_never_drawn() -> None:
    """Seed 388's first-step noise at token 15577 was 0 when the uniform took 24 bits (the top
    value rounded to 1.0): a token a grammar had masked out (p = 0) gave 0/0 = NaN, which argmax
    picked; with p > 0 it gave inf and won whatever its probability."""
    vocab = 16000
    noise = seeded_exponential(torch.tensor([388]), torch.zeros(1, dtype=torch.int64), vocab)
    assert (noise > 0).all() and torch.isfinite(noise).all()
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, 3] = 0.5  # the only token the mask allows
    ids, _, _ = run([make_req(sampling_seed=388, temperature=1.0)], logits, vocab=vocab)
    assert ids.tolist() == [3]


def test_vocab_mask_is_respected_by_greedy_and_sampling() -> None:
    from engine.constrained.vocab_mask import allocate_vocab_mask

    logits = fixed_logits(4, seed=5)
    reqs = [make_req(temperature=0.0), make_req(temperature=1.3), make_req(sampling_seed=9), make_req(top_p=0.5)]
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu")
    info.vocab_mask = allocate_vocab_mask(4, VOCAB)
    info.vocab_mask[:, :] = 0
    info.vocab_mask[:, 1] = 0b101  # tokens 32 and 34 only
    for trial in range(20):
        torch.manual_seed(trial)
        ids, _, _ = run(reqs, logits, info=info)
        assert set(ids.tolist()) <= {32, 34}


BIG_VOCAB = 4000  # past TOP_CANDIDATES: top-k / top-p rows can be settled among their candidates


def _peaky_logits(bs: int, seed: int) -> torch.Tensor:
    """Language-model-like rows: a few dozen likely tokens over a long flat tail (so the nucleus of
    top_p 0.9 lies within the candidates), and two flat rows (it does not)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(bs, BIG_VOCAB, generator=gen)
    head = torch.randint(0, BIG_VOCAB, (bs, 40), generator=gen)
    logits.scatter_add_(1, head, torch.rand(bs, 40, generator=gen) * 8 + 4)
    logits[-2:] = torch.randn(2, BIG_VOCAB, generator=gen) * 0.1
    return logits


# Two cases in the fast lane, every case in the full suite (each samples 48 rows of a big vocabulary).
@pytest.mark.parametrize("params", [
    dict(top_p=0.9), dict(top_k=50), *(pytest.param(p, marks=pytest.mark.slow) for p in (
        dict(top_k=50, top_p=0.8), dict(top_p=0.95, min_p=0.05), dict(top_k=300), dict(top_p=1.0),
        dict(top_k=BIG_VOCAB - 1, top_p=0.9))),
])
def test_candidate_sampling_draws_what_the_full_sort_draws(monkeypatch, params) -> None:
    """The partial-sort path keeps the same tokens with the same probabilities as sorting the whole
    vocabulary, and a seeded row's noise depends only on (seed, step, token): so every seeded row
    draws the very same token on both paths (rows the candidates cannot settle take the full path)."""
    import engine.layers.sampler as sampler_module

    bs = 48
    # Each batch mixes the case under test with rows that need the full path (no filter at all).
    reqs = [make_req(sampling_seed=1000 + i, temperature=0.8, **(params if i % 4 else {}))
            for i in range(bs)]
    for step in range(3):
        logits = _peaky_logits(bs, seed=step)
        info = SamplingBatchInfo.from_reqs(reqs, BIG_VOCAB, "cpu")
        fast, _, _ = run(reqs, logits, vocab=BIG_VOCAB, info=info)
        monkeypatch.setattr(sampler_module, "TOP_CANDIDATES", BIG_VOCAB)  # the full sort for every row
        full, _, _ = run(reqs, logits, vocab=BIG_VOCAB, info=SamplingBatchInfo.from_reqs(reqs, BIG_VOCAB, "cpu"))
        monkeypatch.undo()
        assert fast.tolist() == full.tolist()
        for r in reqs:
            r.output_ids.append(0)  # the next step draws new noise


def test_candidate_sampling_frequencies_follow_the_nucleus() -> None:
    """Unseeded rows on the candidate path: only nucleus tokens are drawn, in proportion."""
    logits = torch.full((1, BIG_VOCAB), -10.0)
    logits[0, [7, 300, 2500]] = torch.tensor([2.0, 1.0, 0.0])
    n = 6000
    torch.manual_seed(0)
    ids, _, _ = run([make_req(top_p=0.7)] * n, logits.repeat(n, 1), vocab=BIG_VOCAB)
    counts = torch.bincount(ids, minlength=BIG_VOCAB)
    p = torch.softmax(torch.tensor([2.0, 1.0]), 0)  # 0.73 + 0.27: token 2500 is outside top_p 0.7
    assert set(ids.unique().tolist()) == {7, 300}
    assert abs(counts[7].item() / n - p[0].item()) < 0.02
