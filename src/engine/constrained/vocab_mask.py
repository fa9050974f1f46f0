"""The vocabulary bitmask of a batch: built from the requests' matchers, applied in the sampler.

Format (xgrammar's and SGLang's): int32 [batch, ceil(vocab / 32)]; bit j of word w allows token
32 * w + j. A row of all ones (-1) allows everything, so requests without a grammar share the
batch's mask at no cost.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from engine.scheduler.req import Req

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
        grammar = reqs[i].grammar
        assert grammar is not None  # needs_vocab_mask checked it
        grammar.fill_vocab_mask(mask, i)
    return mask


_SHIFTS_CACHE: dict = {}


def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place ([bs, vocab] logits)."""
    bs, vocab = logits.shape
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and sys.byteorder == "little":
        # numpy, in place: unpacking bits with torch's shifts costs ~1000x more on the CPU, and a
        # torch masked_fill here waits on the forward's OpenMP team (measured 1 ms vs 25 ms for
        # 64 x 2560 on a busy 2-core box). On a little-endian host bit j of int32 word w is bit
        # j % 8 of byte 4 * w + j // 8.
        np_bits = np.unpackbits(vocab_mask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab]
        np.copyto(logits.numpy(), -np.inf, where=np_bits == 0)
        return
    device = logits.device
    shifts = _SHIFTS_CACHE.get(device)
    if shifts is None:
        shifts = _SHIFTS_CACHE[device] = torch.arange(32, dtype=torch.int32, device=device)
    mask = vocab_mask.to(device, non_blocking=True)
    bits = torch.bitwise_and(torch.bitwise_right_shift(mask.unsqueeze(-1), shifts), 1)
    allowed = bits.view(bs, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))
