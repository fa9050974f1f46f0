"""Activations used by the gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers import cpu_ops


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused gate_up projection output of width 2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_ops.usable(x):
            return cpu_ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
