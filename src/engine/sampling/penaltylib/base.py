"""BatchedPenalizer: one penalty kind's state for a batch, one row per request.

Every piece of state is a tensor whose first dimension is the batch row, listed in
`row_tensors`, so filtering and merging are generic (index / concatenate) and never touch the
penalty arithmetic. A penalizer exists only while some row of the batch needs it; rows that do
not are "neutral" (their parameters make the penalty a no-op), which is what lets a batch with
penalties merge with one without.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, List, Optional, Protocol, Sequence, Set, Tuple

import torch

if TYPE_CHECKING:
    from engine.sampling.sampling_params import SamplingParams


class SamplingReq(Protocol):
    """What sampling reads of a request: scheduler/req.py's Req has it (tests use small records)."""

    sampling_params: SamplingParams
    origin_input_ids: List[int]
    output_ids: List[int]
    eos_token_ids: Set[int]

    @property
    def custom_logit_processor(self) -> Optional[str]: ...  # read only: Req's comes from its options


class BatchedPenalizer(ABC):
    row_tensors: ClassVar[Tuple[str, ...]] = ()

    @staticmethod
    @abstractmethod
    def is_required(params: "SamplingParams") -> bool:
        """Whether a request with these parameters needs this penalty."""

    @classmethod
    @abstractmethod
    def build(cls, reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device) -> "BatchedPenalizer":
        """State for `reqs`, reconstructed from their prompt and output tokens so far."""

    @classmethod
    @abstractmethod
    def neutral(cls, batch_size: int, vocab_size: int, device: torch.device) -> "BatchedPenalizer":
        """State for rows that do not use this penalty (the other side of a merge)."""

    @abstractmethod
    def cumulate(self, token_ids: torch.Tensor) -> None:
        """Account for one newly sampled token per row ([bs] int64)."""

    @abstractmethod
    def cumulate_at(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Account for one token at each of `rows` ([n] int64 each); a row may come several times
        (a verify step's tokens of one request), unlike in `cumulate`."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, output_lens: torch.Tensor) -> None:
        """Penalise `logits` ([bs, vocab] float32) in place."""

    @abstractmethod
    def still_required(self) -> bool:
        """Whether any row still needs this penalty (checked after a filter)."""

    @property
    def batch_size(self) -> int:
        return getattr(self, self.row_tensors[0]).shape[0]

    def state_tensors(self) -> List[torch.Tensor]:
        return [getattr(self, name) for name in self.row_tensors]

    def filter(self, keep: torch.Tensor) -> None:
        for name in self.row_tensors:
            setattr(self, name, getattr(self, name)[keep])

    def merge(self, other: "BatchedPenalizer") -> None:
        for name in self.row_tensors:
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)], dim=0))


def row_token_pairs(
    token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Flatten per-row token lists into (row index, token id) tensors, dropping ids outside the
    vocabulary (multimodal placeholders, padding) that have no logit to penalise."""
    rows = [row for row, tokens in enumerate(token_lists) for _ in tokens]
    cols = [token for tokens in token_lists for token in tokens]
    row_t = torch.tensor(rows, dtype=torch.int64)
    col_t = torch.tensor(cols, dtype=torch.int64)
    valid = (col_t >= 0) & (col_t < vocab_size)
    return row_t[valid].to(device), col_t[valid].to(device)


def row_params(values: Sequence[float], device: torch.device) -> torch.Tensor:
    """Per-row scalar parameters as a [bs, 1] float32 column that broadcasts over the vocabulary."""
    return torch.tensor(list(values), dtype=torch.float32, device=device).view(-1, 1)
