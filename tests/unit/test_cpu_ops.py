"""The fused CPU element-wise ops (csrc/cpu_ops.c) against the layers' torch code on the same inputs."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import linear as linear_kernels
from engine.kernels import library
from engine.kernels import ops as kernel_ops
from engine.kernels.library import Family
from engine.layers.activation import SiluAndMul
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary_embedding import get_rope
from engine.mem_cache.memory_pool import MHATokenToKVPool


@pytest.fixture(autouse=True)
def need_library():
    from engine.kernels import library

    if library.ops() is None:
        if not library.switches()[Family.OPS] or not (shutil.which("gcc") or shutil.which("cc")):
            pytest.skip("the native CPU kernels are off or there is no C compiler")
        pytest.fail("a C compiler is present but the CPU kernels did not build (see the log)")


def both_paths(monkeypatch, fn):
    """fn() through the fused kernels, then through the torch code (ENGINE_CPU_KERNEL_OPS=0's path)."""
    assert library.ops() is not None
    fused = fn()
    monkeypatch.setitem(library.switches(), Family.OPS, False)
    reference = fn()
    monkeypatch.setitem(library.switches(), Family.OPS, True)
    return fused, reference


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    # bfloat16: both paths round at the same points; float32 sums may differ in order.
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    return a.dtype == b.dtype == dtype and a.shape == b.shape and torch.allclose(a.float(), b.float(), **tol)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 x 1024 runs on the whole thread team
def test_rmsnorm_with_and_without_residual(monkeypatch, kernel_build, dtype, rows):
    torch.manual_seed(rows)
    norm = RMSNorm(1024, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(1024).to(dtype)
    x, res = torch.randn(rows, 1024).to(dtype), torch.randn(rows, 1024).to(dtype)
    fused, ref = both_paths(monkeypatch, lambda: norm(x))
    assert close(fused, ref, dtype)
    (fused_out, fused_res), (ref_out, ref_res) = both_paths(monkeypatch, lambda: norm(x, res))
    assert close(fused_out, ref_out, dtype) and torch.equal(fused_res, ref_res)
    # bfloat16: the same roundings, so nearly every element is bit-equal.
    if dtype == torch.bfloat16:
        assert (fused_out == ref_out).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 200])
def test_silu_and_mul(monkeypatch, kernel_build, dtype, tokens):
    torch.manual_seed(tokens)
    x = (torch.randn(tokens, 2 * 2048) * 4).to(dtype)
    fused, ref = both_paths(monkeypatch, lambda: SiluAndMul()(x))
    assert close(fused, ref, dtype)
    assert torch.allclose(fused.float(), (F.silu(x[:, :2048].float()) * x[:, 2048:].float()), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 16), (2, 17), (128, 32000), (3, 151936)])
def test_greedy_argmax_equals_torch(monkeypatch, kernel_build, shape):
    torch.manual_seed(shape[1])
    x = torch.randn(*shape)
    fused, ref = both_paths(monkeypatch, lambda: kernel_ops.greedy(x))
    assert fused.dtype == torch.int64 and torch.equal(fused, ref)
    # Ties take the first index, in the vector part and the tail; a row of -inf gives 0.
    ties = torch.randint(0, 3, (64, 1000)).float()
    assert torch.equal(kernel_ops.greedy(ties), ties.argmax(-1))
    rows = torch.zeros(5, 40)
    rows[0, 5] = rows[0, 30] = rows[0, 37] = 1.0
    rows[1] = -float("inf")
    rows[2, 20] = rows[2, 3] = float("nan")  # torch: NaN is the largest, the first one wins
    rows[3, 37] = float("nan")  # in the tail
    rows[4, 0] = float("nan")
    assert kernel_ops.greedy(rows).tolist() == rows.argmax(-1).tolist() == [5, 0, 3, 37, 0]
    # Rows further apart than their length (the logits of a padded vocabulary, sliced).
    wide = torch.randn(8, 100)[:, :50]
    assert torch.equal(kernel_ops.greedy(wide), wide.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
def test_rotary_in_place_on_qkv_slices(monkeypatch, kernel_build, dtype, rotary_dim):
    """Rotating the q and k slices of a fused qkv output in place leaves v alone and equals the
    torch path (which returns new tensors)."""
    torch.manual_seed(rotary_dim)
    head, heads, kv_heads, tokens = 64, 16, 8, 37
    rope = get_rope(head, rotary_dim, 4096, 10000.0)
    positions = torch.randint(0, 4096, (tokens,))
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head).to(dtype)
    q_size, kv_size = heads * head, kv_heads * head

    def run(inplace: bool):
        data = qkv.clone()
        q, k, v = data.split([q_size, kv_size, kv_size], dim=-1)
        q2, k2 = rope(positions, q, k, inplace=inplace)
        return q2.clone(), k2.clone(), data

    (fq, fk, fdata), (rq, rk, _) = both_paths(monkeypatch, lambda: run(True))
    assert close(fq, rq, dtype) and close(fk, rk, dtype)
    assert torch.equal(fdata[:, :q_size], fq) and torch.equal(fdata[:, q_size + kv_size:], qkv[:, q_size + kv_size:])
    out_of_place = run(False)
    assert torch.equal(out_of_place[0], fq) and torch.equal(out_of_place[2], qkv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_from_qkv_slices(monkeypatch, kernel_build, dtype):
    torch.manual_seed(0)
    kv_heads, head, tokens = 4, 32, 9
    qkv = torch.randn(tokens, 3 * kv_heads * head).to(dtype)
    k = qkv[:, kv_heads * head: 2 * kv_heads * head].view(tokens, kv_heads, head)
    v = qkv[:, 2 * kv_heads * head:].view(tokens, kv_heads, head)
    loc = torch.randperm(60)[:tokens] + 1

    def run():
        pool = MHATokenToKVPool(64, 1, dtype, kv_heads, head, layer_num=2)
        pool.set_kv_buffer(1, loc, k, v)
        return pool.k_buffer[1].clone(), pool.v_buffer[1].clone(), pool.k_buffer[0].clone()

    (fk, fv, f0), (rk, rv, r0) = both_paths(monkeypatch, run)
    assert torch.equal(fk, rk) and torch.equal(fv, rv) and torch.equal(f0, r0)
    assert torch.equal(fk[loc], k) and torch.equal(fv[loc], v)


# 16, 17, 33: AMX's 16-row blocks, whole and with a partial last block
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 16, 17, 33, 600])
@pytest.mark.parametrize("n,k", [(64, 32), (100, 48), (2048, 1024)])  # 100: a partial last panel
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_kernel_matches_float_reference(cpu_isa, rows, n, k, with_bias):
    torch.manual_seed(rows + n)
    weight = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k).to(torch.bfloat16)
    panels = linear_kernels.pack_linear_bf16(weight, bias)
    out = linear_kernels.linear_bf16(x, panels, add_bias=with_bias)
    ref = x.float() @ weight.float().t() + (bias.float() if with_bias else 0)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # float32 sums of exact bf16 products, rounded once: within bf16 rounding of the reference
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    # a row-parallel layer adds its bias after the all-reduce: add_bias=False leaves it out
    assert torch.allclose(linear_kernels.linear_bf16(x, panels, add_bias=False).float(), x.float() @ weight.float().t(),
                          rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("rows", [1, 5, 6, 13, 17, 600])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gate_up_linear_with_silu_and_mul_equals_the_two_calls(monkeypatch, cpu_isa, rows, with_bias):
    from engine.layers.linear import prepack_linear_weights
    from engine.models.llama import LlamaMLP

    torch.manual_seed(rows)
    mlp = LlamaMLP(256, 384, bias=with_bias).to(torch.bfloat16)  # 384: the halves are 6 whole panels
    for param in mlp.parameters():
        param.data = (torch.randn_like(param, dtype=torch.float32) * 0.2).to(torch.bfloat16)
    assert prepack_linear_weights(mlp) == 2
    x = torch.randn(rows, 256).to(torch.bfloat16)
    calls = []
    kernel = linear_kernels.linear_bf16_silu_mul
    monkeypatch.setattr(linear_kernels, "linear_bf16_silu_mul", lambda *a: calls.append(1) or kernel(*a))
    fused = mlp(x)
    assert calls, "the MLP did not take the fused kernel"
    # The same bits as the gate_up linear kernel followed by the SiLU-and-mul kernel.
    two_calls = mlp.down_proj(kernel_ops.silu_and_mul(mlp.gate_up_proj(x)))
    assert torch.equal(fused, two_calls)
    # And close to the torch reference (oneDNN/F.linear, F.silu) with the kernels off.
    monkeypatch.setitem(library.switches(), Family.LINEAR, False)
    monkeypatch.setitem(library.switches(), Family.OPS, False)
    reference = mlp(x)
    assert torch.allclose(fused.float(), reference.float(), rtol=5e-2, atol=5e-2 * reference.abs().max().item())


def test_bf16_linear_layers_use_the_kernel_and_fall_back(monkeypatch):
    from engine.layers.linear import ColumnParallelLinear, prepack_linear_weights
    from engine.model_loader.weight_utils import clear_packed_weights

    layer = ColumnParallelLinear(64, 96, bias=True).to(torch.bfloat16)
    torch.manual_seed(0)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(3, 64).to(torch.bfloat16)
    plain = layer(x)
    packed = prepack_linear_weights(layer)
    if packed == 0:
        # Neither the native kernel nor oneDNN's bf16 packing runs on this CPU (AVX2 only: oneDNN's
        # bf16 reorder needs AVX512 or AVX-NE-CONVERT): the layer keeps F.linear.
        assert not linear_kernels.linear_bf16_usable(layer.weight)
        assert layer.packed_weight is None
        assert torch.equal(layer(x), plain)
    else:
        assert packed == 1
    if isinstance(layer.packed_weight, linear_kernels.Bf16Panels):
        fused, ref = both_paths(monkeypatch, lambda: layer(x))
        assert torch.equal(ref, plain)  # switched off: F.linear again
        assert torch.allclose(fused.float(), plain.float(), rtol=2e-2, atol=2e-2)
    clear_packed_weights(layer)
    assert layer.packed_weight is None


def _rms_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out, _ = kernel_ops.rms_norm(x, weight, 1e-6)
    return out


def test_kernel_thread_pool_serves_concurrent_callers_and_forked_children():
    """The kernels' thread pool (csrc/thread_pool.c) runs one job at a time: a second thread's call
    runs alone on its own thread, with the same result; a forked child, which has none of the
    parent's pool threads, starts its own."""
    import threading

    torch.manual_seed(0)
    x = torch.randn(300, 1024)  # past the size that splits RMSNorm over the threads
    weight = torch.randn(1024)
    expected = _rms_rows(x, weight)
    results, errors = [], []

    def call() -> None:
        try:
            for _ in range(50):
                results.append(torch.equal(_rms_rows(x, weight), expected))
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and len(results) == 150 and all(results)

    # A forked child (os.fork straight: no tensors through multiprocessing's pickling) computes the
    # same rows on 2 threads and reports whether they match.
    # The child compares bytes: torch's own OpenMP team may hang in a child forked after it ran (a
    # known hazard of fork, unrelated to the pool), so no torch op runs there.
    expected_bytes = expected.numpy().tobytes()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        ok = False
        try:
            ok = _forked_rms(x, weight).numpy().tobytes() == expected_bytes
        finally:
            os.write(write_end, b"1" if ok else b"0")
            os._exit(0)
    os.close(write_end)
    try:
        assert os.read(read_end, 1) == b"1"
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


def _forked_rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The library straight, on 2 threads (no torch op: see the test).
    from engine.kernels import library

    out = torch.empty(x.shape)  # an allocation, no kernel
    lib = library.ops()
    assert lib is not None
    lib.rms_norm(x.data_ptr(), None, weight.data_ptr(), out.data_ptr(), None, x.shape[0], x.shape[1], 1e-6, 0, 2)
    return out
