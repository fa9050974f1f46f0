"""gpt-oss over 2 TP ranks (gloo, spawned in-process): heads and sinks split, the experts split as
--ep-size says (1: every expert's intermediate columns halved, gate/up pairs kept; 2: half the experts
each, whole). Past the sliding window, both give one rank's prefill logits (float tolerance) and
transformers' greedy tokens; so does the MXFP4 form of the checkpoint (its experts kept packed, split by
rows of gate_up and by blocks of 32 inputs of down; intermediate size 64 so that a half is a whole block)."""

from __future__ import annotations

import pytest
import torch

from test_gpt_oss_mxfp4 import _write_mxfp4
from tp_utils import TP, prefill_and_decode, run_tp_ranks, tp_runner
from utils_models import TINY_SWA, build_tiny_model, hf_greedy

DECODE_STEPS = 6
GEN = torch.Generator().manual_seed(8)
PROMPTS = [torch.randint(0, 512, (n,), generator=GEN).tolist() for n in (37, 5, 22)]  # window 16
RUNS = [("bf16", 1), ("bf16", 2), ("mxfp4", 1), ("mxfp4", 2)]


def _run(path: str, tp_size: int, ep_size: int):
    """Prefill PROMPTS and greedy-decode: (prefill logits, tokens per prompt, this rank's (experts,
    intermediate size, whether packed))."""
    runner = tp_runner(path, tp_size, ep_size, max_running_requests=8)
    logits, outputs = prefill_and_decode(runner, PROMPTS, DECODE_STEPS)
    experts = runner.model.model.decoder_layers[0].mlp.experts
    inter = (experts.w2_scales.shape[2] * 32 if experts.mxfp4 else experts.w2_weight.shape[2])
    assert experts.w13_weight_bias.shape == (experts.num_local, 2 * inter)
    return logits, outputs, (experts.num_local, inter, experts.mxfp4)


def _tp2_work(paths: dict) -> dict:
    return {(name, ep): _run(paths[name], TP, ep) for name, ep in RUNS}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths, expected = {}, {}
    for name in ("bf16", "mxfp4"):
        path = str(tmp_path_factory.mktemp(f"gpt_oss_tp_{name}"))
        build_tiny_model(path, "gpt_oss", seed=6, **dict(TINY_SWA["gpt_oss"], intermediate_size=64))
        if name == "mxfp4":
            _write_mxfp4(path)
        paths[name] = path
    from transformers import AutoModelForCausalLM

    from test_gpt_oss_mxfp4 import _transformers_model

    for name, path in paths.items():
        hf = (_transformers_model(path) if name == "mxfp4"
              else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
        expected[name] = [hf_greedy(hf, p, DECODE_STEPS + 1) for p in PROMPTS]
    return paths, expected


@pytest.fixture(scope="module")
def tp2_results(models):
    return run_tp_ranks(_tp2_work, models[0])


@pytest.mark.slow  # two spawned ranks build three models
@pytest.mark.parametrize("name,ep", RUNS)
def test_tp2_matches_tp1_and_transformers(models, tp2_results, name, ep):
    paths, expected = models
    logits, tokens, (experts, inter, packed) = tp2_results[(name, ep)]
    ref_logits, ref_tokens, (all_experts, full_inter, ref_packed) = _run(paths[name], 1, 1)
    # ep 1: every expert, half its intermediate columns; ep 2: half the experts, whole.
    assert (experts, inter) == ((all_experts, full_inter // 2) if ep == 1 else (all_experts // 2, full_inter))
    assert packed == ref_packed == (name == "mxfp4")
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert tokens == ref_tokens == expected[name]
