"""Mixture-of-experts on CUDA: the Triton fused-MoE kernel against the torch path at decode and
prefill sizes (float32, bfloat16, EP slots held elsewhere), and tiny random Mixtral / Qwen2-MoE /
Qwen3-MoE through the real scheduler with CUDA graphs: transformers' greedy tokens in float32."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEV, ReplayCounter, SchedulerDriver, build_gpu_tiny_model, first_mismatch, hf_greedy_cuda, make_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 16, 300])
@pytest.mark.parametrize("drop", [False, True])
def test_triton_kernel_matches_torch_path(dtype, tol, tokens, drop):
    from engine.layers.moe.fused_moe_native import fused_moe_native
    from engine.layers.moe.fused_moe_triton import fused_moe_triton
    from engine.layers.moe.router import select_experts

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    experts, hidden, inter = 8, 512, 384
    x = torch.randn(tokens, hidden, device=DEV, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEV, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=DEV, generator=gen) / inter**0.5).to(dtype)
    weights, ids = select_experts(torch.randn(tokens, experts, device=DEV, generator=gen), 2, True)
    if drop:
        ids = torch.where(ids < 3, torch.full_like(ids, -1), ids)
    ours = fused_moe_triton(x, w13, w2, weights, ids)
    ref = fused_moe_native(x.float(), w13.float(), w2.float(), weights, ids)
    assert (ours.float() - ref).abs().max().item() < tol * max(1.0, ref.abs().max().item())


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_models_match_transformers_with_cuda_graphs(tmp_path, arch):
    hf = build_gpu_tiny_model(str(tmp_path), arch, seed=3)
    prompts = make_prompts([1, 17, 64, 130], hf.config.vocab_size, seed=1)
    steps = 16
    drv = SchedulerDriver(str(tmp_path), dtype="float32", cuda_graph_max_bs=4)
    try:
        replays = ReplayCounter(drv.model_runner)
        outputs = drv.generate(prompts, [steps] * len(prompts))
    finally:
        drv.close()
    assert replays.count > 0, "the decode steps did not go through the CUDA graphs"
    for prompt, out in zip(prompts, outputs):
        assert first_mismatch(out.output_ids, hf_greedy_cuda(hf, prompt, steps)) is None, arch
