"""Repetition penalty (Hugging Face / CTRL semantics).

Every token seen in the prompt or the output so far has its logit divided by the penalty when
positive and multiplied by it when negative, so a penalty > 1 always makes it less likely.
Unlike the OpenAI penalties this one counts prompt tokens, as HF `generate` does.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.sampling.penaltylib.base import BatchedPenalizer, SamplingReq, row_params, row_token_pairs


class BatchedRepetitionPenalizer(BatchedPenalizer):
    row_tensors = ("penalties", "seen")

    def __init__(self, penalties: torch.Tensor, seen: torch.Tensor) -> None:
        self.penalties = penalties  # [bs, 1] float32
        self.seen = seen  # [bs, vocab] bool: in the prompt or the output

    @staticmethod
    def is_required(params: Any) -> bool:
        return params.repetition_penalty != 1.0

    @classmethod
    def build(cls, reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device) -> "BatchedRepetitionPenalizer":
        penalties = row_params([r.sampling_params.repetition_penalty for r in reqs], device)
        seen = torch.zeros(len(reqs), vocab_size, dtype=torch.bool, device=device)
        tokens = [list(r.origin_input_ids) + list(r.output_ids) for r in reqs]
        rows, cols = row_token_pairs(tokens, vocab_size, device)
        seen[rows, cols] = True
        return cls(penalties, seen)

    @classmethod
    def neutral(cls, batch_size: int, vocab_size: int, device: torch.device) -> "BatchedRepetitionPenalizer":
        return cls(
            torch.ones(batch_size, 1, dtype=torch.float32, device=device),
            torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device),
        )

    def cumulate(self, token_ids: torch.Tensor) -> None:
        rows = torch.arange(token_ids.shape[0], device=token_ids.device)
        self.seen[rows, token_ids] = True

    def cumulate_at(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        self.seen[rows, token_ids] = True

    def apply(self, logits: torch.Tensor, output_lens: torch.Tensor) -> None:
        if logits.device.type == "cpu":
            self.apply_sparse(logits)
        else:
            self.apply_dense(logits)

    def apply_sparse(self, logits: torch.Tensor) -> None:
        """Only the seen tokens (a few hundred per row): 5.8 -> 1.0 ms at 64 rows of a 32k
        vocabulary on the CPU. Finding them syncs with the device, so accelerators go dense."""
        rows, cols = self.seen.nonzero(as_tuple=True)
        picked, penalty = logits[rows, cols], self.penalties[rows, 0]
        logits[rows, cols] = torch.where(picked > 0, picked / penalty, picked * penalty)

    def apply_dense(self, logits: torch.Tensor) -> None:
        factor = torch.where(self.seen, self.penalties, 1.0)
        logits.copy_(torch.where(logits > 0, logits / factor, logits * factor))

    def still_required(self) -> bool:
        return bool((self.penalties != 1.0).any())
