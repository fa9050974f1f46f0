"""The two projections of multi-head latent attention (models/deepseek_v2.py) that are neither column- nor
row-parallel linears.

- ReplicatedLinear: the down-projections into the latents (q_a_proj, kv_a_proj_with_mqa). Every TP rank
  needs the whole latent (the KV pool stores it on every rank, each rank's heads read all of it), so
  each rank holds the whole weight. Packed for the CPU like the other linears; --quantization leaves it
  in --dtype (quantize_model quantizes column- and row-parallel layers only).
- LatentExpansion: kv_b_proj, never applied as a linear. The absorbed attention reads each head's two
  halves W_kc / W_vc as views of the weight; a rank holds its heads' rows (split by heads, as the
  column-parallel q projection splits its output). A plain module: neither the CPU weight packing nor
  --quantization may replace the weight these views read.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from engine.distributed.parallel_state import get_tp_rank, get_tp_size
from engine.layers.linear import PackedWeight, linear_forward
from engine.model_loader.weight_utils import ShardId, set_weight_loader


class ReplicatedLinear(nn.Module):
    """y = x W^T + b with the whole W on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, quantizable: bool = True) -> None:
        """quantizable: False for a layer a quantized checkpoint keeps in float (a MoE router, as SGLang builds
        it without a quant config): loading never expects it quantized."""
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.quantizable = quantizable
        self.packed_weight: Optional[PackedWeight] = None
        # Values come from the weight loader (default: the checkpoint tensor as is).
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias: Optional[nn.Parameter] = (
            nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(x, self.weight, self.bias, self.packed_weight)


class LatentExpansion(nn.Module):
    """kv_b_proj's weight [heads * (nope_dim + v_dim), kv_lora_rank], this rank's heads' rows."""

    def __init__(self, total_heads: int, nope_dim: int, v_dim: int, kv_lora_rank: int) -> None:
        super().__init__()
        tp_size = get_tp_size()
        if total_heads % tp_size:
            raise ValueError(f"{total_heads} attention heads cannot be split over --tp-size {tp_size}")
        self.heads = total_heads // tp_size
        self.nope_dim, self.v_dim = nope_dim, v_dim
        self.tp_rank = get_tp_rank()
        self.weight = nn.Parameter(torch.empty(self.heads * (nope_dim + v_dim), kv_lora_rank), requires_grad=False)
        set_weight_loader(self.weight, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        rows = param.shape[0]
        piece = loaded_weight.narrow(0, self.tp_rank * rows, rows)
        if piece.shape != param.shape:
            raise ValueError(f"kv_b_proj: shape mismatch, parameter {tuple(param.shape)} vs checkpoint "
                             f"{tuple(loaded_weight.shape)} split over the TP ranks")
        param.data.copy_(piece)

    def halves(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(W_kc [heads, nope, kv_lora_rank], W_vc [heads, v, kv_lora_rank]), views of the weight."""
        w = self.weight.view(self.heads, self.nope_dim + self.v_dim, -1)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]
