"""The Triton attention backend over an fp8 KV pool (--kv-cache-dtype fp8_e5m2 / fp8_e4m3), on the CPU
under TRITON_INTERPRET=1 (run in a subprocess, as tests/unit/test_triton_kernels.py explains).

Oracle: the torch_native backend over the same pool (itself checked against float64 attention over the
fp8-rounded K/V in test_fp8_kv_cache.py): decode, extend with and without a cached prefix, a MIXED
batch, page sizes 1 and 16, per-layer scales that are not 1, a sliding window, and the hybrid SWA
pool's slot map.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend
from engine.layers.radix_attention import RadixAttention
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode

_EXPECTED_CASES = 8 + 2 + 1


@pytest.mark.slow  # Triton under the interpreter: about a minute on 2 cores
@pytest.mark.timeout(660)  # the subprocess's own limit, not the suite's 300 s per test
def test_fp8_kv_under_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) == _EXPECTED_CASES, report
    assert "skipped" not in proc.stdout, report


@pytest.fixture(scope="module")
def triton_backend():
    from engine.layers.attention import triton_backend

    return triton_backend


def _make_batch(mode, lens, prefix_lens, page_size, pool, req_pool, gen, kv_heads, head_dim):
    num_pages = pool.size // page_size
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    slots = []
    for i, n in enumerate(lens):
        mine = torch.tensor([pages.pop() for _ in range(-(-n // page_size))])
        pos = torch.arange(n)
        s = mine[pos // page_size] * page_size + pos % page_size
        req_pool.req_to_token[i + 1, :n] = s.to(torch.int32)
        slots.append(s)
    for s, p in zip(slots, prefix_lens):
        if p:
            pool.set_kv_buffer(0, s[:p], torch.randn(p, kv_heads, head_dim, generator=gen) * 3,
                               torch.randn(p, kv_heads, head_dim, generator=gen))
    ext = [n - p for n, p in zip(lens, prefix_lens)]
    fb = ForwardBatch(forward_mode=mode, batch_size=len(lens), input_ids=torch.zeros(sum(ext), dtype=torch.int64),
                      positions=torch.zeros(sum(ext), dtype=torch.int64),
                      req_pool_indices=torch.arange(1, len(lens) + 1), seq_lens=torch.tensor(lens),
                      seq_lens_cpu=list(lens), out_cache_loc=torch.cat([s[p:] for s, p in zip(slots, prefix_lens)]),
                      seq_lens_sum=sum(lens), req_to_token_pool=req_pool, token_to_kv_pool=pool)
    if mode.is_extend():
        fb.extend_num_tokens = sum(ext)
        fb.extend_seq_lens_cpu = ext
        fb.extend_prefix_lens_cpu = list(prefix_lens)
        fb.extend_seq_lens = torch.tensor(ext)
        fb.extend_prefix_lens = torch.tensor(prefix_lens)
        fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    return fb


def _compare(triton_backend, pool, fb, layer, gen, dtype) -> float:
    heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    n = fb.out_cache_loc.numel()
    q = torch.randn(n, heads * dim, generator=gen).to(dtype)
    k = (torch.randn(n, kv_heads, dim, generator=gen) * 3).to(dtype)
    v = torch.randn(n, kv_heads, dim, generator=gen).to(dtype)
    runner = SimpleNamespace(device="cpu")
    outs = {}
    for name, backend in (("triton", triton_backend.TritonAttnBackend(runner, max_kv_splits=4, decode_block_n=32,
                                                                      extend_blocks=(16, 16))),
                          ("torch_native", TorchNativeAttnBackend(runner))):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs[name] = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    assert outs["triton"].dtype == dtype
    a, b = outs["triton"].double(), outs["torch_native"].double()
    return ((a - b).norm() / b.norm()).item()


_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("kv_dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("mode,lens,prefix_lens,page_size,dtype", [
    (ForwardMode.DECODE, [1, 70, 33, 150], None, 16, torch.float32),
    (ForwardMode.EXTEND, [30, 9, 50], [12, 8, 0], 1, torch.bfloat16),
    (ForwardMode.EXTEND, [23, 1, 40], [0, 0, 0], 16, torch.float32),
    (ForwardMode.MIXED, [30, 25, 41], [10, 24, 40], 1, torch.float32),
])
def test_triton_matches_torch_native_over_fp8(triton_backend, kv_dtype, mode, lens, prefix_lens, page_size, dtype):
    gen = torch.Generator().manual_seed(len(lens) + page_size)
    kv_heads, dim = 2, 64
    prefix_lens = [n - 1 for n in lens] if prefix_lens is None else prefix_lens
    pool = MHATokenToKVPool(size=1024, page_size=page_size, dtype=kv_dtype, head_num=kv_heads, head_dim=dim,
                            layer_num=1, k_scales=[0.6], v_scales=[1.7])
    req_pool = ReqToTokenPool(size=8, max_context_len=256)
    fb = _make_batch(mode, lens, prefix_lens, page_size, pool, req_pool, gen, kv_heads, dim)
    layer = RadixAttention(8, dim, scaling=dim ** -0.5, num_kv_heads=kv_heads, layer_id=0)
    assert _compare(triton_backend, pool, fb, layer, gen, dtype) < _TOL[dtype]


@pytest.mark.parametrize("mode,lens,prefix_lens", [
    (ForwardMode.DECODE, [3, 90, 150], None),
    (ForwardMode.EXTEND, [30, 9, 50], [12, 8, 0]),
])
def test_triton_windowed_layer_over_fp8(triton_backend, mode, lens, prefix_lens):
    """A sliding-window layer (torch_native's windowed path)."""
    gen = torch.Generator().manual_seed(len(lens))
    kv_heads, dim = 2, 64
    prefix_lens = [n - 1 for n in lens] if prefix_lens is None else prefix_lens
    pool = MHATokenToKVPool(size=1024, page_size=1, dtype=torch.float8_e4m3fn, head_num=kv_heads, head_dim=dim,
                            layer_num=1, k_scales=[0.5], v_scales=[2.0])
    req_pool = ReqToTokenPool(size=8, max_context_len=256)
    fb = _make_batch(mode, lens, prefix_lens, 1, pool, req_pool, gen, kv_heads, dim)
    layer = RadixAttention(8, dim, scaling=dim ** -0.5, num_kv_heads=kv_heads, layer_id=0, sliding_window_size=20)
    err = _compare(triton_backend, pool, fb, layer, gen, torch.float32)
    assert err < 2e-5


def test_triton_hybrid_swa_pool_over_fp8(triton_backend):
    """The hybrid pool keeps its windowed layer's K/V at other slots (slot map): fp8 there too."""
    from engine.mem_cache.swa_pool import SWAKVPool, SWATokenToKVPoolAllocator

    gen = torch.Generator().manual_seed(5)
    kv_heads, dim = 2, 64
    pool = SWAKVPool(512, 256, [0], torch.float8_e5m2, kv_heads, dim, 1, k_scales=[0.8], v_scales=[1.3])
    alloc = SWATokenToKVPoolAllocator(512, 256, 16, 8, torch.float8_e5m2, "cpu", pool)
    req_pool = ReqToTokenPool(size=8, max_context_len=256)
    lens = [40, 7, 90]
    slots = [alloc.alloc(n) for n in lens]
    for i, s in enumerate(slots):
        assert s is not None
        req_pool.req_to_token[i + 1, : len(s)] = s.to(torch.int32)
        pool.set_kv_buffer(0, s[:-1], torch.randn(len(s) - 1, kv_heads, dim, generator=gen),
                           torch.randn(len(s) - 1, kv_heads, dim, generator=gen))
    fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=3, input_ids=torch.zeros(3, dtype=torch.int64),
                      positions=torch.zeros(3, dtype=torch.int64), req_pool_indices=torch.arange(1, 4),
                      seq_lens=torch.tensor(lens), seq_lens_cpu=lens,
                      out_cache_loc=torch.stack([s[-1] for s in slots if s is not None]), seq_lens_sum=sum(lens),
                      req_to_token_pool=req_pool, token_to_kv_pool=pool)
    layer = RadixAttention(8, dim, scaling=dim ** -0.5, num_kv_heads=kv_heads, layer_id=0, sliding_window_size=16)
    assert _compare(triton_backend, pool, fb, layer, gen, torch.float32) < 2e-5


if os.environ.get("TRITON_INTERPRET") != "1":
    # The cases run in the driver's TRITON_INTERPRET=1 subprocess, not in this process.
    for _name in [n for n in list(globals()) if n.startswith("test_") and n != "test_fp8_kv_under_triton_interpreter"]:
        del globals()[_name]
else:
    del test_fp8_kv_under_triton_interpreter
