"""Quantized linear weights: `--quantization w8a8_int8` and `fp8` applied online at load.

A decode step on a small batch reads every weight once, so its time is the weight bytes over the
memory bandwidth: one byte per weight instead of bf16's two. After the checkpoint is loaded (each TP
rank holding its own shard), every column- and row-parallel linear's weight is quantized per output
channel, symmetrically: `scale[c] = max |W[c, :]| / QMAX`, `q = round(W / scale)` (int8) or
`W / scale` cast to float8 e4m3 (fp8). The LM head and the embeddings stay in the model dtype, as
SGLang's default. A row-parallel shard's channels are scaled over its own input slice, which is at
least as accurate as slicing scales computed over the whole row (the partial sums are summed after
each rank applied its scales).

The layer keeps a `QuantizedWeight` where it kept its packed weight (`packed_weight`), and
`linear_forward` sends it here: on the CPU, batches of up to `kernel_max_rows` rows take the native
kernel (csrc/linear_q8.c: the weight widened to float32 in registers, float32 sums, the scale applied
once per output); larger batches (prefill), other devices and a CPU without the library take the
torch reference: the weight dequantized to the activation dtype, then `F.linear`.

`w8a8_int8` quantizes the activations too, as SGLang's: each row (token) symmetrically to int8 with its
own scale `max |x| / 127` (values rounded to nearest even), the int8 x int8 products summed exactly in
int32, then `* x_scale * w_scale`. On the CPU the kernel (csrc/linear_w8a8.c) does it with AVX2's byte
products (~2.4x the float kernel's rate per weight with one row on the 2-core Zen 1, ~1.2x at 16 rows),
AVX512-VNNI's vpdpbusd where the CPU has it, and AMX-INT8 tiles from 2 rows on a Xeon with AMX (2816 x
1024, one thread: 16 rows 0.23 ms against 0.95 on the vector path and 0.61 for bf16 through F.linear);
larger batches take the same arithmetic in torch (float32 sums of the same integer products).
ENGINE_W8A8_INT8_ACTIVATIONS=0 keeps the activations in float (weight-only int8; what this engine did
before), e.g. to compare a tensor-parallel run with a single rank exactly: a row-parallel shard quantizes
its own slice of each row, with its own scale. `fp8` keeps float activations.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import library

logger = logging.getLogger(__name__)

# SGLang's --quantization names that are applied to a bf16/fp16/fp32 checkpoint at load.
ONLINE_METHODS: Tuple[str, ...] = ("w8a8_int8", "fp8")
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Batches of up to this many rows take the native kernel; longer ones dequantize the weight once per
# call and take F.linear, whose GEMM amortises the dequantization. Measured on the 2-core Zen 1 (4096 x
# 4096 int8, a busy machine): with float32 activations the kernel took 0.4x the torch path's time at 64
# rows, 0.8x at 256 and 1.3x at 1024 (MKL's sgemm); with bf16 ones 0.2-0.25x from 64 to 1024 rows (F.linear
# has no bf16 instructions to use there). A CPU with AVX512-BF16 or AMX may want a lower bf16 bound.
Q8_MAX_ROWS_F32 = 256
Q8_MAX_ROWS_BF16 = 4096


@dataclass
class QuantizedWeight:
    """A linear weight [n, k] quantized per output channel: W ~= qweight * scale[:, None]."""

    method: str  # "w8a8_int8" or "fp8"
    qweight: torch.Tensor  # [n, k], int8 or float8_e4m3fn, contiguous
    scale: torch.Tensor  # [n] float32
    # int8 weights only: quantize each activation row to int8 as well (SGLang's w8a8_int8)
    int8_activations: bool = False

    @property
    def n(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def k(self) -> int:
        return int(self.qweight.shape[1])

    @property
    def is_fp8(self) -> bool:
        return self.qweight.dtype == torch.float8_e4m3fn

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the quantized one stands for, [n, k] in `dtype` (computed in float32)."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + self.scale.numel() * 4

    def to(self, device: str) -> "QuantizedWeight":
        return QuantizedWeight(self.method, self.qweight.to(device), self.scale.to(device), self.int8_activations)


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedWeight:
    """Symmetric per-output-channel quantization of a [n, k] weight (an all-zero row gets scale 1)."""
    if method not in ONLINE_METHODS:
        raise ValueError(f"unknown quantization method {method!r}; expected one of {', '.join(ONLINE_METHODS)}")
    if weight.dim() != 2:
        raise ValueError(f"a linear weight is 2-D, got shape {tuple(weight.shape)}")
    w = weight.detach().float()
    qmax = INT8_MAX if method == "w8a8_int8" else FP8_E4M3_MAX
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    scaled = w / scale[:, None]
    if method == "w8a8_int8":
        q = scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    else:
        q = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(method, q.contiguous(), scale.contiguous(),
                           int8_activations=method == "w8a8_int8" and int8_activations_enabled())


def int8_activations_enabled() -> bool:
    """Whether `w8a8_int8` quantizes the activations (ENGINE_W8A8_INT8_ACTIVATIONS, default on)."""
    return os.environ.get("ENGINE_W8A8_INT8_ACTIVATIONS", "1") != "0"


def quantize_activations(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 of rows [m, k]: (the int8 values as float32 [m, k], their scales [m, 1] float32),
    rows ~= values * scales. The same correctly rounded float32 operations as csrc/linear_q8.c's quantize_row,
    so the same values and scales (a Python number divided by a tensor is not one: torch multiplies by a
    reciprocal there, which moves values that land near a rounding tie)."""
    x = rows.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-10)
    qmax = torch.full_like(amax, INT8_MAX)
    values = (x * (qmax / amax)).round().clamp(-INT8_MAX, INT8_MAX)
    return values, amax / qmax


def kernel_max_rows(dtype: torch.dtype) -> int:
    return Q8_MAX_ROWS_F32 if dtype == torch.float32 else Q8_MAX_ROWS_BF16


def quantized_linear(x: torch.Tensor, qw: QuantizedWeight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., k] -> [..., n] in x's dtype: x (W ~ qweight * scale)^T (+ bias); with int8_activations, x
    quantized per row first (quantize_activations)."""
    # A decode step makes 4 of these calls a layer and each torch op costs microseconds here (a reshape, a view,
    # an empty x_scale for scales nobody reads), so the kernel's path makes only the ones it needs: on the
    # 2-core Zen 1, one thread, a call around a 6 us kernel (one row, 8 channels) took 42 us, now 19.
    weight = qw.qweight
    n, k = weight.shape
    if x.shape[-1] != k:  # the kernel would read past the rows
        raise ValueError(f"a linear of {k} inputs got rows of {x.shape[-1]}")
    rows = x if x.dim() == 2 else x.reshape(-1, k)
    lib = library.linear()
    if (lib is not None and rows.is_cpu and weight.is_cpu and rows.shape[0] <= kernel_max_rows(rows.dtype)
            and rows.dtype in (torch.float32, torch.bfloat16)):
        if not rows.is_contiguous():
            rows = rows.contiguous()
        m = rows.shape[0]
        out = torch.empty(m, n, dtype=rows.dtype)
        dtype = int(rows.dtype == torch.bfloat16)
        b = None if bias is None else bias.float().contiguous()  # added before the one rounding
        b_ptr = None if b is None else b.data_ptr()
        if qw.int8_activations:  # x's scales stay in the kernel's scratch (x_scale NULL)
            status = lib.linear_w8a8(rows.data_ptr(), m, k, weight.data_ptr(), qw.scale.data_ptr(), b_ptr, n,
                                     out.data_ptr(), dtype, None, torch.get_num_threads())
        else:
            status = lib.linear_q8(rows.data_ptr(), m, k, weight.data_ptr(), int(qw.is_fp8), qw.scale.data_ptr(),
                                   b_ptr, n, out.data_ptr(), dtype, torch.get_num_threads())
        if status != 0:
            raise MemoryError("linear kernel: no memory for its scratch copy of the activations")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)
    if qw.int8_activations:
        values, x_scale = quantize_activations(rows)
        out = values @ qw.qweight.float().T * x_scale * qw.scale
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], qw.n)
    return F.linear(x, qw.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))
