"""RadixAttention: the attention layer of every model; K/V go through the paged pool."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.model_executor.forward_batch_info import ForwardBatch


class AttentionType(Enum):
    DECODER = "decoder"  # causal: token i sees tokens 0..i of its request (prefix included)
    ENCODER_ONLY = "encoder_only"  # bidirectional over the request's own tokens; nothing cached


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 attn_type: AttentionType = AttentionType.DECODER, sliding_window_size: int = -1,
                 logit_cap: float = 0.0, with_sinks: bool = False, v_head_dim: Optional[int] = None) -> None:
        """sliding_window_size: a query at position p sees the keys at positions (p - window, p], i.e. the
        window counts the query's own token (Hugging Face's `sliding_window`); -1 is full attention.
        logit_cap: scores become cap * tanh(score / cap) before the softmax (Gemma 2); 0 is none.
        with_sinks: a learned logit per query head joins each softmax's denominator only (gpt-oss); this
        module owns the parameter (`sinks`, one value per head of this TP rank).
        v_head_dim: V's size per head where it differs from K's (MLA: the latent; layers/attention/mla_torch.py)."""
        super().__init__()
        if sliding_window_size == 0 or sliding_window_size < -1:
            raise ValueError(f"sliding_window_size must be -1 (full) or >= 1, got {sliding_window_size}")
        if logit_cap < 0:
            raise ValueError(f"logit_cap must be >= 0, got {logit_cap}")
        self.sliding_window_size = sliding_window_size
        self.logit_cap = logit_cap
        self.sinks: Optional[nn.Parameter] = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if with_sinks else None
        self.attn_type = attn_type
        self.is_causal = attn_type == AttentionType.DECODER
        self.tp_q_head_num = num_heads  # heads on this TP rank
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.scaling = scaling
        self.layer_id = layer_id

    @property
    def is_plain(self) -> bool:
        """Full attention with a plain softmax: what every backend's fast paths (and the native CPU
        kernels) compute. A window, a logit cap or sinks take the backend's windowed path; MLA (V's size
        differs from K's) its own (mla_torch.py)."""
        return (self.sliding_window_size < 0 and self.logit_cap == 0.0 and self.sinks is None
                and self.v_head_dim == self.head_dim)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
        last_rows_only: bool = False,
    ) -> torch.Tensor:
        """last_rows_only (an extend batch): every row's K/V is stored, but the output is each request's
        last row only, [bs, heads * head_dim] (a model's last layer when only the logits need it)."""
        if k is not None:
            k = k.view(-1, self.tp_k_head_num, self.head_dim)
            v = v.view(-1, self.tp_v_head_num, self.v_head_dim)
        backend = forward_batch.attn_backend
        assert backend is not None  # ForwardBatch.init_new sets it
        if last_rows_only:
            return backend.forward_extend_last_rows(q, k, v, self, forward_batch, save_kv_cache)
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache)
