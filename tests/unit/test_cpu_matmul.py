"""dense_linear: bf16 products of many rows computed in float32 where the CPU has no bf16 GEMM."""

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.linear import WidenedBf16, linear_widened_bf16, widened_bf16_usable
from engine.layers import cpu_matmul
from engine.layers.cpu_matmul import BF16_WIDEN_MIN_ROWS, dense_linear


@pytest.mark.parametrize("lacks", [True, False])
@pytest.mark.parametrize("rows", [1, BF16_WIDEN_MIN_ROWS - 1, BF16_WIDEN_MIN_ROWS, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_equals_the_float32_product_rounded_once(monkeypatch, lacks, rows, bias):
    monkeypatch.setattr(cpu_matmul, "cpu_lacks_bf16_gemm", lambda: lacks)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(80, 96, generator=gen).bfloat16()
    b = torch.randn(80, generator=gen).bfloat16() if bias else None
    out = dense_linear(x, w, b)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 80)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    # One rounding to bf16 of a float32 sum: within one bf16 ulp of the exact product (plus the
    # float32 sums' error, far smaller).
    assert torch.allclose(out.double(), exact, rtol=2 ** -7, atol=1e-3)
    if lacks and rows >= BF16_WIDEN_MIN_ROWS:
        widened = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
        assert torch.equal(out, widened)  # the widened path was taken
    elif lacks and widened_bf16_usable(w):
        assert torch.equal(out, linear_widened_bf16(x, WidenedBf16(w), b))  # the widening kernel took it


def test_dense_linear_leaves_other_dtypes_alone(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "cpu_lacks_bf16_gemm", lambda: True)
    x, w = torch.randn(200, 16), torch.randn(8, 16)
    assert torch.equal(dense_linear(x, w), F.linear(x, w))
