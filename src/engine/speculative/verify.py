"""Which drafts a verify forward accepts, so that the output is exactly the target's.

Each request fed its last token and drafts d_1..d_k; row j of its logits is the target's
distribution p_j of the token after position j. Greedy rows accept d_{j+1} while it is p_j's
argmax and add the argmax after the last accepted draft (the bonus). Sampled rows follow SGLang's
rule for a deterministic draft (rejection sampling with a point-mass proposal): d_{j+1} is accepted
with probability p_j(d_{j+1}); at the first rejection the token is drawn from p_j with d_{j+1}
removed and renormalised, and the step ends; after k acceptances the bonus is drawn from p_k. Each
emitted token is then distributed as p exactly: P(t) = p(d)[t = d] + (1 - p(d)) p(t) / (1 - p(d))
[t != d] = p(t).

p_j is the distribution the normal sampler draws from: softmax(logits / temperature) restricted
to the top-k, top-p and min-p sets and renormalised (layers/sampler.py), greedy = its argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

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


def accept_drafts(logits: torch.Tensor, drafts: Sequence[Sequence[int]], info: SamplingBatchInfo) -> VerifyOutcome:
    """`logits` [sum(1 + len(d)), vocab]: each request's rows in order (its last token, then its
    drafts); `info` holds one row of sampling parameters per request."""
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
        _accept_sampled(logits, drafts, info, sampled, starts, counts, tokens, accepted)
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
                    sampled: List[int], starts: List[int], counts: List[int], tokens: List[List[int]],
                    accepted: List[int]) -> None:
    positions = torch.cat([torch.arange(starts[i], starts[i] + counts[i]) for i in sampled])
    owner = torch.repeat_interleave(torch.arange(len(sampled)), torch.tensor([counts[i] for i in sampled]))
    device = logits.device
    probs = target_probs(logits[positions.to(device)], info, torch.tensor(sampled, device=device), owner.to(device))
    # p_j(d_{j+1}) at every position with a following draft, and one uniform number each.
    draft_next: List[int] = []
    for i in sampled:
        draft_next.extend(list(drafts[i]) + [0])  # the last position has no draft: a dummy id
    draft_ids = torch.tensor(draft_next, dtype=torch.int64, device=device).clamp_(0, probs.shape[1] - 1)
    p_draft = probs.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
    accept = (torch.rand(p_draft.shape, device=device) < p_draft).tolist()
    final_rows: List[int] = []  # per sampled request: the local row its last token is drawn from
    excluded: List[int] = []  # ... and the rejected draft removed from it (-1: none, the bonus)
    local = 0
    for i in sampled:
        d = drafts[i]
        a = 0
        while a < len(d) and accept[local + a]:
            a += 1
        accepted[i] = a
        tokens[i] = list(d[:a])
        final_rows.append(local + a)
        excluded.append(d[a] if a < len(d) else -1)
        local += counts[i]
    final = probs[torch.tensor(final_rows, device=device)].clone()
    for r, t in enumerate(excluded):
        if t >= 0:
            final[r, t] = 0.0
    total = torch.cumsum(final, dim=-1)
    u = torch.rand(final.shape[0], 1, device=device) * total[:, -1:]
    drawn_t = torch.searchsorted(total, u, right=True).squeeze(1).clamp_(max=final.shape[1] - 1)
    # A rejected draft whose probability rounded to 1 leaves nothing: the draft is the only choice.
    empty = total[:, -1] <= 0
    if bool(empty.any()):
        drawn_t = torch.where(empty, probs[torch.tensor(final_rows, device=device)].argmax(dim=-1), drawn_t)
    drawn = drawn_t.tolist()
    for r, i in enumerate(sampled):
        tokens[i].append(int(drawn[r]))
