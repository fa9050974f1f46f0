"""MXFP4 weights (the OCP microscaling format gpt-oss's checkpoints hold their experts in).

A weight [n, k] is held as the checkpoint stores it: `blocks` [n, k / 32, 16] uint8, each byte two 4-bit
e2m1 codes (input 2j of the block in the low nibble, 2j + 1 in the high one), and `scales` [n, k / 32]
uint8, each an e8m0 exponent s, the block's scale 2^(s - 127): 4.25 bits per weight.

`mxfp4_linear` runs the native kernel (csrc/linear_mxfp4.c: the codes are decoded and scaled in registers)
where the library is built, else the reference: the weight dequantized (`dequantize_mxfp4`), then F.linear.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernels import library

# The 16 values of an e2m1 code (sign, 2 exponent bits, 1 mantissa bit).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
BITS_PER_WEIGHT = 4.25  # 4 of code + 8 of scale per 32 weights


def check_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    """ValueError unless blocks [..., groups, 16] and scales [..., groups] are uint8 and match."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if (blocks.dim() < 2 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape)):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"([..., groups, {MXFP4_BLOCK // 2}] and [..., groups])")


def dequantize_rows(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[..., rows, groups, 16] codes and [..., rows, groups] exponents -> [..., rows, groups * 32] float32."""
    check_mxfp4(blocks, scales)
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., groups, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, rows, cols / 32, 16] codes and [E, rows, cols / 32] exponents -> [E, cols, rows] float32 (the
    bf16 checkpoint's layout: the projection's input dimension first)."""
    if blocks.dim() != 4:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"([E, rows, groups, {MXFP4_BLOCK // 2}] and [E, rows, groups])")
    return dequantize_rows(blocks, scales).transpose(1, 2).contiguous()


def mxfp4_kernel_available() -> bool:
    """Whether the native kernel serves MXFP4 linears here (a CPU with the library built)."""
    return library.linear() is not None


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [R, k] -> [R, n] in x's dtype: x W^T (+ bias) for W [n, k] in MXFP4 (blocks [n, k / 32, 16], scales
    [n, k / 32]), summed in float32 and rounded once."""
    n, groups = scales.shape
    k = groups * MXFP4_BLOCK
    if x.dim() != 2 or x.shape[1] != k:  # the kernel would read past the rows
        raise ValueError(f"an MXFP4 linear of {k} inputs got rows of shape {tuple(x.shape)}")
    lib = library.linear()
    if lib is not None and x.is_cpu and blocks.is_contiguous() and scales.is_contiguous():
        rows = x.to(torch.float32).contiguous()
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        bias_f = None if bias is None else bias.to(torch.float32).contiguous()
        status = lib.linear_mxfp4(rows.data_ptr(), rows.shape[0], k, blocks.data_ptr(), scales.data_ptr(),
                                  None if bias_f is None else bias_f.data_ptr(), n, out.data_ptr(),
                                  torch.get_num_threads())
        if status == -1:
            raise MemoryError(f"linear_mxfp4: no scratch for {rows.shape[0]} rows of {k} activations")
        if status != 0:
            raise ValueError(f"linear_mxfp4 refused k {k}, n {n} (status {status})")
        return out.to(x.dtype)
    weight = dequantize_rows(blocks, scales)
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
