"""The 4-bit linear on the GPU: a Triton GEMM reading layers/int4.py's packed layout directly.

y [M, N] = x [M, K] W^T with W = code * scale + offset per group: one program per (block of rows, block of
output channels); each step of the reduction takes one 32-input block of the layout (16 bytes per
channel): the low nibbles are inputs 0-15 of the block and the high ones 16-31, dequantized in registers
with their group's scale and offset, then two products of 16 inputs each, float32 sums. Runs under
TRITON_INTERPRET=1 on the CPU (tests/unit/test_int4_triton.py compares it with the torch reference).
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl



@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, GROUPS, GROUP_SIZE,
                      stride_xm, stride_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HALF_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, HALF_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 2 * HALF_K):
        group = k0 // GROUP_SIZE
        s = tl.load(scale_ptr + cols * GROUPS + group, mask=col_ok, other=0.0)
        b = tl.load(bias_ptr + cols * GROUPS + group, mask=col_ok, other=0.0)
        # [HALF_K, BLOCK_N] bytes of this block: byte j of channel c is at c * K / 2 + k0 / 2 + j.
        packed = tl.load(w_ptr + cols[None, :] * (K // 2) + (k0 // 2 + half)[:, None], mask=col_ok[None, :],
                         other=0).to(tl.int32)
        w_lo = (packed & 0xF).to(tl.float32) * s[None, :] + b[None, :]
        w_hi = ((packed >> 4) & 0xF).to(tl.float32) * s[None, :] + b[None, :]
        x_lo = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + half)[None, :], mask=row_ok[:, None], other=0.0)
        x_hi = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + HALF_K + half)[None, :], mask=row_ok[:, None],
                       other=0.0)
        acc += tl.dot(x_lo.to(tl.float32), w_lo, input_precision="ieee")
        acc += tl.dot(x_hi.to(tl.float32), w_hi, input_precision="ieee")
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


class PackedInt4(Protocol):
    """What the kernel reads of an int4.Int4Weight (a protocol: int4.py imports this module)."""

    packed: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor
    group_size: int
    int8_activations: bool  # True: the CPU kernel's layout, which this kernel does not read

    @property
    def n(self) -> int: ...

    @property
    def k(self) -> int: ...


def int4_gemm(rows: torch.Tensor, w: PackedInt4, half: int) -> torch.Tensor:
    """rows [M, K] (inputs already in the weight's stored order) -> [M, N] in rows' dtype; `half`: the
    layout's bytes per block of inputs (int4.HALF)."""
    if w.int8_activations:
        raise ValueError("the Triton 4-bit GEMM reads the float activations' layout "
                         "(pack_int4(int8_activations=False))")
    m = rows.shape[0]
    rows = rows.contiguous()
    out = torch.empty(m, w.n, dtype=rows.dtype, device=rows.device)
    block_m = 16 if m <= 16 else 32
    block_n = 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(w.n, block_n))
    _int4_gemm_kernel[grid](rows, w.packed, w.scale, w.bias, out, m, w.n, w.k, w.k // w.group_size, w.group_size,
                            rows.stride(0), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, HALF_K=half)
    return out

