"""A server on a tiny random Mixtral (the built-in tokenizer, its vocabulary): greedy /generate equals
transformers token for token, /get_server_info reports the expert layout, SGLang's expert
distribution routes record and dump the tokens routed per layer and expert, /metrics counts them per
expert id."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from conftest import post_greedy, start_server_process

pytestmark = pytest.mark.slow  # starts a server (processes)

N_NEW = 12
PROMPTS = [[17, 250, 1999, 40, 812, 5, 77, 1204], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    from utils_models import build_tiny_model, hf_greedy

    from engine.builtin_model import ensure_builtin_model

    path = str(tmp_path_factory.mktemp("tiny_mixtral"))
    hf = build_tiny_model(path, "mixtral", seed=3, vocab_size=2560)
    builtin = ensure_builtin_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(builtin, name), path)
    expected = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    server = start_server_process(["--model-path", path, "--enable-metrics"])
    try:
        yield server.url, expected
    finally:
        server.stop()


def _generate(url: str, prompt):
    return post_greedy(url, prompt, N_NEW).json()


def test_greedy_generate_equals_transformers(moe_server):
    url, expected = moe_server
    for prompt, tokens in zip(PROMPTS, expected):
        assert _generate(url, prompt)["output_ids"] == tokens


def test_server_info_reports_the_expert_layout(moe_server):
    url, _ = moe_server
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    assert info["ep_size"] == 1
    moe = info["internal_states"][0]["moe"]
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["ep_size"], moe["num_moe_layers"]) == (4, 2, 1, 2)


def test_expert_distribution_record_and_metrics(moe_server):
    url, _ = moe_server
    assert httpx.post(f"{url}/start_expert_distribution_record", timeout=30).json()["success"]
    prompt = [900 + i for i in range(15)]  # not cached: every prompt token is computed
    _generate(url, prompt)
    assert httpx.get(f"{url}/stop_expert_distribution_record", timeout=30).json()["success"]
    dump = httpx.post(f"{url}/dump_expert_distribution_record", timeout=30).json()
    counts = dump["logical_count"]
    # Layer 0 runs the 15 prompt tokens and the decode inputs through 2 experts each (the overlap
    # scheduler may run one decode step past the end); the last layer of the prefill runs only the last
    # prompt token.
    first, last = (sum(row) for row in counts)
    assert (len(prompt) + N_NEW - 1) * 2 <= first <= (len(prompt) + N_NEW) * 2
    assert first - last == (len(prompt) - 1) * 2
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    lines = [line for line in metrics.splitlines() if line.startswith("sglang:moe_routed_tokens_total{")]
    assert len(lines) == 4  # one series per expert id
    total = sum(float(line.rsplit(" ", 1)[1]) for line in lines)
    assert total >= sum(sum(row) for row in counts)
