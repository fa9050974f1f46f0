"""Triton kernels, the triton backend and the flashinfer backend on a CUDA GPU.

Compiled (not interpreted) kernels at serving-like shapes: default block sizes, long contexts
that use every KV split, bf16/fp16/fp32, GQA 1/4/8, head dims 64/128, page sizes 1 and 16.
References: a float64 computation (kernels) and the torch_native backend (backends).
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import List

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _layout(lens: List[int], page_size: int, gen: torch.Generator):
    """req_to_token rows 1..bs on random distinct pages (page 0 reserved); per-request slot lists."""
    pages_needed = sum(-(-n // page_size) for n in lens)
    pages = (torch.randperm(pages_needed + 8, generator=gen) + 1).tolist()
    table = torch.zeros(len(lens) + 1, max(lens) + page_size, dtype=torch.int32)
    slots = []
    for i, n in enumerate(lens):
        mine = torch.tensor([pages.pop() for _ in range(-(-n // page_size))])
        pos = torch.arange(n)
        s = mine[pos // page_size] * page_size + pos % page_size
        table[i + 1, :n] = s.to(torch.int32)
        slots.append(s.to(DEV))
    return table.to(DEV), slots, (pages_needed + 10) * page_size


def _reference(q, k, v, scale, prefix_len):
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.double().repeat_interleave(heads // kv_heads, 1)
    v = v.double().repeat_interleave(heads // kv_heads, 1)
    s = torch.einsum("ehd,shd->hes", q.double(), k) * scale
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= (torch.arange(q.shape[0], device=q.device)[:, None] + prefix_len)
    return torch.einsum("hes,shd->ehd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa,head_dim", [(1, 128), (4, 128), (8, 64), (4, 64)])
def test_decode_kernel_gpu(gqa, head_dim, page_size, dtype):
    from engine.layers.attention.triton_ops import compute_num_kv_splits, decode_attention_fwd

    gen = torch.Generator().manual_seed(gqa + head_dim + page_size)
    kv_heads = 4
    heads = kv_heads * gqa
    lens = [1, 7, 300, 4097, 1000, 64]
    table, slots, pool = _layout(lens, page_size, gen)
    k_buf = torch.randn(pool, kv_heads, head_dim, device=DEV, dtype=dtype)
    v_buf = torch.randn(pool, kv_heads, head_dim, device=DEV, dtype=dtype)
    bs = len(lens)
    q = torch.randn(bs, heads, head_dim, device=DEV, dtype=dtype)
    out = torch.empty_like(q)
    seq_lens = torch.tensor(lens, device=DEV)
    splits = compute_num_kv_splits(seq_lens, 8)
    assert splits.max().item() == 8
    mid_o = torch.empty(bs, heads, 8, head_dim, device=DEV)
    mid_lse = torch.empty(bs, heads, 8, device=DEV)
    scale = head_dim**-0.5
    decode_attention_fwd(q, k_buf, v_buf, out, table, torch.arange(1, bs + 1, device=DEV), seq_lens, splits, mid_o, mid_lse, scale)
    for i, n in enumerate(lens):
        ref = _reference(q[i : i + 1], k_buf[slots[i]], v_buf[slots[i]], scale, n - 1)[0]
        assert _rel(out[i], ref) < TOL[dtype], (n, _rel(out[i], ref))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("gqa,head_dim", [(1, 128), (4, 128), (8, 64)])
def test_extend_kernel_gpu(gqa, head_dim, page_size, dtype):
    from engine.layers.attention.triton_backend import extend_block_sizes
    from engine.layers.attention.triton_ops import extend_attention_fwd

    gen = torch.Generator().manual_seed(3 * gqa + head_dim + page_size)
    kv_heads = 2
    heads = kv_heads * gqa
    reqs = [(0, 1), (0, 517), (100, 1), (300, 129), (1000, 64), (17, 33)]  # (prefix, extend)
    lens = [p + e for p, e in reqs]
    table, slots, pool = _layout(lens, page_size, gen)
    k_buf = torch.randn(pool, kv_heads, head_dim, device=DEV, dtype=dtype)
    v_buf = torch.randn(pool, kv_heads, head_dim, device=DEV, dtype=dtype)
    ext = [e for _, e in reqs]
    total = sum(ext)
    q = torch.randn(total, heads, head_dim, device=DEV, dtype=dtype)
    k_new = torch.randn(total, kv_heads, head_dim, device=DEV, dtype=dtype)
    v_new = torch.randn(total, kv_heads, head_dim, device=DEV, dtype=dtype)
    starts = [sum(ext[:i]) for i in range(len(ext))]
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    block_m, block_n = extend_block_sizes(head_dim, dtype)
    extend_attention_fwd(
        q, k_new, v_new, out, k_buf, v_buf, table, torch.arange(1, len(reqs) + 1, device=DEV),
        torch.tensor(starts, device=DEV), torch.tensor(ext, device=DEV), torch.tensor([p for p, _ in reqs], device=DEV),
        max(ext), scale, block_m=block_m, block_n=block_n,
    )
    for i, (p, e) in enumerate(reqs):
        rows = slice(starts[i], starts[i] + e)
        k_all = torch.cat([k_buf[slots[i][:p]], k_new[rows]])
        v_all = torch.cat([v_buf[slots[i][:p]], v_new[rows]])
        ref = _reference(q[rows], k_all, v_all, scale, p)
        assert _rel(out[rows], ref) < TOL[dtype], (p, e, _rel(out[rows], ref))


def _backend_case(backend_name: str, mode_name: str, page_size: int):
    from engine.layers.attention import create_attention_backend
    from engine.layers.radix_attention import RadixAttention
    from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    gen = torch.Generator().manual_seed(page_size)
    dtype, heads, kv_heads, head_dim = torch.bfloat16, 16, 4, 128
    mode = ForwardMode[mode_name]
    lens = [1, 700, 2050, 37]
    prefix = [n - 1 for n in lens] if mode.is_decode() else [0, 650, 2000, 0]
    table, slots, pool_size = _layout(lens, page_size, gen)
    req = ReqToTokenPool(8, 4096, DEV)
    req.req_to_token[: table.shape[0], : table.shape[1]] = table
    kv = MHATokenToKVPool(pool_size, page_size, dtype, kv_heads, head_dim, 1, DEV)
    for s in slots:
        kv.set_kv_buffer(0, s, torch.randn(len(s), kv_heads, head_dim, device=DEV), torch.randn(len(s), kv_heads, head_dim, device=DEV))
    ext = [n - p for n, p in zip(lens, prefix)]
    n_tok = sum(ext)
    fb = ForwardBatch(
        forward_mode=mode, batch_size=len(lens), input_ids=torch.zeros(n_tok, dtype=torch.int64, device=DEV),
        positions=torch.zeros(n_tok, dtype=torch.int64, device=DEV), req_pool_indices=torch.arange(1, len(lens) + 1, device=DEV),
        seq_lens=torch.tensor(lens, device=DEV), seq_lens_cpu=lens,
        out_cache_loc=torch.cat([s[p:] for s, p in zip(slots, prefix)]), seq_lens_sum=sum(lens),
        req_to_token_pool=req, token_to_kv_pool=kv,
    )
    if mode.is_extend():
        fb.extend_num_tokens, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = n_tok, ext, prefix
        fb.extend_seq_lens = torch.tensor(ext, device=DEV)
        fb.extend_prefix_lens = torch.tensor(prefix, device=DEV)
        fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    layer = RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, 0)
    q = torch.randn(n_tok, heads * head_dim, device=DEV, dtype=dtype)
    k = torch.randn(n_tok, kv_heads, head_dim, device=DEV, dtype=dtype)
    v = torch.randn(n_tok, kv_heads, head_dim, device=DEV, dtype=dtype)
    runner = SimpleNamespace(device=DEV)
    outs = {}
    for name in ("torch_native", backend_name):
        backend = create_attention_backend(name, runner)
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs[name] = backend.forward(q, k, v, layer, fb)
    return _rel(outs[backend_name], outs["torch_native"])


@pytest.mark.parametrize("mode_name", ["EXTEND", "DECODE"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_torch_native_gpu(mode_name, page_size):
    assert _backend_case("triton", mode_name, page_size) < TOL[torch.bfloat16]


@pytest.mark.parametrize("mode_name", ["EXTEND", "DECODE"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_backend_matches_torch_native_gpu(mode_name, page_size):
    pytest.importorskip("flashinfer")
    assert _backend_case("flashinfer", mode_name, page_size) < TOL[torch.bfloat16]


def test_decode_kernel_long_context_gpu():
    """Serving-size decode (32 x 8192 keys, every split used) gives finite, correct output."""
    from engine.layers.attention.triton_ops import compute_num_kv_splits, decode_attention_fwd

    bs, heads, kv_heads, d, n = 32, 32, 8, 128, 8192
    k_buf = torch.randn(bs * n + 1, kv_heads, d, device=DEV, dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    table = (torch.arange(bs * n, device=DEV, dtype=torch.int32) + 1).view(bs, n)
    table = torch.cat([torch.zeros(1, n, dtype=torch.int32, device=DEV), table])
    q = torch.randn(bs, heads, d, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    seq = torch.full((bs,), n, device=DEV)
    mid_o = torch.empty(bs, heads, 8, d, device=DEV)
    mid_lse = torch.empty(bs, heads, 8, device=DEV)
    decode_attention_fwd(q, k_buf, v_buf, out, table, torch.arange(1, bs + 1, device=DEV), seq, compute_num_kv_splits(seq, 8), mid_o, mid_lse, d**-0.5)
    torch.cuda.synchronize()
    ref = _reference(q[:1], k_buf[table[1].long()], v_buf[table[1].long()], d**-0.5, n - 1)[0]
    assert _rel(out[0], ref) < TOL[torch.bfloat16]
    assert math.isfinite(out.float().sum().item())
