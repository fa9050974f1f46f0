"""Sampler: logits -> next token ids, with penalties, temperature, top-k/top-p/min-p, seeds and logprobs.

Unseeded rows draw by inverse CDF: one uniform number per row against the cumulative filtered
distribution. Seeded rows run the exponential race (argmax of p_i / E_i with E_i ~ Exp(1) picks i
with probability p_i) with noise from a counter-based hash of (seed, step, token id), so a seeded
request draws the same tokens whatever else is in the batch, after retraction, and on any device.
Neither needs a device sync. On the CPU, top-k / top-p rows are filtered and drawn among their
TOP_CANDIDATES most likely tokens (a partial sort) when their kept set lies within them; the other
rows sort the whole vocabulary.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch
from torch import nn

from engine.kernels import ops as kernel_ops
from engine.layers.logits_processor import LogitsProcessorOutput
from engine.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

# Tolerance of the top-p boundary: a prefix whose mass reaches top_p up to float32 rounding
# (0.5 + 0.3 vs 0.8) counts as reaching it, so hand-computed examples give the expected set.
TOP_P_EPS = 1e-6
# Top-k / top-p rows are filtered and sampled among their most likely tokens, found by a partial
# sort, when their kept set lies within them (a language model's nucleus usually does): sorting
# the whole vocabulary and drawing noise for all of it took 24 ms a step at 16 rows of a 32k
# vocabulary on a 2-core CPU, twice the model's forward. Other rows take the full path.
TOP_CANDIDATES = 256


class Sampler(nn.Module):
    def forward(
        self,
        logits_output: LogitsProcessorOutput,
        sampling_info: SamplingBatchInfo,
        return_logprob: bool,
        top_logprobs_nums: Optional[List[int]],
        token_ids_logprobs: Optional[List[Optional[List[int]]]] = None,
    ) -> torch.Tensor:
        logits = logits_output.next_token_logits
        if logits.dtype != torch.float32:
            logits = logits.float()
        if logits.shape[1] > sampling_info.vocab_size:
            # Padded LM-head columns are not tokens: drop them so they can never be sampled.
            logits = logits[:, : sampling_info.vocab_size]
        sampling_info.apply_logits_bias(logits)
        # After penalties and logit_bias, before sampling, as in SGLang.
        sampling_info.apply_custom_logit_processors(logits)

        if sampling_info.is_all_greedy:
            next_token_ids = kernel_ops.greedy(logits)
        else:
            next_token_ids = self._sample(logits, sampling_info)

        if return_logprob:
            # Logprobs describe the model's (penalised) distribution, not the tempered one.
            logprobs = torch.log_softmax(logits, dim=-1)
            fill_logprobs(logits_output, logprobs, next_token_ids, top_logprobs_nums)
            fill_token_ids_logprobs(logits_output, logprobs, token_ids_logprobs)

        sampling_info.update_after_sample(next_token_ids)
        return next_token_ids

    @staticmethod
    def _sample(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        probs = torch.softmax(logits / info.temperatures, dim=-1)
        # On the CPU, rows settled among their candidates skip the full sort; picking them out
        # syncs with the device, which an accelerator's sampler must not do (it sorts fast anyway).
        on_cpu = probs.device.type == "cpu"
        next_ids = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
        rest: Optional[torch.Tensor] = None  # the rows the candidates did not settle (None: all)
        if on_cpu and (info.need_top_k_sampling or info.need_top_p_sampling) and probs.shape[1] > TOP_CANDIDATES:
            rest = _sample_candidates(probs, info, next_ids)
        if rest is None or rest.numel():
            rows = slice(None) if rest is None else rest
            filtered = top_k_top_p_min_p_renorm(
                probs[rows],
                info.top_ks[rows],
                info.top_ps[rows],
                info.min_ps[rows],
                need_top_k=info.need_top_k_sampling,
                need_top_p=info.need_top_p_sampling,
                need_min_p=info.need_min_p_sampling,
            )
            next_ids[rows] = _draw_full(filtered, info, rest)
        # Greedy rows take the exact argmax (ties broken like torch.argmax, not by sort order).
        greedy = info.top_ks == 1
        if on_cpu and not bool(greedy.any()):
            return next_ids
        return torch.where(greedy, kernel_ops.greedy(logits), next_ids)


def _sample_candidates(probs: torch.Tensor, info: SamplingBatchInfo, next_ids: torch.Tensor) -> torch.Tensor:
    """Sample the rows whose top-k / top-p set lies within their TOP_CANDIDATES most likely tokens
    (found by a partial sort) among those tokens only, into next_ids; return the other rows.

    A row is settled when its top_k is at most TOP_CANDIDATES, or when top-k is off and its top-p
    mass is reached within the candidates. The kept set and the race are those of the full path:
    the same tokens keep the same probabilities, and a seeded row's noise depends only on (seed,
    step, token id), so a seeded request draws the same token on either path.
    """
    vocab = probs.shape[1]
    vals, idx = probs.topk(TOP_CANDIDATES, dim=-1)  # sorted, most likely first
    keep, reached = _keep_sorted(vals, info.top_ks, info.top_ps, info.need_top_k_sampling,
                                 info.need_top_p_sampling, row_mass=probs.sum(dim=-1))
    settled = (info.top_ks <= TOP_CANDIDATES) | ((info.top_ks >= vocab) & reached)
    rows = settled.nonzero().squeeze(1)
    if rows.numel():
        kept = (vals * keep)[rows]
        if info.need_min_p_sampling:  # the most likely token (the first) is always kept
            kept = kept.masked_fill(kept < kept[:, :1] * info.min_ps[rows].unsqueeze(1), 0.0)
        noise = _race_noise(info, rows, idx[rows], kept.shape)
        choice = torch.argmax(kept / noise, dim=-1, keepdim=True)
        next_ids[rows] = idx[rows].gather(1, choice).squeeze(1)
    return (~settled).nonzero().squeeze(1)


def _draw_full(probs: torch.Tensor, info: SamplingBatchInfo, rows: Optional[torch.Tensor]) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab] (rows of the batch, None: all), without a device
    sync. Unseeded rows draw by inverse CDF, one uniform number per row instead of the race's one
    per token (that noise took 15 of 17 ms at 64 rows of a 32k vocabulary on the CPU); seeded rows
    run the exponential race with their (seed, step, token) noise."""
    total = torch.cumsum(probs, dim=-1)
    u = torch.rand(probs.shape[0], 1, device=probs.device) * total[:, -1:]
    # The first token whose cumulative mass passes u: never one of probability 0.
    drawn = torch.searchsorted(total, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
    if info.seeds is None:
        return drawn
    assert info.seeded_mask is not None  # set together with seeds
    seeds, steps, seeded = info.seeds, info.output_lens, info.seeded_mask
    if rows is not None:
        seeds, steps, seeded = seeds[rows], steps[rows], seeded[rows]
    token_ids = torch.arange(probs.shape[1], device=probs.device).expand(probs.shape)
    raced = torch.argmax(probs / seeded_exponential_at(seeds, steps, token_ids), dim=-1)
    return torch.where(seeded, raced, drawn)


def _race_noise(info: SamplingBatchInfo, rows: Optional[torch.Tensor], token_ids: Optional[torch.Tensor],
                shape: torch.Size) -> torch.Tensor:
    """Exp(1) noise for the exponential race of `rows` (None: all) over `token_ids` [rows, n] (None:
    the whole vocabulary). -log of a uniform draw: torch's exponential_ is ~7x slower on the CPU."""
    noise = torch.empty(shape, device=info.top_ks.device).uniform_().neg_().log1p_().neg_()
    # A draw of exactly 0 would make p / noise inf (that token wins whatever its probability) or,
    # for a token masked out (p = 0), NaN, which argmax picks.
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)
    if info.seeds is not None:
        assert info.seeded_mask is not None  # set together with seeds
        seeds, steps, mask = info.seeds, info.output_lens, info.seeded_mask
        if rows is not None:
            seeds, steps, mask = seeds[rows], steps[rows], mask[rows]
        if token_ids is None:
            token_ids = torch.arange(shape[1], device=noise.device).expand(shape)
        noise = torch.where(mask.unsqueeze(1), seeded_exponential_at(seeds, steps, token_ids), noise)
    return noise


def top_k_top_p_min_p_renorm(
    probs: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    need_top_k: bool = True,
    need_top_p: bool = True,
    need_min_p: bool = True,
) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k, then top-p (nucleus, on the top-k
    renormalised distribution), then min-p (p < min_p * max p) sets, and renormalise.

    Top-p keeps the smallest prefix of the sorted distribution whose mass reaches top_p; the most
    likely token always survives. Rows with top_p >= 1, top_k >= vocab or min_p == 0 are untouched.
    """
    if need_top_k or need_top_p:
        sorted_probs, sorted_idx = probs.sort(dim=-1, descending=True)
        keep, _ = _keep_sorted(sorted_probs, top_ks, top_ps, need_top_k, need_top_p)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs * keep)
    if need_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _keep_sorted(sorted_probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, need_top_k: bool,
                 need_top_p: bool, row_mass: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Over probabilities sorted most likely first (a whole row, or its leading candidates): the
    mask of the top-k set, then of the shortest prefix whose top-k-renormalised mass reaches top_p
    (the first always kept); and per row whether that prefix ended within these columns.

    For candidates, `row_mass` is each whole row's mass: the top-k mass of a row whose top_k
    reaches past the candidates."""
    n = sorted_probs.shape[1]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if need_top_k:
        ranks = torch.arange(n, device=sorted_probs.device).unsqueeze(0)
        keep = ranks < top_ks.unsqueeze(1)
    reached = torch.zeros(sorted_probs.shape[0], dtype=torch.bool, device=sorted_probs.device)
    if need_top_p:
        kept = sorted_probs * keep
        if need_top_k:
            mass = kept.sum(dim=-1)
            if row_mass is not None:
                mass = torch.where(top_ks > n, row_mass, mass)
            kept = kept / mass.unsqueeze(1)
        mass_before = torch.cumsum(kept, dim=-1) - kept
        limit = torch.where(top_ps < 1.0, top_ps - TOP_P_EPS, torch.inf).unsqueeze(1)
        drop = mass_before >= limit
        drop[:, 0] = False
        reached = drop[:, -1]
        keep = keep & ~drop
    return keep, reached


# splitmix64 constants, as signed int64 (torch has no uint64 arithmetic; multiplication wraps).
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser: a bijective, well-avalanched scramble of 64 bits."""
    x = (x ^ _shr(x, 30)) * _MIX_1
    x = (x ^ _shr(x, 27)) * _MIX_2
    return x ^ _shr(x, 31)


def seeded_exponential(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [bs, vocab] that depends only on (seed, step, token id) of each cell."""
    token_ids = torch.arange(vocab_size, device=seeds.device).expand(seeds.shape[0], vocab_size)
    return seeded_exponential_at(seeds, steps, token_ids)


def seeded_exponential_at(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """seeded_exponential at the given token ids [bs, n] of each row only."""
    row_key = _mix64(_mix64(seeds + _GOLDEN_GAMMA) ^ (steps * _GOLDEN_GAMMA))
    bits = _mix64(row_key.unsqueeze(1) + (token_ids.to(torch.int64) + 1) * _GOLDEN_GAMMA)
    # Top 23 bits -> a float32-exact uniform in [2^-24, 1 - 2^-24], strictly inside (0, 1). (With 24
    # bits the largest value, 1 - 2^-25, rounded to 1.0: noise 0, so p / noise was inf or NaN.)
    uniform = (_shr(bits, 41).to(torch.float32) + 0.5) * (1.0 / (1 << 23))
    return -torch.log(uniform)


def fill_logprobs(
    logits_output: LogitsProcessorOutput,
    logprobs: torch.Tensor,
    next_token_ids: torch.Tensor,
    top_logprobs_nums: Optional[List[int]],
) -> None:
    """Chosen-token logprobs and, per request, its top_logprobs_nums[i] best (value, id) pairs."""
    logits_output.next_token_logprobs = logprobs.gather(1, next_token_ids.unsqueeze(1)).squeeze(1)
    bs = logprobs.shape[0]
    nums = list(top_logprobs_nums) if top_logprobs_nums is not None else [0] * bs
    max_k = min(max(nums, default=0), logprobs.shape[1])
    if max_k > 0:
        values, indices = logprobs.topk(max_k, dim=-1)
        values_list, indices_list = values.tolist(), indices.tolist()
    else:
        values_list = indices_list = [[] for _ in range(bs)]
    logits_output.next_token_top_logprobs_val = [values_list[i][: nums[i]] for i in range(bs)]
    logits_output.next_token_top_logprobs_idx = [indices_list[i][: nums[i]] for i in range(bs)]


def fill_token_ids_logprobs(logits_output: LogitsProcessorOutput, logprobs: torch.Tensor,
                            token_ids_logprobs: Optional[List[Optional[List[int]]]]) -> None:
    """token_ids_logprob: per row, the logprobs of the asked ids (None for rows that asked none)."""
    if not token_ids_logprobs or not any(token_ids_logprobs):
        return
    out: List[Optional[List[float]]] = []
    for row, ids in enumerate(token_ids_logprobs):
        if ids:
            index = torch.tensor(ids, dtype=torch.long, device=logprobs.device)
            out.append(logprobs[row].index_select(0, index).tolist())
        else:
            out.append(None)
    logits_output.next_token_token_ids_logprobs_val = out
