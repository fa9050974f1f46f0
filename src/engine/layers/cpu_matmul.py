"""bf16 matmuls on CPUs without bf16 arithmetic.

torch's bf16 GEMM on the CPU is fast only where oneDNN has bf16 instructions (AVX512-BF16, AMX, or
the AVX-512 core it emulates them with). On an AVX2-only x86 (e.g. AMD EPYC Zen 1 / 2) a bf16
`F.linear` of a prefill's rows ran at about a fifth of the float32 rate of the same shape (2-core Zen
1, 3584 x 1024 weight: 512 rows 4.5-5.1 s against 0.9-1.2 s widened, 128 rows 0.9-1.6 s against
0.8-0.9 s, a busy machine; no gain under 64 rows). There, a bf16 product over many rows is computed
in float32: the weight is widened once per call, which costs a pass over the weight, small against
the GEMM's rows x weight multiply-adds; the sums were float32 in the bf16 GEMM too, and the result is
rounded to bf16 once as before. Fewer rows take the kernel that widens the bf16 weight in registers
(kernels/linear.py linear_widened_bf16), where torch's bf16 product is far from the memory bandwidth;
the linears reach it through their packed weight (layers/linear.py), the experts of a MoE layer,
whose weights are slices of one tensor, through here.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernels import linear as linear_kernels

# The fewest rows for which widening pays (see above).
BF16_WIDEN_MIN_ROWS = 128


@functools.lru_cache(maxsize=None)
def cpu_lacks_bf16_gemm() -> bool:
    """Whether torch's oneDNN has no bf16 kernels for this CPU (then it falls back to slow loops)."""
    return not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), in float32 where a bf16 GEMM is slow (module doc)."""
    if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu and cpu_lacks_bf16_gemm():
        if x.numel() >= BF16_WIDEN_MIN_ROWS * x.shape[-1]:
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
        if linear_kernels.widened_bf16_usable(weight):
            out = linear_kernels.linear_widened_bf16(x, linear_kernels.WidenedBf16(weight), bias)
            if out is not None:
                return out
    return F.linear(x, weight, bias)
