"""A block-wise fp8 linear weight (layers/block_fp8.py loads it) and its product.

W [n, k] float8 e4m3 with one float32 scale per [block_n, block_k] block (scale [ceil(n / bn), ceil(k / bk)],
the checkpoint's weight_scale_inv): W's block (i, j) times scale[i, j] is the real weight. On the CPU, batches
of up to `kernel_max_rows` rows take csrc/linear_q8.c's linear_fp8_block (the weight widened in registers,
each block's float32 sum scaled before it joins the output's), so a decode step reads one byte per weight;
longer batches, other devices and a CPU without the library dequantize the weight (float32 products, one
rounding to the activations' dtype) and take F.linear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from engine.kernels import library
from engine.layers.quantization import kernel_max_rows

SCALE_SUFFIX = "weight_scale_inv"


def block_grid(shape: Sequence[int], block: Tuple[int, int]) -> Tuple[int, int]:
    """The scale grid of a [out, in] weight: [ceil(out / block_n), ceil(in / block_k)]."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int],
                         dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """weight [n, k] e4m3 with scale_inv [ceil(n / bn), ceil(k / bk)] -> the [n, k] weight in `dtype`
    (each block's product computed in float32, then one rounding to dtype)."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: a block-quantized weight is 2-D, got shape {tuple(weight.shape)}")
    grid = block_grid(weight.shape, block)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"{name}: {SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, but a weight of shape "
                         f"{tuple(weight.shape)} in blocks of {list(block)} needs {list(grid)}")
    n, k = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return (weight.float() * scales).to(dtype)


@dataclass
class BlockFp8Weight:
    """A linear weight [n, k] in e4m3 with a float32 scale per [block_n, block_k] block."""

    qweight: torch.Tensor  # [n, k] float8_e4m3fn, contiguous
    scale: torch.Tensor  # [ceil(n / block_n), ceil(k / block_k)] float32, contiguous
    block: Tuple[int, int]

    @property
    def n(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def k(self) -> int:
        return int(self.qweight.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_block_fp8(self.qweight, self.scale, self.block, dtype)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scale.numel() * 4

    def to(self, device: str) -> "BlockFp8Weight":
        return BlockFp8Weight(self.qweight.to(device), self.scale.to(device), self.block)


def _kernel_usable(rows: torch.Tensor, w: BlockFp8Weight) -> bool:
    return (rows.is_cpu and w.qweight.is_cpu and rows.dtype in (torch.float32, torch.bfloat16)
            and rows.shape[0] <= kernel_max_rows(rows.dtype) and w.block[1] % 8 == 0)


def block_fp8_linear(x: torch.Tensor, w: BlockFp8Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x [..., k] -> [..., n] in x's dtype: x W^T (+ bias), W the block-scaled weight."""
    rows = x.reshape(-1, w.k)
    lib = library.linear()
    if lib is not None and _kernel_usable(rows, w):
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], w.n, dtype=rows.dtype)
        b = None if bias is None else bias.float().contiguous()  # added before the one rounding
        status = lib.linear_fp8_block(rows.data_ptr(), rows.shape[0], w.k, w.qweight.data_ptr(), w.scale.data_ptr(),
                                      w.block[0], w.block[1], None if b is None else b.data_ptr(), w.n,
                                      out.data_ptr(), int(rows.dtype == torch.bfloat16), torch.get_num_threads())
        if status != 0:
            raise MemoryError("linear_fp8_block: no memory for its scratch copy of the activations")
        return out.view(*x.shape[:-1], w.n)
    return F.linear(x, w.dequantize(x.dtype), None if bias is None else bias.to(x.dtype))
