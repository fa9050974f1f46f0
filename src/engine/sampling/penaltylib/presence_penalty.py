"""Presence penalty (OpenAI semantics): logit -= penalty once the token has been generated."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.sampling.penaltylib.base import BatchedPenalizer, SamplingReq, row_params, row_token_pairs


class BatchedPresencePenalizer(BatchedPenalizer):
    row_tensors = ("penalties", "output_seen")

    def __init__(self, penalties: torch.Tensor, output_seen: torch.Tensor) -> None:
        self.penalties = penalties  # [bs, 1] float32
        self.output_seen = output_seen  # [bs, vocab] bool: generated at least once

    @staticmethod
    def is_required(params: Any) -> bool:
        return params.presence_penalty != 0.0

    @classmethod
    def build(cls, reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device) -> "BatchedPresencePenalizer":
        penalties = row_params([r.sampling_params.presence_penalty for r in reqs], device)
        seen = torch.zeros(len(reqs), vocab_size, dtype=torch.bool, device=device)
        rows, cols = row_token_pairs([r.output_ids for r in reqs], vocab_size, device)
        seen[rows, cols] = True
        return cls(penalties, seen)

    @classmethod
    def neutral(cls, batch_size: int, vocab_size: int, device: torch.device) -> "BatchedPresencePenalizer":
        return cls(
            torch.zeros(batch_size, 1, dtype=torch.float32, device=device),
            torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device),
        )

    def cumulate(self, token_ids: torch.Tensor) -> None:
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)
        self.output_seen[rows, token_ids] = True

    def cumulate_at(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.output_seen[rows, token_ids] = True

    def apply(self, logits: torch.Tensor, output_lens: torch.Tensor) -> None:
        # bool * float builds the temporary on a slow promotion path: convert, then one fused pass.
        logits.addcmul_(self.output_seen.to(logits.dtype), self.penalties, value=-1.0)

    def still_required(self) -> bool:
        return bool((self.penalties != 0).any())
