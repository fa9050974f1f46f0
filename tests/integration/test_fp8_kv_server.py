"""A server with --kv-cache-dtype fp8_e4m3 on the built-in model (float32), with the radix cache, chunked
prefill (16), page size 16 and the overlap loop: greedy /generate equals transformers run on the same
model with every attention's keys and values rounded through float8 e4m3 (as the pool stores them;
unit scales: the built-in checkpoint has none), token for token, single requests, a batch, and prompts
that share a cached prefix. /get_server_info reports the KV pool's dtype and its bytes per token."""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from conftest import post_greedy, start_server_process

pytestmark = pytest.mark.slow  # starts a server (processes)

N_NEW = 24
_rng = random.Random(0)
PROMPTS = [[_rng.randrange(5, 2000) for _ in range(n)] for n in (40, 57, 33)]
PROMPTS.append(PROMPTS[0] + PROMPTS[2][:9])  # extends a prompt the radix cache holds by then


def _fp8_transformers(path: str):
    import transformers
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
        limit = torch.finfo(torch.float8_e4m3fn).max
        key = key.float().clamp(-limit, limit).to(torch.float8_e4m3fn).to(query.dtype)
        value = value.float().clamp(-limit, limit).to(torch.float8_e4m3fn).to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("engine_test_fp8_kv", fp8_kv_attention)
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="engine_test_fp8_kv").eval()


@pytest.fixture(scope="module")
def fp8_server():
    import transformers
    from utils_models import hf_greedy

    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    expected = [hf_greedy(_fp8_transformers(path), p, N_NEW) for p in PROMPTS]
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # The rounding changes what the model says: a server that ignored the flag would fail below.
    assert sum(hf_greedy(plain, p, N_NEW) != e for p, e in zip(PROMPTS, expected)) >= 2
    server = start_server_process(["--model-path", path, "--dtype", "float32", "--kv-cache-dtype", "fp8_e4m3",
                                   "--page-size", "16", "--chunked-prefill-size", "16"])
    try:
        yield server.url, expected
    finally:
        server.stop()


def test_server_info_reports_the_kv_cache(fp8_server):
    from engine.builtin_model import ensure_builtin_model
    from engine.configs.model_config import ModelConfig

    url, _ = fp8_server
    info = httpx.get(f"{url}/get_server_info", timeout=30).json()
    assert info["kv_cache_dtype"] == "fp8_e4m3"  # the flag, as SGLang reports it
    state = info["internal_states"][0]
    cfg = ModelConfig.from_pretrained(ensure_builtin_model(), device="cpu")
    assert state["kv_cache_dtype"] == "float8_e4m3fn"
    assert state["kv_cache_bytes_per_token"] == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim


def test_greedy_equals_transformers_over_fp8_kv(fp8_server):
    url, expected = fp8_server
    for prompt, tokens in zip(PROMPTS, expected):  # one at a time: the last one hits the radix cache
        assert post_greedy(url, prompt, N_NEW).json()["output_ids"] == tokens


def test_batch_equals_transformers_over_fp8_kv(fp8_server):
    url, expected = fp8_server
    outs = post_greedy(url, PROMPTS, N_NEW).json()
    assert [o["output_ids"] for o in outs] == expected
