"""Frequency penalty (OpenAI semantics): logit -= penalty * (times the token was generated)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.sampling.penaltylib.base import BatchedPenalizer, SamplingReq, row_params, row_token_pairs


class BatchedFrequencyPenalizer(BatchedPenalizer):
    row_tensors = ("penalties", "output_counts")

    def __init__(self, penalties: torch.Tensor, output_counts: torch.Tensor) -> None:
        self.penalties = penalties  # [bs, 1] float32
        self.output_counts = output_counts  # [bs, vocab] float32: occurrences among output tokens

    @staticmethod
    def is_required(params: Any) -> bool:
        return params.frequency_penalty != 0.0

    @classmethod
    def build(cls, reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device) -> "BatchedFrequencyPenalizer":
        penalties = row_params([r.sampling_params.frequency_penalty for r in reqs], device)
        counts = torch.zeros(len(reqs), vocab_size, dtype=torch.float32, device=device)
        rows, cols = row_token_pairs([r.output_ids for r in reqs], vocab_size, device)
        counts.index_put_((rows, cols), torch.ones_like(rows, dtype=torch.float32), accumulate=True)
        return cls(penalties, counts)

    @classmethod
    def neutral(cls, batch_size: int, vocab_size: int, device: torch.device) -> "BatchedFrequencyPenalizer":
        return cls(
            torch.zeros(batch_size, 1, dtype=torch.float32, device=device),
            torch.zeros(batch_size, vocab_size, dtype=torch.float32, device=device),
        )

    def cumulate(self, token_ids: torch.Tensor) -> None:
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)
        # One token per row, so no duplicate (row, col) pairs: a plain indexed add is exact.
        self.output_counts[rows, token_ids] += 1.0

    def cumulate_at(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        # Repeated (row, token) pairs each count: an accumulating put.
        self.output_counts.index_put_((rows, token_ids), torch.ones_like(rows, dtype=torch.float32), accumulate=True)

    def apply(self, logits: torch.Tensor, output_lens: torch.Tensor) -> None:
        logits.addcmul_(self.output_counts, self.penalties, value=-1.0)  # one pass, no [bs, vocab] temporary

    def still_required(self) -> bool:
        return bool((self.penalties != 0).any())
