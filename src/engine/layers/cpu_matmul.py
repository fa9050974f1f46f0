"""bf16 matmuls on CPUs without bf16 arithmetic.

torch's bf16 GEMM on the CPU is fast only where oneDNN has bf16 instructions (AVX512-BF16, AMX, or
the AVX-512 core it emulates them with). On an AVX2-only x86 (e.g. AMD EPYC Zen 1 / 2) a bf16
`F.linear` of a prefill's rows ran at about a fifth of the float32 rate of the same shape (2-core Zen
1, 3584 x 1024 weight: 512 rows 4.5-5.1 s against 0.9-1.2 s widened, 128 rows 0.9-1.6 s against
0.8-0.9 s, a busy machine; no gain under 64 rows). There, a bf16 product over many rows is computed
in float32: the weight is widened once per call, which costs a pass over the weight, small against
the GEMM's rows x weight multiply-adds; the sums were float32 in the bf16 GEMM too, and the result is
rounded to bf16 once as before.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F

# The fewest rows for which widening pays (see above).
BF16_WIDEN_MIN_ROWS = 128


@functools.lru_cache(maxsize=None)
def cpu_lacks_bf16_gemm() -> bool:
    """Whether torch's oneDNN has no bf16 kernels for this CPU (then it falls back to slow loops)."""
    return not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, weight, bias), in float32 where a bf16 GEMM of this many rows is slow (module doc)."""
    if (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu
            and x.numel() >= BF16_WIDEN_MIN_ROWS * x.shape[-1] and cpu_lacks_bf16_gemm()):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    return F.linear(x, weight, bias)
