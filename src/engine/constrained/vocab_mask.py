"""The vocabulary bitmask of a batch: built from the requests' matchers, applied in the sampler.

Format (xgrammar's and SGLang's): int32 [batch, ceil(vocab / 32)]; bit j of word w allows token
32 * w + j. A row of all ones (-1) allows everything, so requests without a grammar share the
batch's mask at no cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

if TYPE_CHECKING:
    from engine.managers.req import Req

_ALL_ALLOWED = -1


def allocate_vocab_mask(batch_size: int, vocab_size: int) -> torch.Tensor:
    return torch.full((batch_size, (vocab_size + 31) // 32), _ALL_ALLOWED, dtype=torch.int32)


def needs_vocab_mask(req: "Req") -> bool:
    """A live constrained request. A stale overlap row (the request finished or was retracted
    while this batch was in flight) needs none: its sampled token is discarded."""
    return req.grammar is not None and not req.finished() and not req.is_retracted


def build_vocab_mask(reqs: Sequence["Req"], vocab_size: int) -> Optional[torch.Tensor]:
    """The mask for the next token of every request (None when no request is constrained).

    Must run after the requests' previous tokens were accepted by their matchers.
    """
    rows = [i for i, req in enumerate(reqs) if needs_vocab_mask(req)]
    if not rows:
        return None
    mask = allocate_vocab_mask(len(reqs), vocab_size)
    for i in rows:
        reqs[i].grammar.fill_vocab_mask(mask, i)
    return mask


_SHIFTS_CACHE: dict = {}


def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place ([bs, vocab] logits)."""
    bs, vocab = logits.shape
    device = logits.device
    shifts = _SHIFTS_CACHE.get(device)
    if shifts is None:
        shifts = _SHIFTS_CACHE[device] = torch.arange(32, dtype=torch.int32, device=device)
    mask = vocab_mask.to(device, non_blocking=True)
    bits = torch.bitwise_and(torch.bitwise_right_shift(mask.unsqueeze(-1), shifts), 1)
    allowed = bits.view(bs, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
