"""The fused MoE layer's pieces on the CPU: the router against transformers' routers, the torch path
(grouped by expert) against a token-by-token reference in float32 and bfloat16 (with slots held by
another EP rank), the block alignment the Triton kernel relies on, and the expert counter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.layers.moe.expert_distribution import ExpertDistributionRecorder
from engine.kernels import library, ops
from engine.kernels import linear as linear_kernels
from engine.layers.moe.fused_moe_native import fused_moe_grouped, fused_moe_native
from engine.layers.moe.router import select_experts


def reference_moe(x, w13, w2, weights, ids):
    """Token by token, slot by slot, in float64."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            if e < 0:
                continue
            h = w13[e].double() @ x[t].double()
            out[t] += float(weights[t, slot]) * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def random_case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [1, 3, 37])
def test_native_matches_token_by_token_reference(dtype, tol, tokens):
    x, w13, w2, weights, ids = random_case(tokens, 8, 2, 32, 24, dtype, seed=tokens)
    out = fused_moe_native(x, w13, w2, weights, ids)
    ref = reference_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


def test_one_token_runs_its_experts_without_grouping(monkeypatch):
    """A one-token batch (a one-request decode step) runs its chosen experts directly, no argsort / gather
    / scatter: top-4 with a slot on another rank, against the reference."""
    x, w13, w2, weights, ids = random_case(1, 8, 4, 32, 24, torch.float32, seed=3)
    ids = ids.clone()
    ids[0, 1] = -1

    def grouped(*args, **kwargs):
        raise AssertionError("a one-token batch was grouped by expert")

    monkeypatch.setattr(torch, "argsort", grouped)
    out = fused_moe_native(x, w13, w2, weights, ids)
    assert torch.allclose(out.double(), reference_moe(x, w13, w2, weights, ids), atol=1e-5)


def test_native_skips_slots_of_other_ranks():
    """EP: ids -1 (experts another rank holds) add nothing; the rest is as if alone."""
    x, w13, w2, weights, ids = random_case(9, 4, 2, 16, 8, torch.float32, seed=5)
    ids = ids.clone()
    ids[::2, 0] = -1
    out = fused_moe_native(x, w13, w2, weights, ids)
    assert torch.allclose(out.double(), reference_moe(x, w13, w2, weights, ids), atol=1e-5)
    all_elsewhere = fused_moe_native(x, w13, w2, weights, torch.full_like(ids, -1))
    assert torch.equal(all_elsewhere, torch.zeros_like(all_elsewhere))


def _require_bf16_linear() -> None:
    lib = library.linear()
    if lib is None or not lib.linear_bf16_available():
        pytest.skip("the native bf16 linear kernels need a C compiler and a CPU with AVX512-BF16")


# inter 64: gate_up is whole panel pairs (linear_bf16_silu_mul); 40: the linear, then silu_and_mul.
@pytest.mark.parametrize("inter", [64, 40])
@pytest.mark.parametrize("tokens", [1, 5, 37])
def test_native_experts_in_one_call_match_the_grouped_loop(inter, tokens):
    """csrc/moe.c's experts (the bf16 panels FusedMoE packs, one call) against the grouped loop and the
    float64 reference, with slots of another rank; bits equal to the loop run on the same kernels."""
    _require_bf16_linear()
    x, w13, w2, weights, ids = random_case(tokens, 8, 2, 64, inter, torch.bfloat16, seed=tokens + inter)
    ids = ids.clone()
    ids[::3, 1] = -1
    native = linear_kernels.NativeExperts.bf16_panels(w13, w2)
    out = linear_kernels.moe_experts(x, weights, ids, native)
    ref = reference_moe(x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max().item() < 3e-2 * max(1.0, ref.abs().max().item())

    gate_ups = [linear_kernels.pack_linear_bf16(w, None) for w in w13]
    downs = [linear_kernels.pack_linear_bf16(w, None) for w in w2]

    def gate_up(rows, e):
        if inter % 64 == 0:
            return linear_kernels.linear_bf16_silu_mul(rows, gate_ups[e])
        return ops.silu_and_mul(linear_kernels.linear_bf16(rows, gate_ups[e], add_bias=False))

    loop = fused_moe_grouped(x, 8, 64, gate_up,
                             lambda rows, e: linear_kernels.linear_bf16(rows, downs[e], add_bias=False),
                             weights, ids, lambda h: h)
    assert torch.equal(out, loop)


@pytest.mark.parametrize("method", ["w8a8_int8", "fp8"])
@pytest.mark.parametrize("tokens", [1, 6])
def test_native_quantized_experts_equal_the_grouped_loop(method, tokens):
    """--quantization's experts (int8 with int8 activations, e4m3) in csrc/moe.c: the bits of the grouped loop
    over quantized_linear (the same kernels), close to the float64 reference on the dequantized weights."""
    from engine.layers.quantization import quantize_weight, quantized_linear

    if library.linear() is None:
        pytest.skip("no kernel library on this machine")
    x, w13, w2, weights, ids = random_case(tokens, 8, 2, 64, 48, torch.bfloat16, seed=7 + tokens)
    gate_ups = [quantize_weight(w, method) for w in w13]
    downs = [quantize_weight(w, method) for w in w2]
    fmt = linear_kernels.CHAIN_FP8 if method == "fp8" else linear_kernels.CHAIN_W8A8
    native = linear_kernels.NativeExperts.quantized(fmt, [(q.qweight, q.scale) for q in gate_ups],
                                                    [(q.qweight, q.scale) for q in downs])
    out = linear_kernels.moe_experts(x, weights, ids, native)
    loop = fused_moe_grouped(x, 8, 64, lambda rows, e: quantized_linear(rows, gate_ups[e], None),
                             lambda rows, e: quantized_linear(rows, downs[e], None), weights, ids)
    assert torch.equal(out, loop)
    ref = reference_moe(x, torch.stack([q.dequantize() for q in gate_ups]),
                        torch.stack([q.dequantize() for q in downs]), weights, ids)
    assert (out.double() - ref).abs().max().item() < 5e-2 * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [True, False])
def test_native_routing_matches_torch(dtype, renormalize):
    """csrc/moe.c's moe_route (what select_experts calls on the CPU) against softmax + topk in torch; bf16
    logits tie (their top-k may list tied experts in another order, or keep the other of two tied at the
    edge): the chosen experts' probabilities are the same."""
    if library.ops() is None:
        pytest.skip("no kernel library on this machine")
    logits = torch.randn(33, 60, generator=torch.Generator().manual_seed(4)).to(dtype)
    weights, ids = ops.moe_route(logits, 6, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    ref_weights, ref_ids = torch.topk(probs, 6, dim=-1)
    if renormalize:
        ref_weights = ref_weights / ref_weights.sum(-1, keepdim=True)
    assert ids.dtype == torch.int32 and all(len(set(row)) == 6 for row in ids.tolist())
    if dtype == torch.float32:
        assert torch.equal(ids.long(), ref_ids)
    assert torch.equal(probs.gather(1, ids.long()), probs.gather(1, ref_ids))
    assert torch.allclose(weights, ref_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_matches_transformers(renormalize):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    config = Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=renormalize)
    router = Qwen2MoeTopKRouter(config)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, hf_weights, hf_ids = router(x)
        weights, ids = select_experts(F.linear(x, router.weight), 3, renormalize)
    assert torch.equal(ids.long(), hf_ids.long())
    assert torch.allclose(weights, hf_weights.float(), atol=1e-7)
    assert torch.allclose(weights.sum(-1), torch.ones(11)) == renormalize


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_block_size_groups_rows_by_expert(block_m):
    pytest.importorskip("triton")
    from engine.layers.moe.fused_moe_triton import moe_align_block_size

    gen = torch.Generator().manual_seed(block_m)
    experts = 6
    ids = torch.randint(-1, experts, (13, 2), generator=gen, dtype=torch.int32)
    sorted_ids, expert_ids, total = moe_align_block_size(ids, experts, block_m)
    flat = ids.reshape(-1)
    numel = flat.numel()
    total_len = int(total)
    counts = torch.bincount(flat[flat >= 0].long(), minlength=experts)
    assert total_len == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted_ids.shape[0] == numel + experts * (block_m - 1)
    seen = []
    for block in range(total_len // block_m):
        rows = sorted_ids[block * block_m:(block + 1) * block_m]
        real = rows[rows < numel]
        assert len(real) > 0  # padding never fills a whole block
        assert all(int(flat[r]) == int(expert_ids[block]) for r in real)
        seen += real.tolist()
    assert sorted(seen) == [i for i in range(numel) if flat[i] >= 0]  # every local slot exactly once
    assert (sorted_ids[total_len:] == numel).all()
    assert (expert_ids[total_len // block_m:] == -1).all()


def test_recorder_counts_and_records_between_start_and_stop():
    rec = ExpertDistributionRecorder(num_layers=2, num_experts=4)
    rec.record(0, torch.tensor([[0, 1], [1, 2]]))
    rec.start()
    assert rec.recording
    rec.record(1, torch.tensor([[3, 1]]))
    rec.record(0, torch.tensor([[3, 3]]))
    assert rec.dump() == [[0, 0, 0, 2], [0, 1, 0, 1]]  # while recording: so far
    rec.stop()
    rec.record(1, torch.tensor([[0, 0]]))  # after stop: not in the dump
    assert not rec.recording
    assert rec.dump() == [[0, 0, 0, 2], [0, 1, 0, 1]]
    assert rec.totals() == [3, 3, 1, 3]
