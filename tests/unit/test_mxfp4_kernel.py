"""The MXFP4 linear kernel (csrc/linear_mxfp4.c via layers/mxfp4.py) against dequantize_mxfp4 and a float
matmul: each weight decoded exactly (one-hot rows read the weight back bit for bit), products at decode and
prefill sizes within float32 rounding, the bias, ragged tiles (rows not a multiple of 4, an odd number of
channels), the e8m0 extremes (s = 0: 2^-127, a subnormal) and the refusals."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import library
from engine.layers.mxfp4 import dequantize_rows, mxfp4_kernel_available, mxfp4_linear


def _weight(n: int, k: int, seed: int, low: int = 115, high: int = 135):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 32, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(low, high, (n, k // 32), dtype=torch.uint8, generator=gen)
    return blocks, scales


@pytest.fixture(autouse=True)
def _kernel():
    if not mxfp4_kernel_available():
        pytest.skip("no native kernel library here (no C compiler)")


@pytest.mark.parametrize("n,k", [(7, 32), (64, 96), (33, 2880)])
def test_one_hot_rows_read_every_weight_exactly(n, k):
    blocks, scales = _weight(n, k, seed=n + k)
    scales[0, 0] = 0  # 2^-127: a subnormal scale
    scales[-1, -1] = 252  # 2^125: 6 * 2^125 still finite
    eye = torch.eye(k)
    assert torch.equal(mxfp4_linear(eye, blocks, scales), dequantize_rows(blocks, scales).T)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 16, 37, 130])
@pytest.mark.parametrize("n,k", [(1, 64), (45, 320), (46, 32), (47, 64), (96, 2880)])
def test_products_equal_dequantize_and_matmul(m, n, k):
    blocks, scales = _weight(n, k, seed=m * 7 + n)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    weight = dequantize_rows(blocks, scales).double()
    ref = x.double() @ weight.T + bias.double()
    ours = mxfp4_linear(x, blocks, scales, bias)
    assert ours.dtype == torch.float32 and ours.shape == (m, n)
    # float32 sums in another order: bounded by the sum of the products' (and the bias's) magnitudes.
    bound = 1e-6 * (x.double().abs() @ weight.abs().T + bias.double().abs()) + 1e-30
    assert bool(((ours.double() - ref).abs() <= 4 * bound + 1e-6 * bound.max()).all())
    no_bias = mxfp4_linear(x, blocks, scales)
    assert torch.allclose(no_bias + bias, ours, rtol=0, atol=1e-5 * float(ref.abs().max()))


def test_bf16_rows_give_bf16_and_empty_batches_work():
    blocks, scales = _weight(16, 64, seed=3)
    x = torch.randn(5, 64).to(torch.bfloat16)
    out = mxfp4_linear(x, blocks, scales)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, mxfp4_linear(x.float(), blocks, scales).to(torch.bfloat16))
    assert mxfp4_linear(torch.empty(0, 64), blocks, scales).shape == (0, 16)


def test_refusals():
    blocks, scales = _weight(8, 64, seed=5)
    with pytest.raises(ValueError, match="64 inputs got rows"):
        mxfp4_linear(torch.zeros(2, 32), blocks, scales)
    lib = library.linear()
    assert lib is not None
    out = torch.zeros(1, 8)
    x = torch.zeros(1, 40)
    assert lib.linear_mxfp4(x.data_ptr(), 1, 40, blocks.data_ptr(), scales.data_ptr(), None, 8, out.data_ptr(), 1) == -2


def test_portable_loop_equals_the_avx2_path(tmp_path):
    """The kernel's portable loop (a CPU without AVX2 + FMA + F16C), built here alone with those switched off,
    gives the AVX2 path's products (float32 sums in another order)."""
    import ctypes
    import shutil
    import subprocess
    from pathlib import Path

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    csrc = Path(library.__file__).with_name("csrc")
    out = tmp_path / "mxfp4_portable.so"
    subprocess.run([compiler, "-O2", "-fPIC", "-shared", "-std=c11", "-pthread", "-mno-avx2", "-mno-fma",
                    "-mno-f16c", "-mno-avx512f", str(csrc / "linear_mxfp4.c"), str(csrc / "thread_pool.c"),
                    "-o", str(out)], check=True, timeout=120)
    lib = ctypes.CDLL(str(out))
    lib.linear_mxfp4.restype = ctypes.c_int
    lib.linear_mxfp4.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    blocks, scales = _weight(9, 96, seed=11)
    bias = torch.randn(9)
    for m in (1, 6):
        x = torch.randn(m, 96)
        ours = torch.empty(m, 9)
        assert lib.linear_mxfp4(x.data_ptr(), m, 96, blocks.data_ptr(), scales.data_ptr(), bias.data_ptr(), 9,
                                ours.data_ptr(), 1) == 0
        ref = mxfp4_linear(x, blocks, scales, bias)
        assert torch.allclose(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    eye = torch.eye(96)
    ours = torch.empty(96, 9)
    lib.linear_mxfp4(eye.data_ptr(), 96, 96, blocks.data_ptr(), scales.data_ptr(), None, 9, ours.data_ptr(), 1)
    assert torch.equal(ours, dequantize_rows(blocks, scales).T)
