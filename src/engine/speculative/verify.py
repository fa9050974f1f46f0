"""Which drafts a verify forward accepts, so that the output is exactly the target's.

Each request fed its last token and drafts d_1..d_k; row j of its logits is the target's
distribution p_j of the token after position j. Greedy rows accept d_{j+1} while it is p_j's
argmax and add the argmax after the last accepted draft (the bonus). Sampled rows follow SGLang's
rejection rule: d_{j+1}, drawn by the drafter from q_j, is accepted with probability
min(1, p_j(d_{j+1}) / q_j(d_{j+1})); at the first rejection the token is drawn from
max(p_j - q_j, 0) renormalised, and the step ends; after k acceptances the bonus is drawn from p_k.
Each emitted token is then distributed as p exactly (P(t) = min(p(t), q(t)) + max(p(t) - q(t), 0)
= p(t)). A drafter without probabilities (NGRAM: a deterministic proposal) is the case q_j = the
point mass on d_{j+1}: accept with p_j(d), else draw from p_j without d.

p_j (and a draft model's q_j) is the distribution the normal sampler draws from:
softmax(logits / temperature) restricted to the top-k, top-p and min-p sets and renormalised
(layers/sampler.py), greedy = its argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from engine.kernels import ops as kernel_ops
from engine.layers.sampler import top_k_top_p_min_p_renorm
from engine.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class VerifyOutcome:
    # Per request: the tokens the step emits (accepted drafts, then the bonus or resampled token).
    tokens: List[List[int]]
    # Per request: how many of its drafts were accepted.
    accepted: List[int]


def accept_drafts(logits: torch.Tensor, drafts: Sequence[Sequence[int]], info: SamplingBatchInfo,
                  draft_probs: Optional[Sequence[Optional[torch.Tensor]]] = None) -> VerifyOutcome:
    """`logits` [sum(1 + len(d)), vocab]: each request's rows in order (its last token, then its
    drafts); `info` holds one row of sampling parameters per request; `draft_probs[i]` [len(d_i),
    vocab]: the distributions request i's sampled drafts were drawn from (None: point masses)."""
    logits = logits[:, : info.vocab_size].float()
    counts = [1 + len(d) for d in drafts]
    greedy_ids = kernel_ops.greedy(logits).tolist()
    row_greedy = (info.top_ks == 1).tolist()
    sampled = [i for i, g in enumerate(row_greedy) if not g]
    starts: List[int] = []
    pos = 0
    for c in counts:
        starts.append(pos)
        pos += c
    tokens: List[List[int]] = [[] for _ in drafts]
    accepted = [0] * len(drafts)
    for i, d in enumerate(drafts):
        if not row_greedy[i]:
            continue
        a = 0
        while a < len(d) and d[a] == greedy_ids[starts[i] + a]:
            a += 1
        accepted[i] = a
        tokens[i] = list(d[:a]) + [greedy_ids[starts[i] + a]]
    if sampled:
        probs_of = draft_probs if draft_probs is not None else [None] * len(drafts)
        _accept_sampled(logits, drafts, info, probs_of, sampled, starts, counts, tokens, accepted)
    return VerifyOutcome(tokens=tokens, accepted=accepted)


def target_probs(logits: torch.Tensor, info: SamplingBatchInfo, rows: torch.Tensor,
                 row_of_position: torch.Tensor) -> torch.Tensor:
    """The normal sampler's distribution at each position: `logits` [positions, vocab], request
    `rows` of `info` per position (row_of_position indexes into rows)."""
    req_rows = rows[row_of_position]
    probs = torch.softmax(logits / info.temperatures[req_rows], dim=-1)
    return top_k_top_p_min_p_renorm(
        probs, info.top_ks[req_rows], info.top_ps[req_rows], info.min_ps[req_rows],
        need_top_k=info.need_top_k_sampling, need_top_p=info.need_top_p_sampling,
        need_min_p=info.need_min_p_sampling)


def _accept_sampled(logits: torch.Tensor, drafts: Sequence[Sequence[int]], info: SamplingBatchInfo,
                    draft_probs: Sequence[Optional[torch.Tensor]], sampled: List[int], starts: List[int],
                    counts: List[int], tokens: List[List[int]], accepted: List[int]) -> None:
    positions = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i in sampled])
    owner = torch.repeat_interleave(torch.arange(len(sampled)), torch.tensor([counts[i] for i in sampled]))
    device = logits.device
    probs = target_probs(logits[positions.to(device)], info, torch.tensor(sampled, device=device), owner.to(device))
    # q_j: the point mass on d_{j+1} unless the drafter gave its distribution; the last position
    # has no draft (a dummy id and row, never read).
    vocab = probs.shape[1]
    draft_next: List[int] = []
    q_rows: List[torch.Tensor] = []
    for i in sampled:
        draft_next.extend(list(drafts[i]) + [0])
        q = draft_probs[i]
        if q is None:
            q = torch.nn.functional.one_hot(torch.tensor(list(drafts[i]), dtype=torch.int64), vocab).float()
        q_rows.extend([q.to(device=device, dtype=probs.dtype), torch.zeros(1, vocab, device=device)])
    q_all = torch.cat(q_rows)[:, :vocab]
    draft_ids = torch.tensor(draft_next, dtype=torch.int64, device=device).clamp_(0, vocab - 1)
    p_draft = probs.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    q_draft = q_all.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    # min(1, p/q) < u  <=>  reject; q(d) > 0 for a drawn draft (the dummy rows are never read).
    ratio = p_draft / q_draft.clamp_min(torch.finfo(probs.dtype).tiny)
    accept = (torch.rand(p_draft.shape, device=device) < ratio).tolist()
    final_rows: List[int] = []  # per sampled request: the local row its last token is drawn from
    rejected: List[bool] = []  # ... and whether a draft was rejected there (else: the bonus, from p)
    local = 0
    for i in sampled:
        d = drafts[i]
        a = 0
        while a < len(d) and accept[local + a]:
            a += 1
        accepted[i] = a
        tokens[i] = list(d[:a])
        final_rows.append(local + a)
        rejected.append(a < len(d))
        local += counts[i]
    rows_t = torch.tensor(final_rows, device=device)
    p_final = probs[rows_t]
    residual = torch.where(torch.tensor(rejected, device=device).unsqueeze(1),
                           (p_final - q_all[rows_t]).clamp_min(0.0), p_final)
    # A residual with no mass (p == q up to rounding, or a point-mass draft of probability 1) is a
    # rejection of probability 0: draw from p itself.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    final = torch.where(empty, p_final, residual)
    total = torch.cumsum(final, dim=-1)
    u = torch.rand(final.shape[0], 1, device=device) * total[:, -1:]
    drawn_t = torch.searchsorted(total, u, right=True).squeeze(1).clamp_(max=final.shape[1] - 1)
    drawn = drawn_t.tolist()
    for r, i in enumerate(sampled):
        tokens[i].append(int(drawn[r]))
