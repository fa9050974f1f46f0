"""DeepSeek-V2/V3 (MLA) over 2 TP ranks (gloo, spawned in-process): the heads split (q, kv_b_proj, o_proj),
the latents replicated (every rank stores the whole latent of every token), the experts split by TP
(V2, --ep-size 1) or by expert (V3, --ep-size 2). Both give one rank's prefill logits (float tolerance),
transformers' greedy tokens, and get_weights_by_name reassembles the split kv_b_proj."""

from __future__ import annotations

import pytest
import torch

from tp_utils import TP, prefill_and_decode, run_tp_ranks, tp_runner
from utils_models import build_tiny_model, hf_greedy

DECODE_STEPS = 6
PROMPTS = [[3, 17, 250, 9, 44], [100, 7, 7, 7, 31, 480, 2, 65, 11], [401]]
CASES = {"deepseek_v2": 1, "deepseek_v3": 2}  # arch -> --ep-size
WEIGHTS = ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
           "model.layers.1.self_attn.o_proj.weight")


def _run(path: str, tp_size: int, ep_size: int):
    """Prefill PROMPTS and greedy-decode: (prefill logits, tokens per prompt, weights by name, local heads)."""
    runner = tp_runner(path, tp_size, ep_size, page_size=16)
    logits, outputs = prefill_and_decode(runner, PROMPTS, DECODE_STEPS)
    by_name = {name: runner.weight_updater.full_weight(name, 1000)[0] for name in WEIGHTS}
    heads = runner.model.model.decoder_layers[0].self_attn.num_heads
    return logits, outputs, by_name, heads


def _tp2_work(paths: dict) -> dict:
    return {name: _run(path, TP, CASES[name]) for name, path in paths.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths, expected = {}, {}
    for arch in CASES:
        path = str(tmp_path_factory.mktemp(arch))
        hf = build_tiny_model(path, arch, seed=4)
        paths[arch] = path
        expected[arch] = [hf_greedy(hf, p, DECODE_STEPS + 1) for p in PROMPTS]
    return paths, expected


@pytest.fixture(scope="module")
def tp2_results(models):
    return run_tp_ranks(_tp2_work, models[0])


@pytest.mark.slow  # two spawned ranks build two models each (about a minute on 2 cores)
@pytest.mark.parametrize("arch", list(CASES))
def test_tp2_matches_tp1_and_transformers(models, tp2_results, arch):
    from safetensors.torch import load_file

    paths, expected = models
    logits, outputs, by_name, heads = tp2_results[arch]
    ref_logits, ref_outputs, _, ref_heads = _run(paths[arch], 1, 1)
    assert heads * TP == ref_heads
    assert (logits - ref_logits).abs().max().item() < 1e-4, arch
    assert outputs == ref_outputs == expected[arch], arch
    checkpoint = load_file(f"{paths[arch]}/model.safetensors")
    for name in WEIGHTS:
        assert torch.equal(torch.tensor(by_name[name]), checkpoint[name]), name
