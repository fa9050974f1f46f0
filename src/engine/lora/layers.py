"""The LoRA delta of one base projection, and the segments of the forward in progress.

A base linear layer (layers/linear.py) holding a `LoRAProjection` adds its delta to its own output
(a row-parallel layer before its all-reduce). The rows a projection sees are either every token of
the forward or, in the last layer of an extend (LogitsProcessor.last_rows_suffice), only each
request's last row: `LoRABatchState` keeps the segments of both and picks by the row count (equal
counts mean one row per request, where both layouts agree).
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from engine.lora.backend import LoRABatchInfo, run_lora, sections_tensor


class LoRABatchState:
    """The current forward's segments; written by the LoRAManager before each forward."""

    def __init__(self) -> None:
        self._tokens: Optional[LoRABatchInfo] = None
        self._last_rows: Optional[LoRABatchInfo] = None

    def set(self, tokens: Optional[LoRABatchInfo], last_rows: Optional[LoRABatchInfo]) -> None:
        self._tokens, self._last_rows = tokens, last_rows

    def info_for(self, rows: int) -> Optional[LoRABatchInfo]:
        tokens, last = self._tokens, self._last_rows
        if tokens is None:
            return None
        if tokens.num_rows == rows:
            return tokens
        if last is not None and last.num_rows == rows:
            return last
        raise RuntimeError(f"a LoRA projection got {rows} rows; the batch has {tokens.num_rows} tokens")


class LoRAProjection:
    """Adds x @ A^T @ B^T * scaling of each row's adapter to a base projection's output."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, sections: Sequence[Tuple[int, int]], max_rank: int,
                 state: LoRABatchState, backend: str, b_native: Optional[List[torch.Tensor]] = None,
                 b_kernel: Optional[torch.Tensor] = None) -> None:
        self.a, self.b = a, b  # the pool's buffers of this projection: [slots, subs x R, K], [slots, N, R]
        self.sections = list(sections)
        self.max_rank = max_rank
        self.state = state
        self.backend = backend
        self.b_native = b_native or []  # the pool's B per section for the native backend (backend.native_b)
        self.b_kernel = b_kernel  # the pool's B for the native kernel (backend.kernel_b)
        self.sections_t = sections_tensor(self.sections)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        info = self.state.info_for(rows.shape[0])
        if info is None or not info.has_lora:
            return out
        flat = out.reshape(-1, out.shape[-1])
        run_lora(self.backend, rows, flat, self.a, self.b, self.b_native, self.sections, self.max_rank, info,
                 self.b_kernel, self.sections_t)
        return out

    def active(self, rows: int) -> bool:
        """Whether a projection of `rows` rows adds a delta in this forward (some row has an adapter)."""
        info = self.state.info_for(rows)
        return info is not None and info.has_lora
