"""The offline Engine on a tiny random Mixtral: greedy outputs equal transformers', the internal state
has the expert layout, SGLang's expert distribution record methods count what the layers ran (a
dense model's refusal is tested at the scheduler, tests/unit/test_moe_expert_stats.py)."""

from __future__ import annotations

import os
import shutil

import pytest

pytestmark = pytest.mark.slow  # starts the engine's processes

N_NEW = 6
PROMPT = [5, 81, 300, 12, 7, 900, 44, 2001, 9]


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory):
    from utils_models import build_tiny_model, hf_greedy

    from engine import Engine
    from engine.builtin_model import ensure_builtin_model

    path = str(tmp_path_factory.mktemp("tiny_mixtral_engine"))
    hf = build_tiny_model(path, "mixtral", seed=8, vocab_size=2560)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(ensure_builtin_model(), name), path)
    expected = hf_greedy(hf, PROMPT, N_NEW)
    with Engine(model_path=path, device="cpu", max_total_tokens=4096, log_level="warning",
                disable_radix_cache=True) as engine:
        yield engine, expected


def test_generate_and_record(moe_engine):
    engine, expected = moe_engine
    greedy = {"temperature": 0.0, "max_new_tokens": N_NEW, "ignore_eos": True}
    moe = engine.get_internal_state()[0]["moe"]
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["ep_size"]) == (4, 2, 1)
    engine.start_expert_distribution_record()
    out = engine.generate(input_ids=PROMPT, sampling_params=greedy)
    engine.stop_expert_distribution_record()
    assert out["output_ids"] == expected
    first, last = (sum(row) for row in engine.dump_expert_distribution_record())
    # The last layer of the prefill runs only the last prompt token.
    assert first - last == (len(PROMPT) - 1) * 2
    assert (len(PROMPT) + N_NEW - 1) * 2 <= first <= (len(PROMPT) + N_NEW) * 2
