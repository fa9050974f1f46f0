"""The Triton fused-MoE kernel (layers/moe/fused_moe_triton.py) against the torch path, under
TRITON_INTERPRET=1 on the CPU.

As in test_triton_kernels.py, the interpreter can only be switched on for a whole process before
triton is imported: the normal run collects `test_fused_moe_under_triton_interpreter`, which runs this
file again in a subprocess with TRITON_INTERPRET=1, where the cases below are collected. Tiny shapes,
tiny blocks (so that rows, columns and the reduction dimension span several blocks and end ragged),
float32 and bfloat16, slots of other EP ranks, a batch with no token for some experts; and gpt-oss's
experts (OSS_CASES): biases, the clamped SwiGLU on interleaved gate/up rows, weights as transposed views of
the checkpoint's layout (strides, not copies).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

CASES = [
    # tokens, experts, top_k, hidden, inter, dtype, block sizes (M, N, K), EP slots dropped
    (1, 4, 2, 16, 8, torch.float32, (4, 8, 8), False),
    (7, 8, 2, 24, 12, torch.float32, (4, 16, 8), False),
    (19, 6, 3, 20, 10, torch.float32, (8, 8, 16), True),
    (5, 8, 2, 32, 16, torch.bfloat16, (4, 16, 16), False),
    (12, 4, 2, 16, 8, torch.bfloat16, (16, 16, 16), True),
]
_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
OSS_CASES = [
    # tokens, experts, top_k, hidden, inter, dtype, block sizes (M, N, K), EP slots dropped
    (3, 4, 2, 16, 8, torch.float32, (4, 8, 8), False),
    (13, 8, 4, 24, 12, torch.float32, (8, 16, 8), True),
    (6, 4, 2, 32, 16, torch.bfloat16, (4, 16, 16), False),
]


@pytest.mark.slow  # the interpreter runs the kernel per program in Python: tens of seconds on 2 cores
@pytest.mark.timeout(660)  # the subprocess's own limit, not the suite's 300 s per test
def test_fused_moe_under_triton_interpreter():
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
    assert passed is not None and int(passed.group(1)) == len(CASES) + len(OSS_CASES), report
    assert "skipped" not in proc.stdout, report


@pytest.mark.skipif(not _INTERPRETED, reason="runs in the interpreter subprocess")
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_triton_matches_native(case):
    from engine.layers.moe.fused_moe_native import fused_moe_native
    from engine.layers.moe.fused_moe_triton import fused_moe_triton
    from engine.layers.moe.router import select_experts

    tokens, experts, top_k, hidden, inter, dtype, (bm, bn, bk), drop = case
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 0] -= 100.0  # expert 0 gets no token
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if drop:  # EP: the slots of experts 1 and 2 live on another rank
        ids = torch.where((ids == 1) | (ids == 2), torch.full_like(ids, -1), ids)
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    ours = fused_moe_triton(x, w13, w2, weights, ids, config)
    ref = fused_moe_native(x.float(), w13.float(), w2.float(), weights, ids)
    assert ours.dtype == dtype and ours.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    assert (ours.float() - ref).abs().max().item() < _TOL[dtype] * scale


@pytest.mark.skipif(not _INTERPRETED, reason="runs in the interpreter subprocess")
@pytest.mark.parametrize("case", OSS_CASES, ids=[f"oss{i}" for i in range(len(OSS_CASES))])
def test_triton_matches_native_for_gpt_oss_experts(case):
    from engine.layers.moe.fused_moe_native import ClampedSwiGLU, fused_moe_native
    from engine.layers.moe.fused_moe_triton import fused_moe_triton
    from engine.layers.moe.router import select_experts

    tokens, experts, top_k, hidden, inter, dtype, (bm, bn, bk), drop = case
    gen = torch.Generator().manual_seed(tokens * 17 + experts)
    x = (2 * torch.randn(tokens, hidden, generator=gen)).to(dtype)
    # The checkpoint's layouts [E, H, 2I] and [E, I, H], read through transposed views.
    gate_up = (3 * torch.randn(experts, hidden, 2 * inter, generator=gen) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, inter, hidden, generator=gen) / inter**0.5).to(dtype)
    w13, w2 = gate_up.transpose(1, 2), down.transpose(1, 2)
    b13 = torch.randn(experts, 2 * inter, generator=gen).to(dtype)
    b2 = torch.randn(experts, hidden, generator=gen).to(dtype)
    activation = ClampedSwiGLU(alpha=1.702, limit=2.0)  # a low limit: the clamps bind
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    if drop:
        ids = torch.where(ids == 1, torch.full_like(ids, -1), ids)
    config = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}
    ours = fused_moe_triton(x, w13, w2, weights, ids, config, w13_bias=b13, w2_bias=b2, activation=activation)
    ref = fused_moe_native(x.float(), w13.float(), w2.float(), weights, ids, b13.float(), b2.float(), activation)
    assert ours.dtype == dtype and ours.shape == ref.shape
    scale = max(1.0, ref.abs().max().item())
    assert (ours.float() - ref).abs().max().item() < _TOL[dtype] * scale
