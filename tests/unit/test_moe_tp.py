"""Mixture-of-experts models over 2 TP ranks (gloo, spawned in-process): the experts' intermediate
dimension split over the ranks (--ep-size 1), and the experts themselves split (--ep-size 2: each
rank runs its half of the experts on every token, the outputs all-reduced). Both give the prefill
logits of one rank (float tolerance) and transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tp_utils import TP, prefill_and_decode, run_tp_ranks, tp_runner
from utils_models import build_tiny_model, hf_greedy

DECODE_STEPS = 8
PROMPTS = [[3, 17, 250, 9, 44], [100, 7, 7, 7, 31, 480, 2, 65, 11], [401]]
ARCHS = ["mixtral", "qwen2_moe", "qwen3_moe"]


def _run(path: str, tp_size: int, ep_size: int):
    """Prefill PROMPTS, greedy-decode; (prefill logits, tokens per prompt, the first MoE layer's w13 shape)."""
    runner = tp_runner(path, tp_size, ep_size, max_total_tokens=4096)
    logits, outputs = prefill_and_decode(runner, PROMPTS, DECODE_STEPS)
    w13 = runner.model.model.decoder_layers[-1].mlp.experts.w13.weight
    # get_weights_by_name reassembles an expert's tensors from the ranks' parts (a collective).
    by_name = {name: runner.weight_updater.full_weight(name, 1000)[0] for name in _expert_names(runner)}
    return logits, outputs, tuple(w13.shape), by_name


def _expert_names(runner) -> list:
    """The checkpoint names of the last expert's three projections in the last layer."""
    names = [name for name, _, _ in runner.model.stacked_params if name.count(".") == 3]
    last = max(int(name.split(".")[2]) for name in names)
    layer = runner.model.config.num_hidden_layers - 1
    return [f"model.layers.{layer}.{name}.weight" for name in names if int(name.split(".")[2]) == last]


def _tp2_work(paths: dict) -> dict:
    return {(name, ep): _run(path, TP, ep) for name, path in paths.items() for ep in (1, 2)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths, expected = {}, {}
    for arch in ARCHS:
        path = str(tmp_path_factory.mktemp(arch))
        hf = build_tiny_model(path, arch, seed=4)
        paths[arch] = path
        expected[arch] = [hf_greedy(hf, p, DECODE_STEPS + 1) for p in PROMPTS]
    return paths, expected


@pytest.fixture(scope="module")
def tp2_results(models):
    return run_tp_ranks(_tp2_work, models[0])


@pytest.mark.slow  # two spawned ranks build six models (about a minute on 2 cores)
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_matches_tp1_and_transformers(models, tp2_results, arch, ep):
    paths, expected = models
    from safetensors.torch import load_file

    logits, tokens, w13_shape, by_name = tp2_results[(arch, ep)]
    ref_logits, ref_tokens, full_shape, _ = _run(paths[arch], 1, 1)
    checkpoint = load_file(f"{paths[arch]}/model.safetensors")
    assert len(by_name) == 3
    for name, values in by_name.items():
        assert torch.equal(torch.tensor(values), checkpoint[name]), name
    experts, two_inter, hidden = full_shape
    # ep 1: every expert, half its intermediate rows; ep 2: half the experts, whole.
    assert w13_shape == ((experts, two_inter // 2, hidden) if ep == 1 else (experts // 2, two_inter, hidden))
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert tokens == ref_tokens == expected[arch]


def test_ep_size_must_divide_tp_size():
    from engine.server_args import ServerArgs, ServerArgsError

    with pytest.raises(ServerArgsError, match="--ep-size"):
        ServerArgs(tp_size=2, ep_size=3).check()
    with pytest.raises(ServerArgsError, match="--ep-size"):
        ServerArgs(tp_size=1, ep_size=0).check()
