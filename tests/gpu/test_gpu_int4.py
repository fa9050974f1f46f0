"""The 4-bit linear on a CUDA GPU: the compiled Triton GEMM (layers/int4_triton.py) at serving-like
shapes, and int4_linear's device path, against the float64 product with the dequantized weight."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _weight(n: int, k: int, group: int, act_order: bool, seed: int):
    from engine.layers.int4 import pack_int4

    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.002
    zero = torch.randint(0, 16, (n, k // group), generator=gen).float()
    perm = torch.randperm(k, generator=gen) if act_order else None
    return pack_int4(codes, scale, zero, group, perm).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 7, 16, 128, 1000])
@pytest.mark.parametrize("group, act_order", [(128, False), (64, True), (32, False)])
def test_int4_linear_gpu(rows: int, group: int, act_order: bool, dtype: torch.dtype) -> None:
    from engine.layers.int4 import int4_linear

    w = _weight(1000, 2048, group, act_order, rows + group)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2048, generator=gen).to(dtype).to(DEV)
    bias = torch.randn(1000, generator=gen).to(dtype).to(DEV)
    out = int4_linear(x, w, bias)
    expected = x.double() @ w.dequantize(torch.float64).T + bias.double()
    assert out.dtype == dtype and out.shape == (rows, 1000) and out.is_cuda
    rel = ((out.double() - expected).norm() / expected.norm()).item()
    assert rel < TOL[dtype], rel
