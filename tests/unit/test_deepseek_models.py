"""DeepSeek-V2/V3 (multi-head latent attention, DeepSeek's experts) against transformers on small random
checkpoints: float32 logits at every prompt position, greedy tokens through the real scheduler (radix
cache, paging, chunked and mixed prefill, overlap), the latent KV pool's layout and size, DeepSeek's
routing against transformers' routers, and what is refused."""

from __future__ import annotations

from typing import List

import pytest
import torch

from sched_utils import Harness
from utils_models import BatchDriver, ExtendReq, LetterTokenizer, build_tiny_model, hf_greedy, hf_logits, make_runner

from engine.server_args import ServerArgs

ARCHS = ["deepseek_v2", "deepseek_v3"]
N_NEW = 10


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    prompts.append(prompts[2][:30] + [7, 8, 9])  # shares a cached prefix with the third
    return prompts


@pytest.fixture(scope="module", params=ARCHS)
def mla_model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = build_tiny_model(path, request.param, seed=11)
    expected = [hf_greedy(hf, p, N_NEW) for p in _prompts()]
    return request.param, path, hf, expected


def _prefill_logits(runner, prompts: List[List[int]]) -> torch.Tensor:
    driver = BatchDriver(runner, scramble=True)
    fb = driver.extend_batch([ExtendReq(driver.new_row(), p) for p in prompts])
    model = runner.model
    with torch.inference_mode():
        runner.attn_backend.init_forward_metadata(fb)
        hidden = model.model(fb.input_ids, fb.positions, fb)
        return model.logits_processor.compute_logits(hidden, model.lm_head)


@pytest.mark.parametrize("page_size", [1, 16])
def test_logits_match_transformers(mla_model, page_size):
    arch, path, hf, _ = mla_model
    prompts = _prompts()
    logits = _prefill_logits(make_runner(path, page_size=page_size), prompts)
    offset = 0
    for prompt in prompts:
        ref = hf_logits(hf, prompt)
        assert (logits[offset:offset + len(prompt)] - ref).abs().max().item() < 1e-4, arch
        offset += len(prompt)


def test_v3_without_interleaved_rope_matches_transformers(tmp_path):
    """rope_interleave false: V3 rotates its rope dims in halves (the NeoX layout), as Llama does."""
    hf = build_tiny_model(str(tmp_path), "deepseek_v3", seed=6, rope_interleave=False)
    prompt = _prompts()[2]
    logits = _prefill_logits(make_runner(str(tmp_path)), [prompt])
    assert (logits - hf_logits(hf, prompt)).abs().max().item() < 1e-4


def test_decode_on_a_cached_prefix_matches_transformers(mla_model):
    """A prefill on top of a prefix already in the pool (the radix cache's case), then decode steps of
    two requests of different lengths (padded in one batch): each step's logits are transformers' at
    that position."""
    arch, path, hf, _ = mla_model
    runner = make_runner(path, page_size=16)
    driver = BatchDriver(runner, scramble=True)
    long, short = _prompts()[2], _prompts()[1]
    rows = [driver.new_row(), driver.new_row()]
    driver.run(driver.extend_batch([ExtendReq(rows[0], long[:17]), ExtendReq(rows[1], short)]))
    out, _ = driver.run(driver.extend_batch([ExtendReq(rows[0], long[17:], prefix_len=17)]))
    assert (out.next_token_logits[0] - hf_logits(hf, long)[-1]).abs().max().item() < 1e-4
    seqs = [list(long), list(short)]
    for step in range(3):
        tokens = [7 + step, 300 + step]
        out, _ = driver.run(driver.decode_batch(rows, tokens, [len(s) for s in seqs]))
        for i, token in enumerate(tokens):
            seqs[i].append(token)
            ref = hf_logits(hf, seqs[i])[-1]
            assert (out.next_token_logits[i] - ref).abs().max().item() < 1e-4, (arch, step, i)


def test_kv_pool_holds_one_latent_per_token(mla_model):
    """Per token per layer: kv_lora_rank + qk_rope_head_dim values, one "head"; V is a view of the same
    rows; the runner sizes the pool by that cell."""
    from engine.mem_cache.mla_pool import MLATokenToKVPool

    arch, path, hf, _ = mla_model
    runner = make_runner(path)
    pool = runner.token_to_kv_pool
    cfg = hf.config
    cell = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert isinstance(pool, MLATokenToKVPool)
    assert len(pool.k_buffer) == cfg.num_hidden_layers
    assert tuple(pool.k_buffer[0].shape) == (runner.max_total_num_tokens + runner.page_size, 1, cell)
    assert pool.v_buffer[0].data_ptr() == pool.k_buffer[0].data_ptr()
    assert pool.v_buffer[0].shape[-1] == cfg.kv_lora_rank
    assert runner.kv_bytes_per_token() == pool.bytes_per_token() == cfg.num_hidden_layers * cell * 4
    # What an MHA pool of the expanded heads would hold: K (nope + rope) and V for every head.
    mha = cfg.num_hidden_layers * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
                                                              + cfg.v_head_dim) * 4
    assert runner.kv_bytes_per_token() * 3 < mha  # 40 values a token a layer against 160
    # Released and resumed (release_memory_occupation): the view follows the new buffer.
    pool.release()
    pool.resume()
    assert pool.v_buffer[1].data_ptr() == pool.k_buffer[1].data_ptr()


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16-chunk16": dict(page_size=16, chunked_prefill_size=16),
    "mixed-chunk16": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    "overlap-page16": dict(overlap=True, page_size=16),
}


# The fast lane keeps the default loop; the other modes run in the full suite.
@pytest.mark.parametrize("config", [c if c == "default" else pytest.param(c, marks=pytest.mark.slow) for c in CONFIGS])
def test_scheduler_greedy_equals_transformers(mla_model, config):
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, _, expected = mla_model
    kwargs = dict(CONFIGS[config])
    page = kwargs.get("page_size", 1)
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=2048, page_size=page,
                                      max_running_requests=16))
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=2048, **kwargs)
    prompts = _prompts()
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts[:3]]
    h.run_until_idle()
    # Then the prompt that shares 30 tokens with the third: with the radix cache its prefix is reused.
    rids.append(h.submit(prompts[3], max_new_tokens=N_NEW, ignore_eos=True))
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected, (arch, config)
    if not kwargs.get("disable_radix_cache"):
        assert h.outputs[rids[3]].cached_tokens >= (16 if page == 16 else 30)


def test_bfloat16_model_runs_close_to_float32(mla_model):
    arch, path, _, _ = mla_model
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = make_runner(path, dtype=dtype)
        driver = BatchDriver(runner)
        out, _ = driver.run(driver.extend_batch([ExtendReq(driver.new_row(), _prompts()[1])]))
        logits[dtype] = out.next_token_logits.float()
    scale = logits["float32"].abs().max().item()
    assert (logits["bfloat16"] - logits["float32"]).abs().max().item() < 0.05 * scale, arch


def test_layers_and_expert_layout(mla_model):
    from engine.layers.moe.layer import FusedMoE
    from engine.models.deepseek_v2 import DeepseekMoE
    from engine.models.llama import LlamaMLP

    arch, path, hf, _ = mla_model
    model = make_runner(path).model
    layers = model.model.decoder_layers
    assert isinstance(layers[0].mlp, LlamaMLP) and all(isinstance(layer.mlp, DeepseekMoE) for layer in layers[1:])
    assert isinstance(layers[1].mlp.experts, FusedMoE)
    layout = model.expert_layout(1)
    assert layout["num_experts"] == hf.config.n_routed_experts
    assert layout["num_moe_layers"] == hf.config.num_hidden_layers - 1
    assert layout["shared_expert_intermediate_size"] == hf.config.moe_intermediate_size


def test_expert_weight_by_name_and_update(mla_model):
    from safetensors.torch import load_file

    arch, path, _, _ = mla_model
    runner = make_runner(path)
    checkpoint = load_file(f"{path}/model.safetensors")
    for name in ("model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                 "model.layers.1.mlp.shared_experts.down_proj.weight"):
        values, message = runner.weight_updater.full_weight(name, 1000)
        assert message == "" and torch.equal(torch.tensor(values), checkpoint[name]), name
    # kv_b_proj's halves are read at each forward: an update changes the logits at once.
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    before = _prefill_logits(runner, [_prompts()[0]])
    ok, message = runner.weight_updater.update_from_tensors([(name, torch.zeros_like(checkpoint[name]))])
    assert ok, message
    assert (_prefill_logits(runner, [_prompts()[0]]) - before).abs().max().item() > 1e-3


def test_routing_matches_transformers_routers():
    """select_experts_grouped against transformers' DeepSeek-V2 (softmax, group-limited greedy) and V3
    (sigmoid, correction bias, groups by their two best) routers on random logits."""
    import transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from engine.layers.moe.router import select_experts_grouped

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 16, generator=gen)
    v2 = transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                       topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    v3 = transformers.DeepseekV3Config(hidden_size=16, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                                       topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    for config, router_cls, scoring, renormalize in ((v2, DeepseekV2TopkRouter, "softmax", False),
                                                     (v3, DeepseekV3TopkRouter, "sigmoid", True)):
        router = router_cls(config)
        with torch.no_grad():
            router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
            bias = None
            if scoring == "sigmoid":
                router.e_score_correction_bias.copy_(torch.randn(8, generator=gen))
                bias = router.e_score_correction_bias
            logits, ref_weights, ref_ids = router(hidden)
        weights, ids = select_experts_grouped(logits, 3, scoring, renormalize, config.routed_scaling_factor, 4, 2,
                                              bias)
        ours = torch.zeros(64, 8).scatter_(1, ids.long(), weights)
        ref = torch.zeros(64, 8).scatter_(1, ref_ids.long(), ref_weights.float())
        assert (ours - ref).abs().max().item() < 1e-6, scoring


@pytest.mark.parametrize("args, match", [
    (dict(enable_lora=True, max_loras_per_batch=1, max_lora_rank=8, lora_target_modules=["q_proj"]), "LoRA"),
])
def test_unsupported_features_are_refused(tmp_path, args, match):
    build_tiny_model(str(tmp_path), "deepseek_v3", seed=1)
    with pytest.raises(ValueError, match=match):
        make_runner(str(tmp_path), **args)


def test_heads_that_do_not_split_over_tp_are_refused(tmp_path, monkeypatch):
    import engine.layers.mla_linear as mla_linear

    build_tiny_model(str(tmp_path), "deepseek_v2", seed=1)
    monkeypatch.setattr(mla_linear, "get_tp_size", lambda: 3)
    with pytest.raises(ValueError, match="4 attention heads cannot be split over --tp-size 3"):
        make_runner(str(tmp_path))


def test_other_backends_fall_back_to_torch_native(tmp_path):
    from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend

    build_tiny_model(str(tmp_path), "deepseek_v2", seed=1)
    runner = make_runner(str(tmp_path), attention_backend="triton")
    assert isinstance(runner.attn_backend, TorchNativeAttnBackend)


def test_bad_mla_config_is_refused(tmp_path):
    import json

    build_tiny_model(str(tmp_path), "deepseek_v3", seed=1)
    config = json.loads((tmp_path / "config.json").read_text())
    config["topk_group"] = 5  # more groups than the 4 there are
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="topk_group 5"):
        make_runner(str(tmp_path))


def test_quantization_leaves_the_latent_projections_in_dtype(tmp_path):
    """--quantization quantizes q_b_proj, o_proj and the MLPs; kv_b_proj (read as views by the absorbed
    attention) and the replicated latent projections keep their weights, and the logits stay close."""
    from engine.layers.quantization import QuantizedWeight

    build_tiny_model(str(tmp_path), "deepseek_v3", seed=2)
    logits = {}
    for quantization in (None, "w8a8_int8"):
        runner = make_runner(str(tmp_path), dtype="bfloat16", quantization=quantization)
        attn = runner.model.model.decoder_layers[1].self_attn
        assert isinstance(attn.q_b_proj.packed_weight, QuantizedWeight) == (quantization is not None)
        assert attn.kv_b_proj.weight.numel() > 0 and attn.kv_a_proj_with_mqa.weight.numel() > 0
        driver = BatchDriver(runner)
        out, _ = driver.run(driver.extend_batch([ExtendReq(driver.new_row(), _prompts()[2])]))
        logits[quantization] = out.next_token_logits.float()
    scale = logits[None].abs().max().item()
    assert (logits["w8a8_int8"] - logits[None]).abs().max().item() < 0.1 * scale
