"""The native decode kernel's masked rows (layers/attention/kernel_rows.py, kernels/csrc/decode_attention.c):
sliding windows, the logit soft-cap and sinks in decode and extend batches, and tree drafts' masks,
against a dense float64 reference (and windowed.py, the torch path it replaces), on random shapes: GQA,
head sizes 64 and 128, windows shorter and longer than the context, pages of 1 and 16 slots, a float32,
bfloat16 and fp8 pool."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import List, Optional

import pytest
import torch

from engine.kernels import attention as attention_kernels
from engine.kernels import library
from engine.layers.attention import windowed
from engine.layers.attention import kernel_rows
from engine.layers.attention.kernel_rows import KernelRows, kernel_takes
from engine.layers.radix_attention import RadixAttention
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from engine.model_executor.forward_batch_info import ForwardMode

pytestmark = pytest.mark.skipif(not library.load(), reason="no C compiler: the CPU kernels are not built")

CONTEXT = 512


def _pool_and_table(lens: List[int], kv_heads: int, dim: int, dtype: torch.dtype, page: int, gen: torch.Generator):
    """A one-layer pool of random K/V and a table whose rows hold `lens` slots each (pages of `page`
    slots, in random order), rows 1.. of the table."""
    pages = sum((n + page - 1) // page for n in lens)
    size = (pages + 4) * page
    scales = [0.5] if dtype == torch.float8_e4m3fn else None
    pool = MHATokenToKVPool(size, page, dtype, kv_heads, dim, 1, k_scales=scales, v_scales=scales)
    k = torch.randn(size + page, kv_heads, dim, generator=gen)
    v = torch.randn(size + page, kv_heads, dim, generator=gen)
    every = torch.arange(page, size + page)
    pool.set_kv_buffer(0, every, k[every] * 1.5, v[every])
    reqs = ReqToTokenPool(len(lens), CONTEXT)
    order = (torch.randperm(pages + 3, generator=gen) + 1)[:pages]  # page 0 is padding
    used = 0
    for r, n in enumerate(lens):
        need = (n + page - 1) // page
        slots = (order[used:used + need].unsqueeze(1) * page + torch.arange(page)).view(-1)[:n]
        reqs.req_to_token[r + 1, :n] = slots.to(torch.int32)
        used += need
    return pool, reqs


def _batch(pool, reqs, seq_lens: List[int], ext_lens: Optional[List[int]], mode: ForwardMode):
    fb = SimpleNamespace(
        forward_mode=mode, token_to_kv_pool=pool, req_to_token_pool=reqs,
        req_pool_indices=torch.arange(1, len(seq_lens) + 1), seq_lens=torch.tensor(seq_lens), seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=ext_lens, spec_tree_mask=None,
        extend_prefix_lens_cpu=None if ext_lens is None else [s - e for s, e in zip(seq_lens, ext_lens)])
    return fb


def _reference(q, pool, reqs, seq_lens, ext_lens, layer, visible_fn=None) -> torch.Tensor:
    """float64, query by query: q [T, H * D] for each request's last ext_lens tokens."""
    heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    group = heads // kv_heads
    out = torch.zeros(q.shape[0], heads, dim, dtype=torch.float64)
    qd = q.double().view(-1, heads, dim)
    k_buf, v_buf = pool.get_kv_buffer(0)
    t = 0
    for r, (seq_len, ext_len) in enumerate(zip(seq_lens, ext_lens)):
        slots = reqs.req_to_token[r + 1, :seq_len].long()
        k = pool.read_k(0, k_buf[slots], torch.float64)
        v = pool.read_v(0, v_buf[slots], torch.float64)
        for i in range(ext_len):
            p = seq_len - ext_len + i
            keys = visible_fn(r, i, p) if visible_fn is not None else [
                j for j in range(p + 1) if layer.sliding_window_size < 0 or j > p - layer.sliding_window_size]
            for h in range(heads):
                s = (k[keys, h // group] @ qd[t, h]) * layer.scaling
                if layer.logit_cap > 0:
                    s = torch.tanh(s / layer.logit_cap) * layer.logit_cap
                sink = float(layer.sinks[h]) if layer.sinks is not None else -math.inf
                top = max(float(s.max()), sink)
                e = torch.exp(s - top)
                out[t, h] = (e.unsqueeze(1) * v[keys, h // group]).sum(0) / (e.sum() + math.exp(sink - top))
            t += 1
    return out.view(q.shape[0], -1)


def _layer(heads, kv_heads, dim, window, cap, sinks, gen) -> RadixAttention:
    layer = RadixAttention(heads, dim, dim ** -0.5, kv_heads, 0, sliding_window_size=window, logit_cap=cap,
                           with_sinks=sinks)
    if layer.sinks is not None:
        layer.sinks.data = torch.randn(heads, generator=gen) * 2
    return layer


TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float8_e4m3fn: 2e-5}
CASES = [  # heads, kv_heads, dim, window, cap, sinks, pool dtype, page
    (8, 2, 64, 16, 0.0, False, torch.float32, 1),
    (8, 2, 128, 1000, 20.0, True, torch.float32, 16),
    (4, 4, 64, -1, 5.0, False, torch.float32, 16),
    (4, 1, 128, -1, 0.0, True, torch.float32, 1),
    (8, 2, 64, 37, 30.0, True, torch.bfloat16, 16),
    (4, 2, 128, 16, 0.0, True, torch.float8_e4m3fn, 1),
]


@pytest.mark.parametrize("heads,kv_heads,dim,window,cap,sinks,dtype,page", CASES)
def test_decode_rows_match_the_reference(heads, kv_heads, dim, window, cap, sinks, dtype, page):
    gen = torch.Generator().manual_seed(heads + dim + page)
    seq_lens = [5, 40, 300, 17]
    pool, reqs = _pool_and_table(seq_lens, kv_heads, dim, dtype, page, gen)
    layer = _layer(heads, kv_heads, dim, window, cap, sinks, gen)
    q_dtype = torch.float32 if dtype != torch.bfloat16 else torch.bfloat16
    q = (torch.randn(len(seq_lens), heads * dim, generator=gen) * 2).to(q_dtype)
    fb = _batch(pool, reqs, seq_lens, None, ForwardMode.DECODE)
    assert kernel_takes(q, pool.get_key_buffer(0), layer)
    got = KernelRows(fb).attend(q, layer)
    expected = _reference(q, pool, reqs, seq_lens, [1] * len(seq_lens), layer)
    torch_path = windowed.windowed_decode(q, layer, fb)
    assert (got.double() - expected).abs().max().item() < TOLERANCE[dtype]
    assert (got.double() - torch_path.double()).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("heads,kv_heads,dim,window,cap,sinks,dtype,page", CASES + [
    pytest.param(4, 2, 64, -1, 10.0, True, torch.bfloat16, 1, id="no-cascade")])
def test_extend_rows_match_the_reference(heads, kv_heads, dim, window, cap, sinks, dtype, page, request, monkeypatch):
    """A prompt without prefix, a chunk after a prefix, a fully cached prompt's last token, an empty one;
    an unwindowed layer's prefix as a cascade group, or (no-cascade: where the cascade would take bf16
    panels) in each row's stretch."""
    monkeypatch.setattr(kernel_rows, "_panel_phase", lambda pool: request.node.callspec.id == "no-cascade")
    gen = torch.Generator().manual_seed(heads * dim + page)
    seq_lens, ext_lens = [50, 66, 201, 30], [50, 29, 1, 0]
    pool, reqs = _pool_and_table(seq_lens, kv_heads, dim, dtype, page, gen)
    layer = _layer(heads, kv_heads, dim, window, cap, sinks, gen)
    q_dtype = torch.float32 if dtype != torch.bfloat16 else torch.bfloat16
    q = (torch.randn(sum(ext_lens), heads * dim, generator=gen) * 2).to(q_dtype)
    fb = _batch(pool, reqs, seq_lens, ext_lens, ForwardMode.EXTEND)
    got = KernelRows(fb).attend(q, layer)
    expected = _reference(q, pool, reqs, seq_lens, ext_lens, layer)
    torch_path = windowed.windowed_extend(q, layer, fb)
    assert (got.double() - expected).abs().max().item() < TOLERANCE[dtype]
    assert (got.double() - torch_path.double()).abs().max().item() < TOLERANCE[dtype]


def test_a_windowed_decode_reads_only_the_window():
    """The table handed to the kernel holds each request's last `window` slots and nothing before."""
    gen = torch.Generator().manual_seed(1)
    seq_lens = [400, 9]
    pool, reqs = _pool_and_table(seq_lens, 2, 64, torch.float32, 1, gen)
    layer = _layer(4, 2, 64, 24, 0.0, False, gen)
    rows = KernelRows(_batch(pool, reqs, seq_lens, None, ForwardMode.DECODE))
    tables = rows._tables_for(layer, pool, None)
    assert tables.kv_indices.shape == (2, 24) and tables.lens.tolist() == [24, 9]
    assert tables.kv_indices[0].tolist() == reqs.req_to_token[1, 376:400].tolist()
    assert tables.kv_indices[1, :9].tolist() == reqs.req_to_token[2, :9].tolist()


def test_the_kernel_refuses_what_it_does_not_compute():
    gen = torch.Generator().manual_seed(2)
    pool, _ = _pool_and_table([4], 2, 64, torch.bfloat16, 1, gen)
    layer = _layer(4, 2, 64, 8, 0.0, False, gen)
    assert not kernel_takes(torch.zeros(1, 256), pool.get_key_buffer(0), layer)  # float32 q, bf16 pool
    encoder = RadixAttention(4, 64, 0.125, 2, 0, sliding_window_size=8,
                             attn_type=__import__("engine.layers.radix_attention", fromlist=["x"]).AttentionType.ENCODER_ONLY)
    assert not kernel_takes(torch.zeros(1, 256, dtype=torch.bfloat16), pool.get_key_buffer(0), encoder)


def _tree_parents(gen: torch.Generator, n: int) -> List[int]:
    """A random tree of n nodes under node 0 (the request's last token), parents first."""
    return [int(torch.randint(0, i + 1, (1,), generator=gen)) for i in range(n - 1)]


@pytest.mark.parametrize("dtype,dim,page,cascade", [(torch.float32, 64, 1, True), (torch.float32, 128, 16, True),
                                                   (torch.bfloat16, 64, 1, True), (torch.float32, 64, 16, False)])
def test_tree_rows_match_the_reference(dtype, dim, page, cascade, monkeypatch):
    """Each draft sees the request's keys before the tree and its ancestors (and itself) in the tree:
    those before it as a cascade group, or (where the cascade would take bf16 panels) in each row's list."""
    monkeypatch.setattr(kernel_rows, "_panel_phase", lambda pool: not cascade)
    gen = torch.Generator().manual_seed(dim + page)
    heads, kv_heads = 8, 2
    nodes = [6, 1, 8]
    prefix = [90, 70, 0]
    seq_lens = [p + n for p, n in zip(prefix, nodes)]
    pool, reqs = _pool_and_table(seq_lens, kv_heads, dim, dtype, page, gen)
    layer = _layer(heads, kv_heads, dim, -1, 0.0, False, gen)
    masks = []
    for n in nodes:
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(_tree_parents(gen, n)):
            mask[i + 1] |= mask[p]
        masks.append(mask)
    flat = torch.cat([m.reshape(-1) for m in masks])
    starts = [0, nodes[0] ** 2, nodes[0] ** 2 + nodes[1] ** 2]
    fb = _batch(pool, reqs, seq_lens, nodes, ForwardMode.TARGET_VERIFY)
    fb.spec_tree_mask, fb.spec_tree_widths_cpu = flat, nodes
    fb.tree_mask_block = lambda i: flat[starts[i]:starts[i] + nodes[i] ** 2].view(nodes[i], nodes[i])
    q = (torch.randn(sum(nodes), heads * dim, generator=gen) * 2).to(dtype)
    got = KernelRows(fb).attend(q, layer)

    def visible(r: int, i: int, p: int) -> List[int]:
        return list(range(prefix[r])) + [prefix[r] + j for j in range(nodes[r]) if masks[r][i, j]]

    expected = _reference(q, pool, reqs, seq_lens, nodes, layer, visible)
    assert (got.double() - expected).abs().max().item() < TOLERANCE[dtype]


def test_the_cascade_applies_the_cap():
    """A decode batch whose requests share a prefix (the cascade's phase 1) with a soft-capped layer."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim = 4, 2, 64
    pool, reqs = _pool_and_table([200, 200], kv_heads, dim, torch.float32, 1, gen)
    reqs.req_to_token[2, :150] = reqs.req_to_token[1, :150]  # a shared prefix of 150 slots
    layer = _layer(heads, kv_heads, dim, -1, 3.0, True, gen)
    q = torch.randn(2, heads * dim, generator=gen) * 3
    kv = torch.stack([reqs.req_to_token[1, 150:200], reqs.req_to_token[2, 150:200]]).long()
    cascade = attention_kernels.CascadeTables(
        torch.tensor([0, 2]), torch.tensor([0, 1]), reqs.req_to_token[1:2, :150].long(), torch.tensor([150]),
        torch.tensor([0, 0]))
    k_buf, v_buf = pool.get_kv_buffer(0)
    got = attention_kernels.decode_attention(q, k_buf, v_buf, kv, torch.tensor([50, 50]), heads, kv_heads, dim,
                                             layer.scaling, cascade=cascade, logit_cap=3.0, sinks=layer.sinks)
    expected = _reference(q, pool, reqs, [200, 200], [1, 1], layer)
    assert (got.double() - expected).abs().max().item() < 2e-5
