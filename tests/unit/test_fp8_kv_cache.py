"""The fp8 KV cache (--kv-cache-dtype fp8_e5m2 / fp8_e4m3): the pool, the checkpoint's scales, and the
CPU readers (the native decode kernel, torch_native's gather, extend and windowed paths).

Oracle: attention in float64 over the K/V rounded through fp8 as the pool stores them (x / scale
rounded to the format, times the scale), so the only differences allowed are float32 sums and the
output's rounding to the query dtype. A misread byte, a wrong scale or a wrong format is off by far more.
"""

from __future__ import annotations

import subprocess
from types import SimpleNamespace
from typing import List

import pytest
import torch

from engine.kernels import attention as attention_kernels
from engine.kernels import library
from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend
from engine.layers.radix_attention import RadixAttention
from engine.mem_cache.memory_pool import (MHATokenToKVPool, ReqToTokenPool, dequantize, kv_cache_dtype,
                                          quantize_fp8)
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from engine.model_loader.kv_scales import collect_kv_scales, kv_scale_target, read_kv_scales

FP8 = [torch.float8_e5m2, torch.float8_e4m3fn]
_TOL = {torch.float32: 2e-5, torch.bfloat16: 1e-2}


def rounded(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What an fp8 pool gives back for x: (x / scale, rounded to the fp8 format) * scale, the division
    and the product in float32 as the pool does them, returned as float64."""
    limit = torch.finfo(dtype).max
    return ((x.float() / scale).clamp(-limit, limit).to(dtype).float() * scale).double()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


# ------------------------------------------------------------------------------------- the pool
def test_kv_cache_dtype_names() -> None:
    assert kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_dtype("fp8_e5m2", torch.bfloat16) == torch.float8_e5m2
    assert kv_cache_dtype("fp8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert kv_cache_dtype("bf16", torch.float32) == kv_cache_dtype("bfloat16", torch.float32) == torch.bfloat16
    with pytest.raises(ValueError, match="fp8_e5m2"):
        kv_cache_dtype("fp8", torch.bfloat16)


@pytest.mark.parametrize("dtype", FP8)
def test_pool_stores_one_byte_per_element_with_layer_scales(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    pool = MHATokenToKVPool(size=64, page_size=1, dtype=dtype, head_num=2, head_dim=16, layer_num=2,
                            k_scales=[1.0, 0.25], v_scales=[2.0, 1.0])
    bf16 = MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=16, layer_num=2)
    assert pool.k_buffer[0].element_size() == 1 and pool.k_buffer[0].dtype == dtype
    assert 2 * pool.bytes_per_token() == bf16.bytes_per_token()
    loc = torch.tensor([5, 9, 3])
    for layer, (ks, vs) in enumerate([(1.0, 2.0), (0.25, 1.0)]):
        k = torch.randn(3, 2, 16, generator=gen) * 4
        v = torch.randn(3, 2, 16, generator=gen)
        k[0, 0, 0] = 1e9  # past the format's range: clamped to its largest value, never inf / NaN
        pool.set_kv_buffer(layer, loc, k.to(torch.bfloat16), v.to(torch.bfloat16))
        k_buf, v_buf = pool.get_kv_buffer(layer)
        got_k = pool.read_k(layer, k_buf[loc], torch.float64)
        got_v = pool.read_v(layer, v_buf[loc], torch.float64)
        torch.testing.assert_close(got_k, rounded(k.to(torch.bfloat16), ks, dtype), rtol=0, atol=0)
        torch.testing.assert_close(got_v, rounded(v.to(torch.bfloat16), vs, dtype), rtol=0, atol=0)
        assert got_k[0, 0, 0] == torch.finfo(dtype).max * ks
        assert bool(torch.isfinite(k_buf.float()).all())
    # Slots not written stay zero; the padding slot too.
    assert pool.k_buffer[0][0].float().abs().max() == 0


@pytest.mark.parametrize("mla", [False, True])
def test_move_kv_moves_fp8_bytes(mla: bool) -> None:
    """A speculative tree's accepted path moved into chain order in an fp8 pool (MHA's K and V, or the
    latent pool's one row): the bytes move as they are, overlapping sources read before any write."""
    from engine.mem_cache.memory_pool import MHATokenToKVPool
    from engine.mem_cache.mla_pool import MLATokenToKVPool

    pool = (MLATokenToKVPool(8, 1, torch.float8_e4m3fn, kv_lora_rank=4, qk_rope_head_dim=2, layer_num=2) if mla
            else MHATokenToKVPool(8, 1, torch.float8_e4m3fn, head_num=2, head_dim=4, layer_num=2))
    planes = [p for layer in range(pool.layer_num) for p in pool.layer_planes(layer)]
    for plane in planes:
        plane.view(torch.uint8).copy_(torch.randint(0, 120, plane.shape, dtype=torch.uint8))
    before = [p.view(torch.uint8).clone() for p in planes]
    pool.move_kv(torch.tensor([2, 4]), torch.tensor([1, 2]))
    for plane, old in zip(planes, before):
        now = plane.view(torch.uint8)
        assert torch.equal(now[1], old[2]) and torch.equal(now[2], old[4]) and torch.equal(now[3:], old[3:])


def test_pool_refuses_bad_scales() -> None:
    args = dict(size=8, page_size=1, head_num=1, head_dim=8, layer_num=2)
    with pytest.raises(ValueError, match="2 layers"):
        MHATokenToKVPool(dtype=torch.float8_e4m3fn, k_scales=[1.0], **args)
    with pytest.raises(ValueError, match="finite and > 0"):
        MHATokenToKVPool(dtype=torch.float8_e4m3fn, v_scales=[1.0, 0.0], **args)
    with pytest.raises(ValueError, match="fp8 KV cache only"):
        MHATokenToKVPool(dtype=torch.bfloat16, k_scales=[1.0, 0.5], **args)


def test_quantizing_leaves_the_input_alone() -> None:
    k = torch.tensor([[[1000.0, -1e6, 0.5]]])
    before = k.clone()
    pool = MHATokenToKVPool(size=4, page_size=1, dtype=torch.float8_e4m3fn, head_num=1, head_dim=3, layer_num=1)
    pool.set_kv_buffer(0, torch.tensor([1]), k, k)
    stored_k, _ = pool.as_stored(0, k, k)
    assert torch.equal(k, before)
    assert stored_k.tolist() == [[[448.0, -448.0, 0.5]]]


def test_dequantize_is_exact_at_scale_one() -> None:
    every = torch.arange(256, dtype=torch.uint8)
    for dtype in FP8:
        values = every.view(dtype)
        finite = torch.isfinite(values.float())
        for out in (torch.bfloat16, torch.float16):
            assert torch.equal(dequantize(values, 1.0, out).float()[finite], values.float()[finite])
        q = quantize_fp8(values.float()[finite], 1.0, dtype)
        assert torch.equal(q.view(torch.uint8), every[finite])  # round trip: each value is its own rounding


# ----------------------------------------------------------------------------- checkpoint scales
def test_kv_scale_names() -> None:
    assert kv_scale_target("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_target("model.layers.3.self_attn.attn.v_scale") == (3, "v")
    assert kv_scale_target("model.layers.0.self_attn.kv_scale") == (0, "kv")
    assert kv_scale_target("model.layers.7.self_attn.k_proj.output_scale") == (7, "k")
    assert kv_scale_target("model.layers.7.self_attn.v_proj.output_scale") == (7, "v")
    assert kv_scale_target("model.layers.7.self_attn.k_proj.weight_scale") is None
    assert kv_scale_target("model.layers.7.mlp.down_proj.weight") is None
    k, v, found = collect_kv_scales([("model.layers.0.self_attn.kv_scale", 0.5),
                                     ("model.layers.1.self_attn.v_scale", 3.0)], 3)
    assert (k, v, found) == ([0.5, 1.0, 1.0], [0.5, 3.0, 1.0], 2)
    with pytest.raises(ValueError, match="layer 5"):
        collect_kv_scales([("model.layers.5.self_attn.k_scale", 1.0)], 3)
    with pytest.raises(ValueError, match="finite and > 0"):
        collect_kv_scales([("model.layers.0.self_attn.k_scale", -1.0)], 3)


def test_checkpoint_scales_reach_the_pool(tmp_path) -> None:
    """A checkpoint with per-layer k_scale / v_scale (as llm-compressor writes them): the fp8 pool takes
    them, the weights load without complaint, and an auto pool ignores them."""
    from safetensors.torch import load_file, save_file
    from utils_models import build_tiny_model, make_runner

    build_tiny_model(str(tmp_path), "llama")
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor([2.0])
    save_file(tensors, str(path))
    assert read_kv_scales(str(tmp_path), 2) == ([0.5, 1.0], [1.0, 2.0])
    runner = make_runner(str(tmp_path), kv_cache_dtype="fp8_e4m3")
    pool = runner.token_to_kv_pool
    assert pool.dtype == torch.float8_e4m3fn and pool.k_scales[:2] == [0.5, 1.0] and pool.v_scales[:2] == [1.0, 2.0]
    auto = make_runner(str(tmp_path))
    assert auto.token_to_kv_pool.k_scales[:2] == [1.0, 1.0]


def test_pool_sizing_counts_one_byte_elements(tmp_path) -> None:
    from utils_models import build_tiny_model, make_runner

    build_tiny_model(str(tmp_path), "llama")
    bf16 = make_runner(str(tmp_path), dtype="bfloat16")
    fp8 = make_runner(str(tmp_path), dtype="bfloat16", kv_cache_dtype="fp8_e5m2")
    assert bf16.kv_bytes_per_token() == 2 * fp8.kv_bytes_per_token() == 2 * fp8.token_to_kv_pool.bytes_per_token()
    # Sized by memory (no --max-total-tokens): twice the tokens in the same budget, up to the CPU cap.
    assert fp8.profile_max_num_token() >= min(2 * bf16.profile_max_num_token() - 2, 1 << 18)


def test_flashinfer_refuses_fp8() -> None:
    from engine.server_args import ServerArgs, ServerArgsError

    with pytest.raises(ServerArgsError, match="flashinfer"):
        ServerArgs(model_path="x", device="cuda", attention_backend="flashinfer", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ServerArgsError):
        ServerArgs(model_path="x", device="cpu", kv_cache_dtype="fp8")


# ------------------------------------------------------------------------ the native decode kernel
def _decode_reference(q, k_ref, v_ref, idx, lens, heads, kv_heads, scale) -> torch.Tensor:
    bs, dim = q.shape[0], k_ref.shape[-1]
    out = []
    for b in range(bs):
        slots = idx[b, : lens[b]]
        k, v = k_ref[slots], v_ref[slots]  # [n, KH, D] float64
        qq = q[b].double().view(kv_heads, heads // kv_heads, dim)
        p = (torch.einsum("hgd,nhd->hgn", qq, k) * scale).softmax(-1)
        out.append(torch.einsum("hgn,nhd->hgd", p, v).reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("q_dtype,dim", [(torch.float32, 64), (torch.bfloat16, 128), (torch.float32, 36)])
def test_native_decode_kernel_reads_fp8(kernel_build: str, kv_dtype, q_dtype, dim) -> None:
    """Ragged lengths over scattered slots, GQA 4, head sizes with and without an 8-wide tail, both
    task layouts (a few requests: one KV head a task; many: whole requests)."""
    if library.attention() is None:
        pytest.skip("no kernel library")
    gen = torch.Generator().manual_seed(dim)
    heads, kv_heads, slots = 8, 2, 700
    ks, vs = 0.37, 1.9
    k_true = torch.randn(slots, kv_heads, dim, generator=gen) * 2
    v_true = torch.randn(slots, kv_heads, dim, generator=gen)
    k8, v8 = quantize_fp8(k_true, ks, kv_dtype), quantize_fp8(v_true, vs, kv_dtype)
    k_ref, v_ref = rounded(k_true, ks, kv_dtype), rounded(v_true, vs, kv_dtype)
    for bs in (3, 9):
        lens = torch.randint(1, 300, (bs,), generator=gen)
        idx = torch.stack([torch.randperm(slots - 1, generator=gen)[:300] + 1 for _ in range(bs)])
        q = torch.randn(bs, heads * dim, generator=gen).to(q_dtype)
        out = attention_kernels.decode_attention(q, k8, v8, idx, lens, heads, kv_heads, dim, dim ** -0.5,
                                                 kv_scales=(ks, vs))
        ref = _decode_reference(q, k_ref, v_ref, idx, lens, heads, kv_heads, dim ** -0.5)
        assert out.dtype == q_dtype
        assert rel_err(out, ref) < _TOL[q_dtype], (bs, rel_err(out, ref))


@pytest.mark.parametrize("kv_dtype", FP8)
def test_native_decode_kernel_cascade_over_fp8(kernel_build: str, kv_dtype) -> None:
    """A shared prefix read once for a group (phase 1) and each request's own suffix (phase 2)."""
    if library.attention() is None:
        pytest.skip("no kernel library")
    gen = torch.Generator().manual_seed(7)
    heads, kv_heads, dim, slots = 4, 2, 64, 600
    ks, vs = 0.8, 0.6
    k_true, v_true = torch.randn(slots, kv_heads, dim, generator=gen), torch.randn(slots, kv_heads, dim, generator=gen)
    k8, v8 = quantize_fp8(k_true, ks, kv_dtype), quantize_fp8(v_true, vs, kv_dtype)
    k_ref, v_ref = rounded(k_true, ks, kv_dtype), rounded(v_true, vs, kv_dtype)
    prefix = torch.arange(1, 201)
    suffix_lens = [5, 17, 1]
    suffixes = [torch.arange(300 + 40 * i, 300 + 40 * i + n) for i, n in enumerate(suffix_lens)]
    bs = 4  # rows 0..2 share the prefix, row 3 has none
    full = [torch.cat([prefix, s]) for s in suffixes] + [torch.arange(450, 520)]
    own = suffixes + [full[3]]
    width = max(len(x) for x in own)
    idx = torch.zeros(bs, width, dtype=torch.long)
    for b, s in enumerate(own):
        idx[b, : len(s)] = s
    lens = torch.tensor([len(s) for s in own])
    cascade = attention_kernels.CascadeTables(
        group_offsets=torch.tensor([0, 3]), members=torch.tensor([0, 1, 2]), prefix_indices=prefix.view(1, -1),
        prefix_lens=torch.tensor([200]), group_of=torch.tensor([0, 0, 0, -1]))
    q = torch.randn(bs, heads * dim, generator=gen)
    out = attention_kernels.decode_attention(q, k8, v8, idx, lens, heads, kv_heads, dim, 0.125, cascade=cascade,
                                             kv_scales=(ks, vs))
    full_idx = torch.zeros(bs, max(len(x) for x in full), dtype=torch.long)
    for b, s in enumerate(full):
        full_idx[b, : len(s)] = s
    ref = _decode_reference(q, k_ref, v_ref, full_idx, [len(x) for x in full], heads, kv_heads, 0.125)
    assert rel_err(out, ref) < 2e-5


def test_portable_c_path_without_avx2(tmp_path) -> None:
    """The kernel's plain-C fp8 conversion (no AVX2 / F16C) equals the AVX2 one on every byte: the
    decode kernel compiled both ways reads the same values (through a unit query that picks one key)."""
    import os
    import shutil

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None or library.attention() is None:
        pytest.skip("no C compiler")
    built = library._build(library._FLAGS + library._PORTABLE_FLAGS + ["-mno-avx2", "-mno-f16c", "-mno-fma"])
    assert built is not None
    plain = library._declare(built).attention
    every = torch.arange(256, dtype=torch.uint8)
    for kv_dtype in FP8:
        values = every.view(kv_dtype)
        ok = torch.isfinite(values.float())
        # 1 query, 1 head, dim 8: V rows of one key each hold 8 bytes; output = that key's V row.
        v8 = values[ok].view(-1, 1, 8) if ok.sum() % 8 == 0 else values[ok][: ok.sum() // 8 * 8].view(-1, 1, 8)
        n = v8.shape[0]
        k8 = torch.zeros(n, 1, 8, dtype=kv_dtype)
        for name, lib in (("native", library.attention()), ("plain", plain)):
            outs = []
            for slot in range(n):
                args = dict(q=torch.zeros(1, 8), idx=torch.tensor([[slot]]), lens=torch.tensor([1]))
                out = torch.empty(1, 8)
                a = attention_kernels.DecodeAttentionArgs(
                    q=args["q"].data_ptr(), k=k8.data_ptr(), v=v8.data_ptr(), kv_indices=args["idx"].data_ptr(),
                    lens=args["lens"].data_ptr(), max_len=1, bs=1, heads=1, kv_heads=1, dim=8, k_stride=8,
                    v_stride=8, scale=1.0, dtype=0, kv_dtype=2 if kv_dtype == torch.float8_e5m2 else 3, k_scale=1.0,
                    v_scale=1.0, out=out.data_ptr(), num_threads=1)
                assert lib is not None
                lib.decode_attention(a)
                outs.append(out.clone())
            got = torch.cat(outs).reshape(-1)
            assert torch.equal(got, v8.float().reshape(-1)), name


def test_avx512_paths_compile() -> None:
    """The kernel's AVX-512 / AMX paths (not run on this CPU) still compile with the fp8 changes."""
    import os
    import platform
    import shutil

    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 compilers only")
    src = library._CSRC / "decode_attention.c"
    proc = subprocess.run([cc, "-O1", "-march=sapphirerapids", "-fopenmp-simd", "-std=c11", "-fsyntax-only", str(src)],
                          capture_output=True, text=True, timeout=120)
    if "sapphirerapids" in proc.stderr:
        pytest.skip(f"{cc} does not know -march=sapphirerapids")
    assert proc.returncode == 0, proc.stderr[-2000:]


# --------------------------------------------------------------------- the torch_native backend
def _batch(mode, lens: List[int], prefix_lens: List[int], pool, req_pool, gen, kv_heads, dim):
    """Requests over scattered slots; the prefixes' K/V written to the pool; returns the batch and the
    true (unrounded) K/V of every slot."""
    size = pool.size
    perm = (torch.randperm(size - 1, generator=gen) + 1).tolist()
    slots = [torch.tensor([perm.pop() for _ in range(n)]) for n in lens]
    for i, s in enumerate(slots):
        req_pool.req_to_token[i + 1, : len(s)] = s.to(torch.int32)
    k_all = torch.randn(size + 1, kv_heads, dim, generator=gen)
    v_all = torch.randn(size + 1, kv_heads, dim, generator=gen)
    for s, p in zip(slots, prefix_lens):
        if p:
            pool.set_kv_buffer(0, s[:p], k_all[s[:p]], v_all[s[:p]])
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
    return fb, slots, k_all, v_all


def _reference(q, fb, slots, k_all, v_all, prefix_lens, layer, kv_dtype, scales, window=-1) -> torch.Tensor:
    """float64 attention over every key rounded through fp8 as the pool holds it (the new tokens' too)."""
    heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    ks, vs = scales
    out, row = [], 0
    for s, p in zip(slots, prefix_lens):
        n, ext = len(s), len(s) - p
        k, v = rounded(k_all[s], ks, kv_dtype), rounded(v_all[s], vs, kv_dtype)
        qq = q[row:row + ext].double().view(ext, kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("ehgd,nhd->hgen", qq, k) * layer.scaling
        q_pos = torch.arange(p, n).unsqueeze(1)
        k_pos = torch.arange(n).unsqueeze(0)
        visible = k_pos <= q_pos
        if window > 0:
            visible &= k_pos > q_pos - window
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out.append(torch.einsum("hgen,nhd->ehgd", probs, v).reshape(ext, -1))
        row += ext
    return torch.cat(out)


CASES = [
    (ForwardMode.DECODE, [1, 90, 33, 150], None),
    (ForwardMode.EXTEND, [30, 9, 50], [12, 8, 0]),
    (ForwardMode.EXTEND, [23, 1, 40], [0, 0, 0]),
    (ForwardMode.MIXED, [30, 25, 41], [10, 24, 40]),
]


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("mode,lens,prefix_lens", CASES)
@pytest.mark.parametrize("path", ["native", "torch", "windowed"])
def test_torch_native_backend_over_fp8(kv_dtype, mode, lens, prefix_lens, path, monkeypatch) -> None:
    if path == "torch":  # the gather + SDPA paths (a machine without a C compiler)
        monkeypatch.setitem(library.switches(), library.Family.ATTENTION, False)
    elif library.attention() is None:
        pytest.skip("no kernel library")
    gen = torch.Generator().manual_seed(len(lens) + (path == "torch"))
    heads, kv_heads, dim = 8, 2, 64
    scales = (0.7, 1.6)
    prefix_lens = [n - 1 for n in lens] if prefix_lens is None else prefix_lens
    pool = MHATokenToKVPool(size=512, page_size=1, dtype=kv_dtype, head_num=kv_heads, head_dim=dim, layer_num=1,
                            k_scales=[scales[0]], v_scales=[scales[1]])
    req_pool = ReqToTokenPool(size=8, max_context_len=256)
    fb, slots, k_all, v_all = _batch(mode, lens, prefix_lens, pool, req_pool, gen, kv_heads, dim)
    window = 20 if path == "windowed" else -1
    layer = RadixAttention(heads, dim, scaling=dim ** -0.5, num_kv_heads=kv_heads, layer_id=0,
                           sliding_window_size=window)
    backend = TorchNativeAttnBackend(SimpleNamespace(device="cpu"))
    fb.attn_backend = backend
    backend.init_forward_metadata(fb)
    new = fb.out_cache_loc
    q = torch.randn(new.numel(), heads * dim, generator=gen)
    out = backend.forward(q, k_all[new], v_all[new], layer, fb, save_kv_cache=True)
    ref = _reference(q, fb, slots, k_all, v_all, prefix_lens, layer, kv_dtype, scales, window)
    assert rel_err(out, ref) < 2e-5
    # The new tokens' K/V went into the pool, rounded.
    k_buf, _ = pool.get_kv_buffer(0)
    torch.testing.assert_close(pool.read_k(0, k_buf[new], torch.float64), rounded(k_all[new], scales[0], kv_dtype),
                               rtol=0, atol=0)


def test_flag_choices_are_the_pools_dtype_names():
    # server_args keeps its own list (it does not import torch); the pool's table is the one used.
    from engine.mem_cache.memory_pool import KV_CACHE_DTYPES
    from engine.server_args import KV_CACHE_DTYPE_NAMES

    assert KV_CACHE_DTYPE_NAMES == tuple(KV_CACHE_DTYPES)
