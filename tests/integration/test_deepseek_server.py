"""A server on a tiny random DeepSeek-V3 (MLA, grouped sigmoid routing; the built-in tokenizer, its
vocabulary): greedy /generate equals transformers token for token, also for a prompt whose prefix the
radix cache holds, and /get_server_info reports the pool and the expert layout."""

from __future__ import annotations

import os
import shutil

import httpx
import pytest

from conftest import post_greedy, start_server_process

pytestmark = pytest.mark.slow  # starts a server (processes)

N_NEW = 12
PROMPTS = [[17, 250, 1999, 40, 812, 5, 77, 1204], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5],
           [17, 250, 1999, 40, 812, 5, 77, 1204, 9, 9, 2000]]  # the first one's prompt, extended


@pytest.fixture(scope="module")
def deepseek_server(tmp_path_factory):
    from utils_models import build_tiny_model, hf_greedy

    from engine.builtin_model import ensure_builtin_model

    path = str(tmp_path_factory.mktemp("tiny_deepseek_v3"))
    hf = build_tiny_model(path, "deepseek_v3", seed=3, vocab_size=2560)
    builtin = ensure_builtin_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(builtin, name), path)
    expected = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    server = start_server_process(["--model-path", path, "--max-total-tokens", "4096", "--page-size", "4"])
    try:
        yield server.url, expected
    finally:
        server.stop()


def test_greedy_generate_equals_transformers(deepseek_server):
    url, expected = deepseek_server
    for prompt, tokens in zip(PROMPTS, expected):
        body = post_greedy(url, prompt, N_NEW).json()
        assert body["output_ids"] == tokens
    assert body["meta_info"]["cached_tokens"] >= 8  # the third prompt reused the first one's pages


def test_server_info_reports_the_pool_and_experts(deepseek_server):
    url, _ = deepseek_server
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    assert info["max_total_num_tokens"] == 4096
    moe = info["internal_states"][0]["moe"]
    assert (moe["num_experts"], moe["num_experts_per_tok"], moe["num_moe_layers"]) == (8, 2, 1)
