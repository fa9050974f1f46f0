"""Triton attention kernels and the triton backend on the CPU, under TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when a function is decorated with @triton.jit, and its own standard
library (tl.max, tl.cdiv, ...) is decorated when triton is first imported. So the interpreter can
only be switched on for a whole process, before triton is imported. To keep it out of the other
test files of the same pytest process (tests/gpu on a GPU machine, servers started by integration
tests), the normal run collects just `test_kernels_under_triton_interpreter`, which runs this file
again in a subprocess with TRITON_INTERPRET=1; there, the individual cases below are collected.

Every case draws fresh random inputs and compares against a float64 reference (kernels) or the
torch_native backend (backend level), for GQA ratios 1/4/8, head dims 64/128, ragged lengths
(1 and longer than a block, with tiny blocks), with and without a prefix, page sizes 1 and 16.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch

from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend
from engine.layers.radix_attention import RadixAttention
from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# A table entry past a request's length must never be read: point it far out of the pool.
_STALE_SLOT = 1 << 30
_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
_LAYOUTS = [(1, torch.float32), (16, torch.bfloat16), (16, torch.float32), (1, torch.bfloat16)]


def checkerboard(cases: list) -> list:
    """Half of cases x _LAYOUTS: each case gets two layouts, each layout comes with half the cases."""
    return [(*case, *layout) for i, case in enumerate(cases) for j, layout in enumerate(_LAYOUTS) if (i + j) % 2 == 0]


# The number of cases below; the driver checks that the subprocess ran them all.
_EXPECTED_CASES = 12 + 1 + 8 + 8 + 1 + 1 + 2 + 2 + 1 + 5 + 4 + 2 + 1 + 1  # the hybrid pool test at pages 1 and 16


@pytest.mark.slow  # every Triton kernel under the interpreter: minutes on 2 cores
@pytest.mark.timeout(1260)  # the subprocess's own limit, not the suite's 300 s per test
def test_kernels_under_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    report = proc.stdout[-8000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed is not None and int(passed.group(1)) == _EXPECTED_CASES, report
    assert "skipped" not in proc.stdout, report


def test_triton_backend_on_cpu_needs_the_interpreter():
    """Outside the interpreter a CPU runner gets a clear error, not a launch failure mid-forward."""
    pytest.importorskip("triton")
    from engine.layers.attention import create_attention_backend

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        create_attention_backend("triton", SimpleNamespace(device="cpu"))


@pytest.fixture(scope="module")
def tk():
    triton = pytest.importorskip("triton")
    from engine.layers.attention import triton_backend, triton_ops

    assert type(triton_ops.decode_attention._decode_stage1_kernel).__name__ == "InterpretedFunction", triton.__version__
    return SimpleNamespace(ops=triton_ops, backend=triton_backend)


# ---------------------------------------------------------------------------- layouts and references
def paged_layout(lens: List[int], page_size: int, num_pages: int, gen: torch.Generator) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """Random distinct pages (page 0 reserved) per request; slot = page * P + pos % P.

    Returns req_to_token (rows 1..bs used, stale entries past each length) and each request's slots."""
    pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    width = max(lens) + 2 * page_size
    table = torch.full((len(lens) + 2, width), _STALE_SLOT, dtype=torch.int32)
    slots_per_req = []
    for i, length in enumerate(lens):
        npages = -(-length // page_size)
        mine = torch.tensor([pages.pop() for _ in range(npages)], dtype=torch.int64)
        pos = torch.arange(length)
        slots = mine[pos // page_size] * page_size + pos % page_size
        table[i + 1, :length] = slots.to(torch.int32)
        slots_per_req.append(slots)
    return table, slots_per_req


def reference_attention(q, k, v, scale: float, prefix_len: int, causal: bool = True) -> torch.Tensor:
    """q [E, H, D], k/v [S, KH, D]; query i sits at position prefix_len + i (float64); without
    `causal` every query sees every key (an encoder)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("ehd,shd->hes", q, k) * scale
    q_pos = torch.arange(q.shape[0]).unsqueeze(1) + prefix_len
    visible = torch.arange(k.shape[0]).unsqueeze(0) <= q_pos
    if causal:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hes,shd->ehd", scores.softmax(-1), v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ---------------------------------------------------------------------------- decode kernel
@pytest.mark.parametrize(
    "gqa,head_dim,page_size,dtype", checkerboard([(1, 64), (4, 128), (8, 64), (1, 128), (4, 64), (8, 128)])
)
def test_decode_kernel_matches_reference(tk, gqa, head_dim, page_size, dtype):
    gen = torch.Generator().manual_seed(gqa * 1000 + head_dim + page_size + (dtype == torch.bfloat16))
    kv_heads = 2 if gqa == 1 else 1
    heads = kv_heads * gqa
    lens = [1, 40, 17, 5]  # 40 > block_n=16; 1 is a lone key
    num_pages = 16 if page_size == 16 else 128
    table, slots = paged_layout(lens, page_size, num_pages, gen)
    pool_slots = num_pages * page_size
    k_buf = torch.randn(pool_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(pool_slots, kv_heads, head_dim, generator=gen).to(dtype)
    bs = len(lens)
    q = torch.randn(bs, heads, head_dim, generator=gen).to(dtype)
    out = torch.empty(bs, heads, head_dim, dtype=dtype)
    max_splits = 4
    # Uneven splits on purpose: 3 chunks of 40 keys leave a short last chunk; 4 chunks of 5 leave an empty one.
    num_splits = torch.tensor([1, 3, 2, 4], dtype=torch.int32)
    mid_o = torch.full((bs, heads, max_splits, head_dim), float("nan"))
    mid_lse = torch.full((bs, heads, max_splits), float("nan"))
    scale = 1.0 / math.sqrt(head_dim)
    tk.ops.decode_attention_fwd(
        q, k_buf, v_buf, out, table, torch.arange(1, bs + 1), torch.tensor(lens), num_splits, mid_o, mid_lse, scale, block_n=16
    )
    for i, length in enumerate(lens):
        ref = reference_attention(q[i : i + 1], k_buf[slots[i]], v_buf[slots[i]], scale, prefix_len=length - 1)[0]
        assert rel_err(out[i], ref) < _TOL[dtype], (i, length, rel_err(out[i], ref))


def test_num_kv_splits_grow_with_length_and_are_capped(tk):
    splits = tk.ops.compute_num_kv_splits(torch.tensor([1, 64, 65, 300, 100000]), max_kv_splits=8)
    assert splits.tolist() == [1, 1, 2, 5, 8]


# ---------------------------------------------------------------------------- extend kernel
# (prefix_len, extend_len): no prefix / prefix; a single token; spans of several 16-blocks.
_EXTEND_REQS = [(0, 1), (0, 37), (5, 1), (20, 19), (33, 17)]


@pytest.mark.parametrize("gqa,head_dim,page_size,dtype", checkerboard([(1, 64), (4, 128), (8, 64), (1, 128)]))
def test_extend_kernel_matches_reference(tk, gqa, head_dim, page_size, dtype):
    gen = torch.Generator().manual_seed(7 * gqa + head_dim + page_size + (dtype == torch.bfloat16))
    kv_heads = 2 if gqa == 1 else 1
    heads = kv_heads * gqa
    prefix_lens = [p for p, _ in _EXTEND_REQS]
    ext_lens = [e for _, e in _EXTEND_REQS]
    seq_lens = [p + e for p, e in _EXTEND_REQS]
    num_pages = 48 if page_size == 16 else 400
    table, slots = paged_layout(seq_lens, page_size, num_pages, gen)
    pool_slots = num_pages * page_size
    k_buf = torch.randn(pool_slots, kv_heads, head_dim, generator=gen).to(dtype)
    v_buf = torch.randn(pool_slots, kv_heads, head_dim, generator=gen).to(dtype)
    total = sum(ext_lens)
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k_new = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v_new = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    # The new tokens' pool slots hold garbage: the kernel must take them from k_new / v_new.
    starts = [sum(ext_lens[:i]) for i in range(len(ext_lens))]
    for i, (p, e) in enumerate(_EXTEND_REQS):
        k_buf[slots[i][p:]] = 1e4
        v_buf[slots[i][p:]] = 1e4
    out = torch.full((total, heads, head_dim), float("nan"), dtype=dtype)
    scale = 1.0 / math.sqrt(head_dim)
    tk.ops.extend_attention_fwd(
        q, k_new, v_new, out, k_buf, v_buf, table,
        torch.arange(1, len(_EXTEND_REQS) + 1),
        torch.tensor(starts), torch.tensor(ext_lens), torch.tensor(prefix_lens),
        max(ext_lens), scale, block_m=16, block_n=16,
    )
    for i, (p, e) in enumerate(_EXTEND_REQS):
        rows = slice(starts[i], starts[i] + e)
        k_all = torch.cat([k_buf[slots[i][:p]], k_new[rows]])
        v_all = torch.cat([v_buf[slots[i][:p]], v_new[rows]])
        ref = reference_attention(q[rows], k_all, v_all, scale, prefix_len=p)
        assert rel_err(out[rows], ref) < _TOL[dtype], (p, e, rel_err(out[rows], ref))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_kernel_non_causal_matches_reference(tk, dtype):
    """Encoder attention (is_causal False): every new token sees all of its request's new tokens,
    across 16-blocks, with GQA; the pool is never read (no prefix)."""
    gen = torch.Generator().manual_seed(13)
    heads, kv_heads, head_dim = 4, 2, 64
    ext_lens = [1, 37, 16, 5]
    total = sum(ext_lens)
    starts = [sum(ext_lens[:i]) for i in range(len(ext_lens))]
    q = torch.randn(total, heads, head_dim, generator=gen).to(dtype)
    k_new = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    v_new = torch.randn(total, kv_heads, head_dim, generator=gen).to(dtype)
    pool = torch.full((1, kv_heads, head_dim), float("nan"), dtype=dtype)  # an encoder's empty pool
    out = torch.full((total, heads, head_dim), float("nan"), dtype=dtype)
    scale = 1.0 / math.sqrt(head_dim)
    tk.ops.extend_attention_fwd(
        q, k_new, v_new, out, pool, pool, torch.zeros(len(ext_lens) + 1, 64, dtype=torch.int32),
        torch.arange(1, len(ext_lens) + 1), torch.tensor(starts), torch.tensor(ext_lens),
        torch.zeros(len(ext_lens), dtype=torch.int64), max(ext_lens), scale, block_m=16, block_n=16,
        is_causal=False,
    )
    for start, n in zip(starts, ext_lens):
        rows = slice(start, start + n)
        ref = reference_attention(q[rows], k_new[rows], v_new[rows], scale, prefix_len=0, causal=False)
        assert rel_err(out[rows], ref) < _TOL[dtype], (n, rel_err(out[rows], ref))


def test_bert_with_triton_backend_matches_transformers(tk, tmp_path):
    """The tiny BERT encoder through ModelRunner with --attention-backend triton (mean pooling)."""
    import torch.nn.functional as F

    from utils_models import BatchDriver, ExtendReq, build_tiny_bert, hf_hidden_states, make_runner

    hf = build_tiny_bert(str(tmp_path), pooling_mode="mean")
    runner = make_runner(str(tmp_path), attention_backend="triton")
    gen = torch.Generator().manual_seed(2)
    prompts = [[int(x) for x in torch.randint(0, 512, (n,), generator=gen)] for n in (1, 19, 40)]
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in prompts]
    got = runner.forward_embedding(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, prompts)])).embeddings
    want = torch.stack([F.normalize(hf_hidden_states(hf, p).mean(0), dim=-1) for p in prompts])
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()


# ---------------------------------------------------------------------------- backend vs torch_native
def _make_batch(mode, lens, prefix_lens, page_size, pool, gen, kv_heads, head_dim, dtype):
    """A ForwardBatch over fresh random K/V for the prefixes, on a paged layout of the pools."""
    num_pages = pool["kv"].size // page_size
    table, slots = paged_layout(lens, page_size, num_pages, gen)
    req_pool = pool["req"]
    req_pool.req_to_token[: table.shape[0], : table.shape[1]] = table
    kv = pool["kv"]
    for s in slots:
        kv.set_kv_buffer(0, s, torch.randn(len(s), kv_heads, head_dim, generator=gen).to(dtype),
                         torch.randn(len(s), kv_heads, head_dim, generator=gen).to(dtype))
    bs = len(lens)
    ext = [l - p for l, p in zip(lens, prefix_lens)]
    out_cache_loc = torch.cat([s[p:] for s, p in zip(slots, prefix_lens)])
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(sum(ext), dtype=torch.int64),
        positions=torch.zeros(sum(ext), dtype=torch.int64),
        req_pool_indices=torch.arange(1, bs + 1),
        seq_lens=torch.tensor(lens),
        seq_lens_cpu=list(lens),
        out_cache_loc=out_cache_loc,
        seq_lens_sum=sum(lens),
        req_to_token_pool=req_pool,
        token_to_kv_pool=kv,
    )
    if mode.is_extend():
        fb.extend_num_tokens = sum(ext)
        fb.extend_seq_lens_cpu = ext
        fb.extend_prefix_lens_cpu = list(prefix_lens)
        fb.extend_seq_lens = torch.tensor(ext)
        fb.extend_prefix_lens = torch.tensor(prefix_lens)
        fb.extend_start_loc = torch.cumsum(fb.extend_seq_lens, 0) - fb.extend_seq_lens
    return fb


@pytest.mark.parametrize(
    "mode,lens,prefix_lens,page_size,dtype",
    checkerboard(
        [
            (ForwardMode.EXTEND, [23, 1, 40], [0, 0, 0]),
            (ForwardMode.EXTEND, [30, 9, 50], [12, 8, 0]),
            (ForwardMode.MIXED, [30, 25, 41], [10, 24, 40]),  # two decode rows after one extend
            (ForwardMode.DECODE, [1, 70, 33, 200], None),
        ]
    ),
)
def test_backend_matches_torch_native(tk, mode, lens, prefix_lens, page_size, dtype):
    gen = torch.Generator().manual_seed(len(lens) * 31 + page_size)
    heads, kv_heads, head_dim = 8, 2, 64
    if prefix_lens is None:  # decode: everything but the new token is cached
        prefix_lens = [l - 1 for l in lens]
    pool = {
        "req": ReqToTokenPool(size=8, max_context_len=256),
        "kv": MHATokenToKVPool(size=1024, page_size=page_size, dtype=dtype, head_num=kv_heads,
                               head_dim=head_dim, layer_num=1),
    }
    fb = _make_batch(mode, lens, prefix_lens, page_size, pool, gen, kv_heads, head_dim, dtype)
    layer = RadixAttention(heads, head_dim, scaling=head_dim**-0.5, num_kv_heads=kv_heads, layer_id=0)
    n = fb.out_cache_loc.shape[0]
    q = torch.randn(n, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    runner = SimpleNamespace(device="cpu")

    outs: Dict[str, torch.Tensor] = {}
    # MIN_KEYS_PER_SPLIT=64 splits the 200-key request in 4 (the cap) and the 70-key one in 2.
    backends = {
        "triton": tk.backend.TritonAttnBackend(runner, max_kv_splits=4, decode_block_n=32, extend_blocks=(16, 16)),
        "torch_native": TorchNativeAttnBackend(runner),
    }
    k_buf, v_buf = pool["kv"].get_kv_buffer(0)
    for name, backend in backends.items():
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs[name] = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
        if name == "triton":  # it ran first: the new K/V must be where out_cache_loc says
            assert torch.equal(k_buf[fb.out_cache_loc], k) and torch.equal(v_buf[fb.out_cache_loc], v)
    assert outs["triton"].shape == (n, heads * head_dim)
    assert outs["triton"].dtype == dtype
    assert rel_err(outs["triton"], outs["torch_native"]) < _TOL[dtype]


@pytest.mark.parametrize("page_size,dtype,covered", [(1, torch.float32, None), (16, torch.bfloat16, [5, 0, 20])])
def test_tree_mask_matches_dense_reference(tk, page_size, dtype, covered):
    """Speculative tree drafts (HAS_TREE_MASK): each node sees the prefix, its ancestors and itself
    (test_speculative_tree.py's batches and float64 reference; one tree spans two query blocks; with
    `covered`, some cached keys are under the mask too, as in a draft's tree step)."""
    from test_speculative_tree import TREES, dense_tree_reference, tree_batch

    gen = torch.Generator().manual_seed(page_size + 5)
    heads, kv_heads, head_dim = 8, 2, 64
    fb, dense, slots = tree_batch([17, 0, 40], TREES, page_size, dtype, gen, covered=covered)
    n = fb.out_cache_loc.shape[0]
    q = torch.randn(n, heads * head_dim, generator=gen).to(dtype)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    backend = tk.backend.TritonAttnBackend(SimpleNamespace(device="cpu"), extend_blocks=(16, 16))
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    layer = RadixAttention(heads, head_dim, scaling=head_dim**-0.5, num_kv_heads=kv_heads, layer_id=0)
    out = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    ref = dense_tree_reference(q, k, v, fb, dense, slots, heads, kv_heads, head_dim)
    assert rel_err(out, ref) < _TOL[dtype]


# Trees of depth 3, 3 and 4 (the last one's 21 rows span two 16-row blocks, its deepest rows in the second).
_SHALLOW_TREES = [[0, 0, 1, 1, 2], [0, 1, 2], [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8, 9, 9]]


def _dense_windowed_tree(q, k, v, fb, dense, slots, layer, covered: List[int]) -> torch.Tensor:
    """float64: each node sees the keys before its request's mask block from its position - window + 1 on,
    then what the block shows; scores soft-capped, the head's sink in each denominator."""
    k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(0)
    heads, head_dim = layer.tp_q_head_num, layer.head_dim
    group = heads // layer.tp_k_head_num
    outs, start = [], 0
    for mask, row, n, c in zip(dense, slots, fb.extend_prefix_lens_cpu, covered):
        e = mask.shape[0]
        pos = fb.positions[start:start + e]
        before = torch.arange(n - c)
        mask = mask.clone()
        mask[:, :n - c] &= before[None, :] > pos[:, None] - layer.sliding_window_size
        keys = torch.cat([k_buf[row[:n]].double(), k[start:start + e].double()]).repeat_interleave(group, 1)
        vals = torch.cat([v_buf[row[:n]].double(), v[start:start + e].double()]).repeat_interleave(group, 1)
        scores = torch.einsum("ehd,shd->hes", q[start:start + e].double().view(e, heads, head_dim), keys) * layer.scaling
        if layer.logit_cap > 0:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        if layer.sinks is not None:
            sink = layer.sinks.double().view(heads, 1, 1).expand(heads, e, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        outs.append(torch.einsum("hes,shd->ehd", probs, vals).reshape(e, heads * head_dim))
        start += e
    return torch.cat(outs)


def _masked_layer_and_qkv(n: int, heads: int, kv_heads: int, head_dim: int, window: int, cap: float, sinks: bool,
                          dtype: torch.dtype, gen: torch.Generator):
    """A windowed / soft-capped / sink layer (random sinks) and n rows of random q, k, v for it."""
    layer = RadixAttention(heads, head_dim, scaling=head_dim**-0.5, num_kv_heads=kv_heads, layer_id=0,
                           sliding_window_size=window, logit_cap=cap, with_sinks=sinks)
    if layer.sinks is not None:
        layer.sinks.data = torch.randn(heads, generator=gen).to(dtype)
    q = (torch.randn(n, heads * head_dim, generator=gen) * 2).to(dtype)
    k = (torch.randn(n, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
    return layer, q, k, v


@pytest.mark.parametrize("window,cap,sinks,page_size,dtype,covered", [
    (6, 0.0, False, 1, torch.float32, None),
    (5, 3.0, True, 16, torch.bfloat16, [2, 0, 3]),
])
def test_windowed_tree_rows_match_torch_native(tk, window, cap, sinks, page_size, dtype, covered):
    """Tree verifies / tree drafts on windowed (soft-capped, sink) layers: a node's window ends at its
    position (the length before the tree plus its depth), not at its index in the extend, so with a window
    smaller than the prefix and trees up to 4 deep (a deep node in the second query block, whose ancestors
    sit in the first) the kernel equals torch_native's tree rows and a float64 reference; with `covered`,
    some cached keys are a draft's earlier nodes, under the mask, outside the window's reach."""
    from test_speculative_tree import tree_batch

    from engine.speculative.tree import DraftTree

    gen = torch.Generator().manual_seed(window + page_size)
    heads, kv_heads, head_dim = 8, 2, 64
    lens = [17, 0, 40]
    covered = covered or [0] * len(lens)
    fb, dense, slots = tree_batch(lens, _SHALLOW_TREES, page_size, dtype, gen, covered=covered)
    # Each node's position: the keys before its tree (a draft's covered nodes are tree nodes), plus its
    # depth, plus one level above the new rows where earlier nodes are covered (a draft's later step).
    fb.positions = torch.cat([
        torch.tensor(DraftTree(tokens=[0] * len(t), parents=t).depths()) + n - c + (1 if c else 0)
        for t, n, c in zip(_SHALLOW_TREES, lens, covered)])
    n = fb.out_cache_loc.shape[0]
    layer, q, k, v = _masked_layer_and_qkv(n, heads, kv_heads, head_dim, window, cap, sinks, dtype, gen)
    runner = SimpleNamespace(device="cpu")
    outs: Dict[str, torch.Tensor] = {}
    for name, backend in (("triton", tk.backend.TritonAttnBackend(runner, extend_blocks=(16, 16))),
                          ("torch_native", TorchNativeAttnBackend(runner))):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        with torch.no_grad():
            outs[name] = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    ref = _dense_windowed_tree(q, k, v, fb, dense, slots, layer, covered)
    assert rel_err(outs["torch_native"], ref) < _TOL[dtype]
    assert rel_err(outs["triton"], outs["torch_native"]) < _TOL[dtype]
    assert rel_err(outs["triton"], ref) < _TOL[dtype]


@pytest.mark.parametrize(
    "mode,lens,prefix_lens,window,cap,sinks,page_size,dtype",
    [
        (ForwardMode.EXTEND, [30, 9, 50], [12, 8, 0], 7, 0.0, False, 1, torch.float32),
        (ForwardMode.EXTEND, [23, 1, 40], [0, 0, 0], -1, 3.0, True, 16, torch.float32),
        (ForwardMode.MIXED, [30, 25, 41], [10, 24, 40], 5, 2.0, True, 16, torch.bfloat16),
        (ForwardMode.DECODE, [1, 70, 33, 200], None, 40, 0.0, True, 1, torch.float32),
        (ForwardMode.DECODE, [3, 90, 150], None, 64, 4.0, False, 16, torch.bfloat16),
    ],
)
def test_windowed_layers_match_torch_native(tk, mode, lens, prefix_lens, window, cap, sinks, page_size, dtype):
    """Sliding windows (smaller than a block, and than a prefix), logit caps and sinks: the Triton kernels
    equal torch_native's windowed path (itself checked against a float64 reference in
    test_windowed_attention.py); decode splits divide the window, not the whole sequence."""
    gen = torch.Generator().manual_seed(len(lens) * 7 + max(window, 0))
    heads, kv_heads, head_dim = 8, 2, 64
    if prefix_lens is None:
        prefix_lens = [l - 1 for l in lens]
    pool = {
        "req": ReqToTokenPool(size=8, max_context_len=256),
        "kv": MHATokenToKVPool(size=1024, page_size=page_size, dtype=dtype, head_num=kv_heads,
                               head_dim=head_dim, layer_num=1),
    }
    fb = _make_batch(mode, lens, prefix_lens, page_size, pool, gen, kv_heads, head_dim, dtype)
    n = fb.out_cache_loc.shape[0]
    layer, q, k, v = _masked_layer_and_qkv(n, heads, kv_heads, head_dim, window, cap, sinks, dtype, gen)
    runner = SimpleNamespace(device="cpu")
    outs: Dict[str, torch.Tensor] = {}
    backends = {
        "triton": tk.backend.TritonAttnBackend(runner, max_kv_splits=4, decode_block_n=32, extend_blocks=(16, 16)),
        "torch_native": TorchNativeAttnBackend(runner),
    }
    for name, backend in backends.items():
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        with torch.no_grad():
            outs[name] = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    assert rel_err(outs["triton"], outs["torch_native"]) < _TOL[dtype]


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode,lens,prefix_lens", [
    (ForwardMode.MIXED, [30, 25, 41], [10, 24, 40]),
    (ForwardMode.DECODE, [1, 70, 33, 200], None),
])
def test_hybrid_pool_slot_map_matches_torch_native(tk, mode, lens, prefix_lens, page):
    """A windowed layer whose K/V live in the hybrid pool's own buffers (mem_cache/swa_pool.py): the
    kernels read req_to_token's full slots through the pool's slot map, as torch_native's windowed path
    does; a scrambled map makes a missed translation read the wrong rows. Page 16: the paged pool's map
    (whole pages scrambled, offsets kept) over a paged layout."""
    from engine.mem_cache.swa_pool import SWAKVPool

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, head_dim, window = 8, 2, 64, 24
    if prefix_lens is None:
        prefix_lens = [l - 1 for l in lens]
    kv = SWAKVPool(size=1024, swa_size=1024, windowed_layers=[0], dtype=torch.float32, head_num=kv_heads,
                   head_dim=head_dim, layer_num=1, page_size=page)
    slot_map = torch.zeros(1024 + page, dtype=torch.int64)
    pages = torch.randperm(1024 // page, generator=gen) + 1
    slot_map[page:] = (pages[:, None] * page + torch.arange(page)).reshape(-1)
    kv.use_slot_map(slot_map)
    pool = {"req": ReqToTokenPool(size=8, max_context_len=256), "kv": kv}
    fb = _make_batch(mode, lens, prefix_lens, page, pool, gen, kv_heads, head_dim, torch.float32)
    layer = RadixAttention(heads, head_dim, scaling=head_dim**-0.5, num_kv_heads=kv_heads, layer_id=0,
                           sliding_window_size=window)
    n = fb.out_cache_loc.shape[0]
    q = torch.randn(n, heads * head_dim, generator=gen)
    k = torch.randn(n, kv_heads, head_dim, generator=gen)
    v = torch.randn(n, kv_heads, head_dim, generator=gen)
    runner = SimpleNamespace(device="cpu")
    outs: Dict[str, torch.Tensor] = {}
    for name, backend in (("triton", tk.backend.TritonAttnBackend(runner, max_kv_splits=4, decode_block_n=32,
                                                                  extend_blocks=(16, 16))),
                          ("torch_native", TorchNativeAttnBackend(runner))):
        fb.attn_backend = backend
        backend.init_forward_metadata(fb)
        outs[name] = backend.forward(q, k, v, layer, fb, save_kv_cache=True)
    assert rel_err(outs["triton"], outs["torch_native"]) < _TOL[torch.float32]


def test_decode_two_layers_share_one_scratch_and_match_torch_native(tk):
    """Decode scratch is allocated once per batch and reused by every layer (they run in turn)."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, lens = 4, 1, 64, [90, 3]
    kv = MHATokenToKVPool(size=256, page_size=1, dtype=torch.float32, head_num=kv_heads, head_dim=head_dim, layer_num=2)
    req = ReqToTokenPool(size=4, max_context_len=128)
    table, slots = paged_layout(lens, 1, 256, gen)
    req.req_to_token[: table.shape[0], : table.shape[1]] = table
    for layer_id in range(2):
        for s in slots:
            kv.set_kv_buffer(layer_id, s, torch.randn(len(s), kv_heads, head_dim, generator=gen),
                             torch.randn(len(s), kv_heads, head_dim, generator=gen))
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=torch.zeros(2, dtype=torch.int64),
        positions=torch.tensor(lens) - 1, req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor(lens),
        seq_lens_cpu=lens, out_cache_loc=torch.stack([s[-1] for s in slots]), seq_lens_sum=sum(lens),
        req_to_token_pool=req, token_to_kv_pool=kv,
    )
    runner = SimpleNamespace(device="cpu")
    triton_backend = tk.backend.TritonAttnBackend(runner, max_kv_splits=2, decode_block_n=16)
    native = TorchNativeAttnBackend(runner)
    layers = [RadixAttention(heads, head_dim, head_dim**-0.5, kv_heads, layer_id=i) for i in range(2)]
    q = torch.randn(2, heads * head_dim, generator=gen)
    triton_backend.init_forward_metadata(fb)
    meta = fb.attn_metadata
    assert meta.num_kv_splits.tolist() == [2, 1]
    got = [triton_backend.forward(q, None, None, layer, fb) for layer in layers]
    assert len(meta.scratch) == 1
    native.init_forward_metadata(fb)
    for layer, out in zip(layers, got):
        want = native.forward(q, None, None, layer, fb)
        assert rel_err(out, want) < _TOL[torch.float32]
    assert rel_err(got[0], got[1]) > 0.1  # the layers did read their own buffers



def test_model_greedy_with_triton_backend_matches_transformers(tk, tmp_path):
    """The tiny Llama through ModelRunner with --attention-backend triton, on scrambled 16-token
    pages and cached prefixes (one crossing a page, one absent): greedy == transformers."""
    from utils_models import BatchDriver, ExtendReq, build_tiny_model, hf_greedy, make_runner

    steps, page_size, prefix = 4, 16, [4, 18, 0, 33]
    gen = torch.Generator().manual_seed(11)
    prompts = [[int(x) for x in torch.randint(0, 512, (n,), generator=gen)] for n in (5, 23, 17, 40)]
    hf = build_tiny_model(str(tmp_path), "llama")
    expected = [hf_greedy(hf, p, steps + 1) for p in prompts]

    runner = make_runner(str(tmp_path), page_size=page_size, attention_backend="triton")
    assert type(runner.attn_backend).__name__ == "TritonAttnBackend"
    runner.attn_backend.max_kv_splits = 2  # fewer (interpreted) programs; 40+ keys still split in two
    driver = BatchDriver(runner, seed=3, scramble=True)
    rows = [driver.new_row() for _ in prompts]
    driver.run(driver.extend_batch([ExtendReq(r, p[:k]) for r, p, k in zip(rows, prompts, prefix) if k > 0]))
    _, tokens = driver.run(driver.extend_batch([ExtendReq(r, p[k:], prefix_len=k) for r, p, k in zip(rows, prompts, prefix)]))
    outputs = [[int(t)] for t in tokens]
    seq_lens = [len(p) for p in prompts]
    for _ in range(steps):
        _, tokens = driver.run(driver.decode_batch(rows, [o[-1] for o in outputs], seq_lens))
        seq_lens = [n + 1 for n in seq_lens]
        for o, t in zip(outputs, tokens):
            o.append(int(t))
    assert outputs == expected

def test_tree_speculation_with_triton_backend_keeps_greedy_outputs(tk):
    """STANDALONE tree drafts (draft = target, two steps, the full tree of topk 2) through the
    scheduler with --attention-backend triton: the drafter's and the target's tree forwards go
    through the kernel's tree mask; outputs equal those without speculation and every verify step
    accepts the whole depth."""
    from sched_utils import Harness
    from test_speculative_ngram import _prompts
    from utils_models import LetterTokenizer

    from engine.builtin_model import ensure_builtin_model
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    tiny = ensure_builtin_model()

    def run(spec: bool):
        worker = TpModelWorker(ServerArgs(model_path=tiny, device="cpu", max_total_tokens=2048,
                                          max_running_requests=16, attention_backend="triton"))
        extra = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny, speculative_num_steps=2,
                     speculative_eagle_topk=2, speculative_num_draft_tokens=7,
                     speculative_batch_size_threshold=1024, disable_speculative_adaptive=True) if spec else {}
        h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=2048, attention_backend="triton", **extra)
        rids = [h.submit(_prompts()[0], max_new_tokens=4, ignore_eos=True)]
        h.run_until_idle()
        return [h.outputs[r].output_ids for r in rids], h.scheduler.internal_state()

    plain, _ = run(False)
    spec, state = run(True)
    assert spec == plain
    # 3 tokens after the prefill's: one verify step of 1 + 2.
    assert state["spec_verify_ct"] == 1 and state["avg_spec_accept_length"] == 3.0, state


def test_windowed_tree_speculation_with_triton_backend_keeps_greedy_outputs(tk, tmp_path):
    """Tree drafts on windowed and sink layers (gpt-oss; soft caps: test_windowed_tree_rows_match_torch_native)
    with --attention-backend triton (refused at start-up before): the windowed target as its own
    STANDALONE draft, prompts past its window of 16;
    outputs equal those without speculation and every verify step accepts the whole depth, which holds
    only if each draft and verify row was windowed at its node's position."""
    from sched_utils import Harness
    from utils_models import LetterTokenizer
    from utils_models import TINY_SWA, build_tiny_model

    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    path = str(tmp_path / "gpt_oss")
    build_tiny_model(path, "gpt_oss", seed=11, **TINY_SWA["gpt_oss"])
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (30, 21)]

    def run(spec: bool):
        worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=1024,
                                          max_running_requests=4, attention_backend="triton"))
        extra = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=path, speculative_num_steps=2,
                     speculative_eagle_topk=2, speculative_num_draft_tokens=5,
                     speculative_batch_size_threshold=1024, disable_speculative_adaptive=True) if spec else {}
        h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=1024, attention_backend="triton", **extra)
        rids = [h.submit(p, max_new_tokens=7, ignore_eos=True) for p in prompts]
        h.run_until_idle()
        return [h.outputs[r].output_ids for r in rids], h.scheduler.internal_state()

    plain, _ = run(False)
    spec, state = run(True)
    assert spec == plain
    # 6 tokens after the prefill's: two verify steps of 1 + 2 per request.
    assert state["spec_verify_ct"] == 4 and state["spec_accepted_tokens"] == 8, state


if not _INTERPRETED:
    # The cases run in the driver's TRITON_INTERPRET=1 subprocess, not in this process.
    _OUTER_TESTS = ("test_kernels_under_triton_interpreter", "test_triton_backend_on_cpu_needs_the_interpreter")
    for _name in [n for n in list(globals()) if n.startswith("test_") and n not in _OUTER_TESTS]:
        del globals()[_name]
else:
    del test_kernels_under_triton_interpreter, test_triton_backend_on_cpu_needs_the_interpreter
