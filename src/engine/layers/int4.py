"""4-bit weight-only linears: AWQ and GPTQ checkpoints, repacked at load into one layout of our own.

A weight [n, k] is held as unsigned 4-bit codes q in groups of `group_size` consecutive inputs of each
output row, with a float32 scale s and offset b = -zero * s per (row, group): W = q * s + b, the
checkpoint's (q - zero) * s. Two layouts, one per kernel (csrc/linear_q4.c):
- float activations (linear_q4, the Triton GEMM): codes packed two per byte in blocks of 32 inputs of a row,
  byte j of a block holding input j in its low nibble and input j + 16 in its high one (a 16-byte load and
  two masks give 32 weights in input order); scale and offset [n, k / group_size].
- int8 activations (linear_w4a8, the CPU's default): the rows in blocks of 16 (padded with zero codes,
  scales and offsets), a block's codes as k / 8 steps of 64 bytes whose lane c (4 bytes) holds row c's
  inputs 8j + i (low nibble of byte i) and 8j + 4 + i (high nibble): one 64-byte load is 16 rows x 8 inputs
  for the byte products of 4 broadcast activations; scale and offset [blocks, k / group_size, 16].
`scales()`, `offsets()` and `codes()` give either layout as [n, ...] in row order.

GPTQ's act-order (desc_act) assigns inputs to groups in a permuted order (g_idx): the loader sorts the
inputs by group, so every group is again `group_size` consecutive columns, and keeps the permutation
(`perm`): the activations are gathered in that order before the product.

`int4_linear` takes the native kernel on the CPU for batches up to `kernel_max_rows` (decode), the Triton
GEMM on a GPU (layers/int4_triton.py), else (longer CPU batches, no library, no triton) the torch
reference: the weight dequantized to the activation dtype, then `F.linear`.

On the CPU the activations are quantized to int8 as well, per row and weight group (`q = round(x * 127 /
max |x|)` over the group), as SGLang's CPU AWQ / GPTQ kernel (sgl-kernel's int4_scaled_mm_cpu, W4A8) and
torchao's da8w4 quantize them (per row there) and llama.cpp's Q4 x Q8 products do: the codes times q_x are
summed exactly in integers (csrc/linear_q4.c's linear_w4a8: AVX512-VNNI, AVX2 or AMX-INT8 byte products instead
of widening every code to float), then scaled per group; the offsets' term keeps the float activations.
ENGINE_INT4_INT8_ACTIVATIONS=0 keeps float activations (linear_q4). The GPU's Triton GEMM takes float activations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from engine.kernels import library
from engine.layers.quantization import kernel_max_rows, quantize_activations

BLOCK = 32  # inputs per 16-byte block of the float activations' layout
HALF = BLOCK // 2
LANES = 16  # rows per block of the int8 activations' layout
STEP = 8  # inputs per 64-byte step of a block there


@dataclass
class Int4Weight:
    """A linear weight [n, k] of 4-bit codes with per-group scales and offsets (the layouts above)."""

    packed: torch.Tensor  # float activations: [n, k // 2] uint8; int8 activations: [blocks, k // 8, 64]
    scale: torch.Tensor  # float32 [n, k // group_size]; int8 activations: [blocks, k // group_size, LANES]
    bias: torch.Tensor  # -zero * scale, as scale
    group_size: int
    perm: Optional[torch.Tensor]  # [k] int64: stored column j is input perm[j] (act-order); None: identity
    int8_activations: bool  # on the CPU unless ENGINE_INT4_INT8_ACTIVATIONS=0 (the module's docstring): the layout
    n: int
    k: int

    def codes(self) -> torch.Tensor:
        """The codes [n, k] uint8 in stored (group-sorted) input order."""
        if self.int8_activations:
            lanes = self.packed.view(-1, self.k // STEP, LANES, 4).transpose(1, 2)  # [blocks, lane, step, byte]
            return torch.cat([lanes & 0xF, lanes >> 4], dim=3).reshape(-1, self.k)[:self.n]
        blocks = self.packed.view(self.n, self.k // BLOCK, HALF)
        return torch.cat([blocks & 0xF, blocks >> 4], dim=2).view(self.n, self.k)

    def scales(self) -> torch.Tensor:
        """The scales [n, k / group_size] float32."""
        return _rows(self.scale, self.n) if self.int8_activations else self.scale

    def offsets(self) -> torch.Tensor:
        """The offsets (-zero * scale) [n, k / group_size] float32."""
        return _rows(self.bias, self.n) if self.int8_activations else self.bias

    def _stored(self, dtype: torch.dtype) -> torch.Tensor:
        scale = self.scales().repeat_interleave(self.group_size, dim=1)
        bias = self.offsets().repeat_interleave(self.group_size, dim=1)
        return (self.codes().float() * scale + bias).to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the codes stand for, [n, k] in the checkpoint's input order (computed in float32)."""
        stored = self._stored(dtype)
        if self.perm is None:
            return stored
        return stored[:, torch.argsort(self.perm)]

    def nbytes(self) -> int:
        return (self.packed.numel() + 4 * (self.scale.numel() + self.bias.numel())
                + (0 if self.perm is None else 8 * self.perm.numel()))

    def to(self, device: str) -> "Int4Weight":
        """On `device`; off the CPU in the float activations' layout (int8 activations are a CPU kernel's)."""
        if self.int8_activations and torch.device(device).type != "cpu":
            return _packed(self.codes(), self.scales(), self.offsets(), self.group_size, self.perm, False).to(device)
        return Int4Weight(self.packed.to(device), self.scale.to(device), self.bias.to(device), self.group_size,
                          None if self.perm is None else self.perm.to(device), self.int8_activations, self.n, self.k)


def _rows(lanes: torch.Tensor, n: int) -> torch.Tensor:
    """[blocks, groups, LANES] -> [n, groups]."""
    return lanes.transpose(1, 2).reshape(-1, lanes.shape[1])[:n]


def _lanes(rows: torch.Tensor) -> torch.Tensor:
    """[n, groups] -> [blocks, groups, LANES], the rows past n zero."""
    n, groups = rows.shape
    padded = torch.zeros(-(-n // LANES) * LANES, groups, dtype=rows.dtype, device=rows.device)
    padded[:n] = rows
    return padded.view(-1, LANES, groups).transpose(1, 2).contiguous()


def _packed(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, group_size: int,
            perm: Optional[torch.Tensor], int8_activations: bool) -> Int4Weight:
    """Int4Weight in the layout of its activations from codes [n, k] (0..15), scale and bias [n, groups]."""
    n, k = codes.shape
    codes = codes.to(torch.uint8)
    if int8_activations:
        padded = torch.zeros(-(-n // LANES) * LANES, k, dtype=torch.uint8, device=codes.device)
        padded[:n] = codes
        steps = padded.view(-1, LANES, k // STEP, 2, 4)  # [block, lane, step, low / high nibble, byte]
        packed = (steps[:, :, :, 0] | (steps[:, :, :, 1] << 4)).transpose(1, 2).reshape(-1, k // STEP, 64)
        return Int4Weight(packed.contiguous(), _lanes(scale), _lanes(bias), group_size, perm, True, n, k)
    blocks = codes.reshape(n, k // BLOCK, 2, HALF)
    packed = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    return Int4Weight(packed, scale.contiguous(), bias.contiguous(), group_size, perm, False, n, k)


def pack_int4(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              perm: Optional[torch.Tensor] = None, int8_activations: Optional[bool] = None) -> Int4Weight:
    """Int4Weight from codes [n, k] (0..15, stored order), scale and zero [n, k / group_size]; int8_activations
    None: on CPU tensors as ENGINE_INT4_INT8_ACTIVATIONS says, never elsewhere."""
    if codes.dim() != 2:
        raise ValueError(f"4-bit codes are 2-D [out, in], got shape {tuple(codes.shape)}")
    n, k = codes.shape
    if group_size % BLOCK != 0 or k % group_size != 0:
        raise ValueError(f"4-bit weights need a group size that is a multiple of {BLOCK} and divides the layer's "
                         f"{k} inputs (this rank's shard), got {group_size}")
    groups = k // group_size
    for name, t in (("scale", scale), ("zero", zero)):
        if tuple(t.shape) != (n, groups):
            raise ValueError(f"4-bit weight [{n}, {k}] in groups of {group_size}: its {name}s must be [{n}, {groups}], "
                             f"got {tuple(t.shape)}")
    if int(codes.min()) < 0 or int(codes.max()) > 15:
        raise ValueError("4-bit codes must lie in 0..15")
    if perm is not None and tuple(perm.shape) != (k,):
        raise ValueError(f"an input permutation of a [{n}, {k}] weight has {k} entries, got {tuple(perm.shape)}")
    if int8_activations is None:
        int8_activations = codes.is_cpu and int4_int8_activations_enabled()
    scale32 = scale.float()
    return _packed(codes, scale32, -zero.float() * scale32, group_size,
                   None if perm is None else perm.to(torch.int64).contiguous(), int8_activations)


def int4_int8_activations_enabled() -> bool:
    """Whether 4-bit linears quantize their activations to int8 on the CPU (ENGINE_INT4_INT8_ACTIVATIONS, default
    on, as SGLang's CPU W4A8 kernel)."""
    return os.environ.get("ENGINE_INT4_INT8_ACTIVATIONS", "1") != "0"


def int8_group_activations(rows: torch.Tensor, group_size: int) -> torch.Tensor:
    """rows [m, k] as linear_w4a8 sees them: each group of `group_size` inputs quantized to int8 with its own
    scale (quantization.quantize_activations' float32 operations), dequantized back to float32."""
    m, k = rows.shape
    values, scales = quantize_activations(rows.reshape(m * (k // group_size), group_size))
    return (values * scales).view(m, k)


def _kernel_usable(rows: torch.Tensor, w: Int4Weight) -> bool:
    return rows.is_cpu and w.packed.is_cpu and rows.shape[0] <= kernel_max_rows(rows.dtype)


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., k] -> [..., n] in x's dtype: x W^T (+ bias), W the dequantized weight."""
    rows = x.reshape(-1, w.k)
    if w.perm is not None:
        rows = rows.index_select(1, w.perm.to(rows.device))
    lib = library.linear()
    if lib is not None and _kernel_usable(rows, w):
        xf = rows.float().contiguous()
        out = torch.empty(rows.shape[0], w.n, dtype=torch.float32)
        args = (xf.data_ptr(), rows.shape[0], w.k, w.packed.data_ptr(), w.scale.data_ptr(), w.bias.data_ptr(),
                w.group_size, w.n, out.data_ptr(), torch.get_num_threads())
        if not w.int8_activations:
            lib.linear_q4(*args)
        elif lib.linear_w4a8(*args) != 0:
            raise MemoryError("linear kernel: no memory for its int8 copy of the activations")
        if bias is not None:
            out += bias.float()  # before the one rounding to x's dtype, as F.linear's
        return out.to(x.dtype).view(*x.shape[:-1], w.n)
    if rows.is_cuda and _triton_available():
        # Imported on the GPU only: triton is a GPU dependency.
        from engine.layers.int4_triton import int4_gemm

        out = int4_gemm(rows, w, HALF)
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.view(*x.shape[:-1], w.n)
    if w.int8_activations:  # the kernel's arithmetic: int8 activations times the codes' term, float ones the offsets'
        codes_term = (w.codes().float() * w.scales().repeat_interleave(w.group_size, dim=1))
        offsets = w.offsets().repeat_interleave(w.group_size, dim=1)
        xf = rows.float()
        out = F.linear(int8_group_activations(xf, w.group_size), codes_term) + F.linear(xf, offsets)
        if bias is not None:
            out += bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], w.n)
    out = F.linear(rows, w._stored(x.dtype), None if bias is None else bias.to(x.dtype))
    return out.view(*x.shape[:-1], w.n)


def _triton_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
