"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE with q/k norms
and norm_topk_prob) against transformers on small random checkpoints: float32 logits at every prompt
position, and greedy tokens through the real scheduler (continuous batching, radix cache, paging,
chunked prefill); the fused MoE layer's torch path against a per-token reference."""

from __future__ import annotations

from typing import List

import pytest
import torch

from sched_utils import Harness
from utils_models import BatchDriver, ExtendReq, LetterTokenizer, build_tiny_model, hf_greedy, hf_logits, make_runner

from engine.server_args import ServerArgs

ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]
N_NEW = 10


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    prompts.append(prompts[2][:30] + [7, 8, 9])  # shares a cached prefix with the third
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def moe_model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = build_tiny_model(path, request.param, seed=11)
    expected = [hf_greedy(hf, p, N_NEW) for p in _prompts()]
    return request.param, path, hf, expected


def test_logits_match_transformers(moe_model):
    arch, path, hf, _ = moe_model
    runner = make_runner(path)
    driver = BatchDriver(runner)
    prompts = _prompts()
    fb = driver.extend_batch([ExtendReq(driver.new_row(), p) for p in prompts])
    model = runner.model
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        hidden = model.model(fb.input_ids, fb.positions, fb)
        logits = model.logits_processor.compute_logits(hidden, model.lm_head)
    offset = 0
    for prompt in prompts:
        ref = hf_logits(hf, prompt)
        assert (logits[offset:offset + len(prompt)] - ref).abs().max().item() < 1e-4, arch
        offset += len(prompt)


def test_mixtral_with_a_sliding_window_matches_transformers(tmp_path):
    """Mixtral's sliding_window windows every layer (Llama's attention takes the model config's windows)."""
    hf = build_tiny_model(str(tmp_path), "mixtral", seed=5, sliding_window=16)
    runner = make_runner(str(tmp_path))
    assert runner.model_config.layer_windows == [16, 16]
    driver = BatchDriver(runner)
    prompt = _prompts()[2]  # 40 tokens: past the window
    fb = driver.extend_batch([ExtendReq(driver.new_row(), prompt)])
    model = runner.model
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        logits = model.logits_processor.compute_logits(model.model(fb.input_ids, fb.positions, fb), model.lm_head)
    assert (logits - hf_logits(hf, prompt)).abs().max().item() < 1e-4


def test_layers_are_sparse_as_the_config_says(moe_model):
    from engine.layers.moe.layer import FusedMoE
    from engine.models.llama import LlamaMLP
    from engine.layers.moe.sparse_block import SparseMoeBlock

    arch, path, hf, _ = moe_model
    model = make_runner(path).model
    kinds = [type(layer.mlp) for layer in model.model.decoder_layers]
    # Qwen's test configs keep layer 0 dense (mlp_only_layers=[0]); Mixtral's are all sparse.
    assert kinds == ([SparseMoeBlock] * 2 if arch == "mixtral" else [LlamaMLP, SparseMoeBlock])
    experts = model.model.decoder_layers[1].mlp.experts
    assert isinstance(experts, FusedMoE)
    hf_experts = hf.config.num_local_experts if arch != "qwen2_moe" else hf.config.num_experts
    assert tuple(experts.w13.weight.shape)[0] == hf_experts
    assert (model.model.decoder_layers[1].mlp.shared_expert is not None) == (arch == "qwen2_moe")


CONFIGS = {
    "default": {},
    "page16-chunk16": dict(page_size=16, chunked_prefill_size=16),
    "no-radix-mixed": dict(disable_radix_cache=True, chunked_prefill_size=16, enable_mixed_chunk=True),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_scheduler_greedy_equals_transformers(moe_model, config):
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, _, expected = moe_model
    kwargs = dict(CONFIGS[config])
    page = kwargs.get("page_size", 1)
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=2048, page_size=page,
                                      max_running_requests=16))
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=2048, **kwargs)
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in _prompts()]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected, (arch, config)


def test_bfloat16_model_runs_close_to_float32(moe_model):
    """The bf16 CPU path (the native experts in bf16, accumulation in float32): the prefill's last
    logits stay close to float32's."""
    arch, path, _, _ = moe_model
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(path, dtype=dtype)
        driver = BatchDriver(runner)
        out, _ = driver.run(driver.extend_batch([ExtendReq(driver.new_row(), _prompts()[1])]))
        logits[dtype] = out.next_token_logits.float()
    scale = logits["float32"].abs().max().item()
    assert (logits["bfloat16"] - logits["float32"]).abs().max().item() < 0.05 * scale, arch


EXPERT_NAMES = {"mixtral": "model.layers.1.block_sparse_moe.experts.2.{}.weight",
                "qwen2_moe": "model.layers.1.mlp.experts.5.{}.weight", "qwen3_moe": "model.layers.1.mlp.experts.5.{}.weight"}
PROJECTIONS = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj"),
               "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def test_expert_weights_by_name_read_and_update(moe_model):
    """get_weights_by_name / update_weights_from_tensor route an expert's checkpoint names into the
    stacked weights and back."""
    from safetensors.torch import load_file

    arch, path, _, _ = moe_model
    runner = make_runner(path)
    checkpoint = load_file(f"{path}/model.safetensors")
    for projection in PROJECTIONS[arch]:
        name = EXPERT_NAMES[arch].format(projection)
        values, message = runner.weight_updater.full_weight(name, 1000)
        assert message == "" and torch.equal(torch.tensor(values), checkpoint[name]), name
    name = EXPERT_NAMES[arch].format(PROJECTIONS[arch][1])
    new = torch.randn(checkpoint[name].shape)
    ok, message = runner.weight_updater.update_from_tensors([(name, new)])
    assert ok, message
    assert torch.equal(torch.tensor(runner.weight_updater.full_weight(name, 1000)[0]), new)


def test_missing_expert_weight_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    build_tiny_model(str(tmp_path), "mixtral", seed=1)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"mlp\.experts\.w13\.weight\[2:up\]"):
        make_runner(str(tmp_path))


def test_bad_moe_config_is_refused(tmp_path):
    import json

    build_tiny_model(str(tmp_path), "mixtral", seed=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_experts_per_tok"] = 5  # more than the 4 experts
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="num_experts_per_tok 5"):
        make_runner(str(tmp_path))
