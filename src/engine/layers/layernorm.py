"""RMSNorm, with the residual add fused in (the decoder layers pass the residual along)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import nn

from engine.kernels import ops as kernel_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if kernel_ops.usable(x, self.weight, *(() if residual is None else (residual,))):
            out, new_residual = kernel_ops.rms_norm(x, self.weight, self.variance_epsilon, residual)
            if residual is None:
                return out
            assert new_residual is not None  # rms_norm returns x + residual when given one
            return out, new_residual
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        # Statistics in float32 and the weight applied in the model dtype, as Hugging Face does,
        # so that low-precision outputs match the reference bit for bit where possible.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * h.to(orig_dtype)
        return out if residual is None else (out, residual)
