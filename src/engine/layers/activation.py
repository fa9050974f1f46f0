"""Activations used by the gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import ops as kernel_ops


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused gate_up projection output of width 2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_ops.usable(x):
            return kernel_ops.silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
