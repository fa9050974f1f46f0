"""Sampler: logits -> next token ids, with penalties, temperature, top-k/top-p/min-p, seeds and logprobs.

Sampling uses the exponential race (argmax of p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i): it is one vectorised pass with no device sync, and it lets seeded rows swap in
their own noise. That noise comes from a counter-based hash of (seed, step, token id), so a seeded
request draws the same tokens whatever else is in the batch, after retraction, and on any device.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch
from torch import nn

from engine.layers.logits_processor import LogitsProcessorOutput
from engine.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

# Tolerance of the top-p boundary: a prefix whose mass reaches top_p up to float32 rounding
# (0.5 + 0.3 vs 0.8) counts as reaching it, so hand-computed examples give the expected set.
TOP_P_EPS = 1e-6


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
            next_token_ids = torch.argmax(logits, dim=-1)
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
        probs = top_k_top_p_min_p_renorm(
            probs,
            info.top_ks,
            info.top_ps,
            info.min_ps,
            need_top_k=info.need_top_k_sampling,
            need_top_p=info.need_top_p_sampling,
            need_min_p=info.need_min_p_sampling,
        )
        # exponential_ may return exactly 0; p / 0 would be inf (that token wins whatever its
        # probability) or, for a token a grammar masked out (p = 0), NaN, which argmax picks.
        noise = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(probs.dtype).tiny)
        if info.seeds is not None:
            assert info.seeded_mask is not None  # set together with seeds
            seeded_noise = seeded_exponential(info.seeds, info.output_lens, probs.shape[1])
            noise = torch.where(info.seeded_mask.unsqueeze(1), seeded_noise, noise)
        sampled = torch.argmax(probs / noise, dim=-1)
        # Greedy rows take the exact argmax (ties broken like torch.argmax, not by sort order).
        greedy = info.top_ks == 1
        return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


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
        if need_top_k:
            ranks = torch.arange(probs.shape[1], device=probs.device).unsqueeze(0)
            sorted_probs = sorted_probs.masked_fill(ranks >= top_ks.unsqueeze(1), 0.0)
            sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        if need_top_p:
            mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
            limit = torch.where(top_ps < 1.0, top_ps - TOP_P_EPS, torch.inf).unsqueeze(1)
            drop = mass_before >= limit
            drop[:, 0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, sorted_idx, sorted_probs)
    if need_min_p:
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


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
    row_key = _mix64(_mix64(seeds + _GOLDEN_GAMMA) ^ (steps * _GOLDEN_GAMMA))
    cols = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seeds.device)
    bits = _mix64(row_key.unsqueeze(1) + cols.unsqueeze(0) * _GOLDEN_GAMMA)
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
