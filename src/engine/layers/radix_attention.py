"""RadixAttention: the attention layer of every model; K/V go through the paged pool."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.model_executor.forward_batch_info import ForwardBatch


class AttentionType(Enum):
    DECODER = "decoder"  # causal: token i sees tokens 0..i of its request (prefix included)
    ENCODER_ONLY = "encoder_only"  # bidirectional over the request's own tokens; nothing cached


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 attn_type: AttentionType = AttentionType.DECODER) -> None:
        super().__init__()
        self.attn_type = attn_type
        self.is_causal = attn_type == AttentionType.DECODER
        self.tp_q_head_num = num_heads  # heads on this TP rank
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id

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
            v = v.view(-1, self.tp_v_head_num, self.head_dim)
        backend = forward_batch.attn_backend
        assert backend is not None  # ForwardBatch.init_new sets it
        if last_rows_only:
            return backend.forward_extend_last_rows(q, k, v, self, forward_batch, save_kv_cache)
        return backend.forward(q, k, v, self, forward_batch, save_kv_cache)
