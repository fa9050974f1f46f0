"""min_new_tokens: forbid every stop token (EOS and stop_token_ids) until enough tokens exist.

The mask applies even with ignore_eos: ignore_eos only stops EOS from *finishing* a request,
while min_new_tokens promises that the first tokens are not stop tokens at all.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine.sampling.penaltylib.base import BatchedPenalizer, SamplingReq, row_token_pairs


def stop_ids_of(req: SamplingReq) -> list[int]:
    """EOS ids of the model plus the request's own stop_token_ids."""
    ids = set(req.eos_token_ids)
    ids.update(req.sampling_params.stop_token_ids or ())
    return sorted(ids)


class BatchedMinNewTokensPenalizer(BatchedPenalizer):
    row_tensors = ("min_new_tokens", "stop_mask")

    def __init__(self, min_new_tokens: torch.Tensor, stop_mask: torch.Tensor) -> None:
        self.min_new_tokens = min_new_tokens  # [bs] int64
        self.stop_mask = stop_mask  # [bs, vocab] bool: the row's stop ids

    @staticmethod
    def is_required(params: Any) -> bool:
        return params.min_new_tokens > 0

    @classmethod
    def build(cls, reqs: Sequence[SamplingReq], vocab_size: int, device: torch.device) -> "BatchedMinNewTokensPenalizer":
        min_new = torch.tensor([r.sampling_params.min_new_tokens for r in reqs], dtype=torch.int64, device=device)
        mask = torch.zeros(len(reqs), vocab_size, dtype=torch.bool, device=device)
        rows, cols = row_token_pairs([stop_ids_of(r) for r in reqs], vocab_size, device)
        mask[rows, cols] = True
        return cls(min_new, mask)

    @classmethod
    def neutral(cls, batch_size: int, vocab_size: int, device: torch.device) -> "BatchedMinNewTokensPenalizer":
        return cls(
            torch.zeros(batch_size, dtype=torch.int64, device=device),
            torch.zeros(batch_size, vocab_size, dtype=torch.bool, device=device),
        )

    def cumulate(self, token_ids: torch.Tensor) -> None:
        # The step counter lives in the orchestrator (output_lens), shared with seeded sampling.
        pass

    def cumulate_at(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        pass  # as in cumulate: output_lens counts the tokens

    def apply(self, logits: torch.Tensor, output_lens: torch.Tensor) -> None:
        active = (output_lens < self.min_new_tokens).unsqueeze(1)
        logits.masked_fill_(self.stop_mask & active, float("-inf"))

    def still_required(self) -> bool:
        return bool((self.min_new_tokens > 0).any())
