"""BatchedPenalizerOrchestrator: all penalties of a batch plus the per-row output length.

`output_lens` (tokens generated so far per row) is always kept: it drives min_new_tokens and
the seeded sampler's step counter, so both stay right after retraction (rebuilt from
`req.output_ids`) and across filter / merge. Penalizers are created only when some request of
the batch needs them and dropped when a filter leaves no such request.
"""

from __future__ import annotations

import copy
import logging
from typing import Dict, List, Sequence, Type

import torch

from engine.sampling.penaltylib.base import BatchedPenalizer, SamplingReq
from engine.sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
from engine.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
from engine.sampling.penaltylib.presence_penalty import BatchedPresencePenalizer
from engine.sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer

logger = logging.getLogger(__name__)

# Order of application: the multiplicative HF penalty works on the raw logits, the additive
# OpenAI penalties follow, and the min_new_tokens -inf mask comes last so nothing can undo it.
PENALIZER_TYPES: tuple[Type[BatchedPenalizer], ...] = (
    BatchedRepetitionPenalizer,
    BatchedFrequencyPenalizer,
    BatchedPresencePenalizer,
    BatchedMinNewTokensPenalizer,
)


class BatchedPenalizerOrchestrator:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        output_lens: torch.Tensor,
        penalizers: Dict[Type[BatchedPenalizer], BatchedPenalizer],
    ) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_lens = output_lens  # [bs] int64
        self.penalizers = penalizers

    @classmethod
    def from_reqs(cls, reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device) -> "BatchedPenalizerOrchestrator":
        output_lens = torch.tensor([len(r.output_ids) for r in reqs], dtype=torch.int64, device=device)
        penalizers = {
            kind: kind.build(reqs, vocab_size, device)
            for kind in PENALIZER_TYPES
            if any(kind.is_required(r.sampling_params) for r in reqs)
        }
        return cls(vocab_size, device, output_lens, penalizers)

    @property
    def batch_size(self) -> int:
        return self.output_lens.shape[0]

    def state_tensors(self) -> List[torch.Tensor]:
        """Every per-row state tensor (filter and merge replace them all)."""
        tensors = [self.output_lens]
        for penalizer in self.penalizers.values():
            tensors.extend(penalizer.state_tensors())
        return tensors

    @property
    def is_required(self) -> bool:
        return bool(self.penalizers)

    def apply(self, logits: torch.Tensor) -> None:
        for kind in PENALIZER_TYPES:
            penalizer = self.penalizers.get(kind)
            if penalizer is not None:
                penalizer.apply(logits, self.output_lens)

    def cumulate(self, token_ids: torch.Tensor) -> None:
        token_ids = token_ids.to(device=self.device, dtype=torch.int64)
        self.output_lens += 1
        for penalizer in self.penalizers.values():
            penalizer.cumulate(token_ids)

    def cumulate_at(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """One token at each of `rows`, a row possibly several times (a verify step's emitted tokens)."""
        rows = rows.to(device=self.device, dtype=torch.int64)
        token_ids = token_ids.to(device=self.device, dtype=torch.int64)
        self.output_lens.index_add_(0, rows, torch.ones_like(rows))
        for penalizer in self.penalizers.values():
            penalizer.cumulate_at(rows, token_ids)

    def expanded(self, rows: torch.Tensor, gen_rows: torch.Tensor, gen_tokens: torch.Tensor
                 ) -> "BatchedPenalizerOrchestrator":
        """A new orchestrator with one row per entry of `rows` (a copy of that row of this one), then
        gen_tokens[j] counted as generated at its row gen_rows[j]: the state at each position of a
        verify step, its earlier drafts taken as accepted. This one is left unchanged."""
        rows = rows.to(device=self.device, dtype=torch.int64)
        penalizers: Dict[Type[BatchedPenalizer], BatchedPenalizer] = {}
        for kind, penalizer in self.penalizers.items():
            row_copy = copy.copy(penalizer)
            row_copy.filter(rows)  # indexing: new tensors, the originals untouched
            penalizers[kind] = row_copy
        out = BatchedPenalizerOrchestrator(self.vocab_size, self.device, self.output_lens[rows], penalizers)
        if gen_rows.numel():
            out.cumulate_at(gen_rows, gen_tokens)
        return out

    def filter(self, keep: torch.Tensor) -> None:
        self.output_lens = self.output_lens[keep]
        for kind in list(self.penalizers):
            penalizer = self.penalizers[kind]
            penalizer.filter(keep)
            if not penalizer.still_required():
                del self.penalizers[kind]

    def merge(self, other: "BatchedPenalizerOrchestrator") -> None:
        for kind in PENALIZER_TYPES:
            mine, theirs = self.penalizers.get(kind), other.penalizers.get(kind)
            if mine is None and theirs is None:
                continue
            if mine is None:
                mine = kind.neutral(self.batch_size, self.vocab_size, self.device)
            if theirs is None:
                theirs = kind.neutral(other.batch_size, self.vocab_size, self.device)
            mine.merge(theirs)
            self.penalizers[kind] = mine
        self.output_lens = torch.cat([self.output_lens, other.output_lens])
