"""Quantized linears (--quantization w8a8_int8 / fp8, layers/quantization.py, csrc/linear_q8.c).

Oracle: the float64 product of the activations with the dequantized weight (qweight * scale), so the
only difference allowed is float32 summation order."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import library
from engine.layers import quantization as quant
from engine.layers.quantization import QuantizedWeight, quantize_weight, quantized_linear

METHODS = ["w8a8_int8", "fp8"]


def _oracle(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ (qw.qweight.double() * qw.scale.double()[:, None]).T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("method", METHODS)
def test_quantize_weight_per_channel(method: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(33, 70, generator=gen) * torch.linspace(0.01, 5.0, 33)[:, None]
    w[5] = 0.0  # an all-zero channel: scale 1, zeros
    qw = quantize_weight(w, method)
    assert qw.qweight.dtype == (torch.int8 if method == "w8a8_int8" else torch.float8_e4m3fn)
    assert qw.scale.shape == (33,) and qw.scale[5] == 1.0 and qw.dequantize()[5].abs().max() == 0
    amax = w.abs().amax(dim=1)
    qmax = 127.0 if method == "w8a8_int8" else 448.0
    nonzero = amax > 0
    assert torch.allclose(qw.scale[nonzero], amax[nonzero] / qmax)
    # The largest element of each channel lands on the format's largest value.
    assert torch.equal(qw.qweight.float().abs().amax(dim=1)[nonzero], torch.full((32,), qmax))
    err = (qw.dequantize() - w).abs()
    # int8: half a step of the channel's scale; e4m3: 3 mantissa bits, half an ulp is 1/16 relative.
    bound = qw.scale[:, None] * 0.5 + 1e-7 if method == "w8a8_int8" else w.abs() / 16 + qw.scale[:, None] * 2.0 ** -10
    assert bool((err <= bound).all())


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, quant.Q8_MAX_ROWS, quant.Q8_MAX_ROWS + 3])
def test_quantized_linear_equals_dequantized_product(kernel_build: str, method: str, rows: int) -> None:
    # k = 203: whole 8-wide vectors plus a tail of 3; n = 37: channel pairs plus one.
    gen = torch.Generator().manual_seed(rows)
    qw = quantize_weight(torch.randn(37, 203, generator=gen), method)
    bias = torch.randn(37, generator=gen)
    x = torch.randn(rows, 203, generator=gen)
    for b in (None, bias):
        out = quantized_linear(x, qw, b)
        assert out.dtype == torch.float32 and out.shape == (rows, 37)
        torch.testing.assert_close(out.double(), _oracle(x, qw, b), rtol=1e-5, atol=1e-5)
    # bf16 activations: the kernel (decode) rounds the float32 product once to bf16; the torch path
    # (prefill) multiplies by the weight dequantized to bf16, then rounds once.
    xb = x.to(torch.bfloat16).reshape(1, rows, 203)
    out = quantized_linear(xb, qw, bias.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 37)
    weight = qw.dequantize(torch.float64) if rows <= quant.Q8_MAX_ROWS else qw.dequantize(torch.bfloat16).double()
    expected = xb[0].double() @ weight.T + bias.to(torch.bfloat16).double()
    err = (out[0].double() - expected).abs()
    assert bool((err <= expected.abs() * 2.0 ** -8 + 1e-3).all()), float(err.max())


def test_kernel_runs_where_it_should() -> None:
    if library.linear() is None:
        pytest.skip("no kernel library on this machine")
    qw = quantize_weight(torch.randn(16, 64), "w8a8_int8")
    calls = []
    real = library.linear()

    class Spy:
        def linear_q8(self, *args: int) -> None:
            calls.append(args[1])
            real.linear_q8(*args)

    import unittest.mock as mock

    with mock.patch.object(library, "linear", lambda: Spy()):
        quantized_linear(torch.randn(3, 64), qw, None)
        quantized_linear(torch.randn(quant.Q8_MAX_ROWS + 1, 64), qw, None)  # prefill: the torch path
    assert calls == [3]


def test_fp8_kernel_widens_every_e4m3_value(kernel_build: str) -> None:
    """Every finite e4m3 byte (normals, subnormals, both zeros) as a weight, each alone in its channel."""
    values = torch.arange(256, dtype=torch.uint8)
    finite = values[(values & 0x7F) != 0x7F]
    q = finite.view(torch.float8_e4m3fn)
    k = 11  # one vector of 8 and a scalar tail of 3: both widening paths
    for col in (0, 9):  # in the vector part, in the tail
        qweight = torch.zeros(len(q), k, dtype=torch.float8_e4m3fn)
        qweight[:, col] = q
        qw = QuantizedWeight("fp8", qweight, torch.ones(len(q)))
        x = torch.zeros(1, k)
        x[0, col] = 1.0
        out = quantized_linear(x, qw, None)
        assert torch.equal(out[0], q.float()), col


def test_quantize_weight_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown quantization method"):
        quantize_weight(torch.randn(4, 4), "awq")
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight(torch.randn(4), "fp8")
