"""The Triton 4-bit GEMM (layers/int4_triton.py) against the float64 product with the dequantized weight,
under TRITON_INTERPRET=1 on the CPU.

As in test_moe_triton.py, the interpreter must be on before triton is imported: the normal run collects
`test_int4_gemm_under_triton_interpreter`, which runs this file again in a subprocess with
TRITON_INTERPRET=1, where the cases below are collected. Tiny shapes: rows and channels ragged against
the blocks (16 or 32 rows, 32 channels), groups of 32 and 64, act-order, float32 and bfloat16."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# rows, channels, inputs, group size, act-order, dtype
CASES = [(1, 37, 64, 32, False, torch.float32), (5, 32, 128, 64, True, torch.float32),
         (19, 40, 64, 32, False, torch.bfloat16), (33, 8, 96, 32, True, torch.float32)]


@pytest.mark.slow  # the interpreter runs each program in Python
@pytest.mark.timeout(660)  # the subprocess's own limit, not the suite's 300 s per test
def test_int4_gemm_under_triton_interpreter():
    pytest.importorskip("triton")
    if _INTERPRETED:
        pytest.skip("already interpreted")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-k", "not under_triton_interpreter"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) == len(CASES), report
    assert "skipped" not in proc.stdout, report


@pytest.mark.skipif(not _INTERPRETED, reason="runs in the interpreter subprocess")
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_triton_int4_gemm_matches_dequantized_product(case):
    from engine.layers.int4 import HALF, pack_int4
    from engine.layers.int4_triton import int4_gemm

    m, n, k, group, act_order, dtype = case
    gen = torch.Generator().manual_seed(m * 7 + n)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zero = torch.randint(0, 16, (n, k // group), generator=gen).float()
    perm = torch.randperm(k, generator=gen) if act_order else None
    w = pack_int4(codes, scale, zero, group, perm, int8_activations=False)
    x = torch.randn(m, k, generator=gen).to(dtype)
    rows = x if perm is None else x.index_select(1, perm)
    out = int4_gemm(rows, w, HALF)
    expected = x.double() @ w.dequantize(torch.float64).T
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
