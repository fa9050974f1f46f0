"""Engine models vs transformers on the same weights: float32 logits at every prompt position."""

from __future__ import annotations


import pytest
import torch

from utils_models import BatchDriver, ExtendReq, build_tiny_model, hf_logits, make_runner

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    "llama_gqa_untied": dict(arch="llama"),
    "llama_tied": dict(arch="llama", tie_word_embeddings=True),
    "llama_mha_bias": dict(arch="llama", num_key_value_heads=4, attention_bias=True),
    "llama3_rope_scaling": dict(arch="llama", rope_scaling=LLAMA3_SCALING, rope_theta=500000.0),
    "llama_linear_rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "mistral": dict(arch="mistral"),
    "qwen2_qkv_bias": dict(arch="qwen2"),
    "qwen2_yarn_rope": dict(arch="qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                        "original_max_position_embeddings": 16}),
    "qwen3_qk_norm": dict(arch="qwen3", head_dim=32),
    "llama_sharded": dict(arch="llama", max_shard_size="60KB"),
}

PROMPTS = [
    [int(x) for x in torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1))],
    [int(x) for x in torch.randint(0, 512, (11,), generator=torch.Generator().manual_seed(2))],
]


def _engine_logits_all_positions(runner, driver, forward_batch) -> torch.Tensor:
    """Logits at every position: the model's hidden states through the LM head."""
    model = runner.model
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(forward_batch)
        hidden = model.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return model.logits_processor.compute_logits(hidden, model.lm_head)


# The fused ops are the default path; the torch ops run in the full suite (slow).
@pytest.mark.parametrize("fused", [pytest.param(True, id="fused-cpu-ops"),
                                   pytest.param(False, id="torch-ops", marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, monkeypatch, case, fused):
    from engine.kernels import library

    if not fused:  # ENGINE_CPU_FUSED_OPS=0: every family but attention runs its torch path
        for family in (library.Family.OPS, library.Family.LINEAR, library.Family.DECODER_LAYERS):
            monkeypatch.setitem(library.switches(), family, False)
    kwargs = dict(CASES[case])
    arch = kwargs.pop("arch")
    hf = build_tiny_model(str(tmp_path), arch, **kwargs)
    if case == "llama_sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("*.safetensors"))) > 1
    runner = make_runner(str(tmp_path))
    if "rope_scaling" in kwargs:  # the scaling really reached the engine (transformers v5 renames it)
        assert runner.model_config.rope_scaling["rope_type"] == kwargs["rope_scaling"]["rope_type"]
    driver = BatchDriver(runner)
    reqs = [ExtendReq(driver.new_row(), p) for p in PROMPTS]
    fb = driver.extend_batch(reqs)
    logits = _engine_logits_all_positions(runner, driver, fb)

    offset = 0
    for prompt in PROMPTS:
        ref = hf_logits(hf, prompt)
        ours = logits[offset : offset + len(prompt)]
        offset += len(prompt)
        assert ours.shape == ref.shape
        assert (ours - ref).abs().max().item() < 1e-4, case

    # The model's own forward returns the last position of each request.
    out = runner.forward(driver.extend_batch([ExtendReq(driver.new_row(), p) for p in PROMPTS]))
    for i, prompt in enumerate(PROMPTS):
        assert (out.next_token_logits[i] - hf_logits(hf, prompt)[-1]).abs().max().item() < 1e-4


def test_input_logprobs_match_transformers(tmp_path):
    hf = build_tiny_model(str(tmp_path), "qwen2")
    runner = make_runner(str(tmp_path))
    driver = BatchDriver(runner)
    starts = [5, 0]
    reqs = [ExtendReq(driver.new_row(), p, logprob_start=s, top_logprobs=k) for p, s, k in zip(PROMPTS, starts, [3, 0])]
    out = runner.forward(driver.extend_batch(reqs))

    offset = 0
    for i, (prompt, start) in enumerate(zip(PROMPTS, starts)):
        ref = torch.log_softmax(hf_logits(hf, prompt), dim=-1)
        count = len(prompt) - start
        got = out.input_token_logprobs[offset : offset + count]
        # Position j's logprob is that of token j+1; the last position's next token is unknown.
        expected = ref[torch.arange(start, len(prompt) - 1), torch.tensor(prompt[start + 1 :])]
        assert (got[:-1] - expected).abs().max().item() < 1e-4
        offset += count
        if i == 0:
            vals, idx = out.input_top_logprobs_val[0], out.input_top_logprobs_idx[0]
            assert len(vals) == count and all(len(v) == 3 for v in vals)
            ref_top = ref[start:].topk(3, dim=-1)
            assert idx == ref_top.indices.tolist()
            assert torch.allclose(torch.tensor(vals), ref_top.values, atol=1e-4)
        else:
            assert out.input_top_logprobs_val[1] == [] and out.input_top_logprobs_idx[1] == []
    assert offset == out.input_token_logprobs.numel()


def test_batched_prefill_of_similar_lengths_matches_transformers(tmp_path):
    """Prompts of similar lengths take the backend's padded one-SDPA path."""
    from engine.layers.attention.torch_native_backend import _PaddedExtend

    hf = build_tiny_model(str(tmp_path), "qwen3", head_dim=32)
    runner = make_runner(str(tmp_path))
    driver = BatchDriver(runner)
    prompts = [PROMPTS[0][:12], PROMPTS[0][5:15], PROMPTS[1]]
    fb = driver.extend_batch([ExtendReq(driver.new_row(), p) for p in prompts])
    logits = _engine_logits_all_positions(runner, driver, fb)
    assert isinstance(fb.attn_metadata, _PaddedExtend)
    offset = 0
    for prompt in prompts:
        assert (logits[offset : offset + len(prompt)] - hf_logits(hf, prompt)).abs().max().item() < 1e-4
        offset += len(prompt)
