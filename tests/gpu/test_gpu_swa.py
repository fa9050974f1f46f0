"""Sliding-window and hybrid models on CUDA (issue 39): the Triton kernels' window, soft-cap, sinks and the
hybrid pool's slot map compiled for the GPU (the CPU suite runs them under the interpreter), through the
real scheduler with CUDA graphs: tiny random Mistral / Gemma 2 / Gemma 3 / gpt-oss with a window of 16,
prompts far past it, transformers' greedy tokens in float32, with the radix cache (the hybrid pool with the
SWA radix cache) and without it (the hybrid pool with the chunk cache)."""

from __future__ import annotations

import pytest
import torch

from gpu_helpers import DEV, ReplayCounter, SchedulerDriver, first_mismatch, hf_greedy_cuda, make_prompts
from utils_models import TINY_SWA, build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("radix", [True, False])
@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "gpt_oss"])
def test_windowed_models_match_transformers_with_cuda_graphs(tmp_path, arch, radix):
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator

    hf = build_tiny_model(str(tmp_path), arch, seed=3, tie_word_embeddings=arch.startswith("gemma"),
                          **TINY_SWA[arch]).to(DEV).eval()
    prompts = make_prompts([1, 40, 130, 300], hf.config.vocab_size, seed=1)
    steps = 24
    drv = SchedulerDriver(str(tmp_path), dtype="float32", cuda_graph_max_bs=4, max_running_requests=8,
                          chunked_prefill_size=64, disable_radix_cache=not radix)
    try:
        hybrid = isinstance(drv.model_runner.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
        replays = ReplayCounter(drv.model_runner)
        outputs = drv.generate(prompts, [steps] * len(prompts))
    finally:
        drv.close()
    assert hybrid, (arch, radix)
    assert replays.count > 0, "the decode steps did not go through the CUDA graphs"
    for prompt, out in zip(prompts, outputs):
        assert first_mismatch(out.output_ids, hf_greedy_cuda(hf, prompt, steps)) is None, (arch, radix)
