"""An embedding server on the built-in model (`--is-embedding`: last-token pooling, normalised):
the official `openai` client (float and base64), /encode, vectors equal to transformers' last
hidden state, batches of mixed lengths, 400s for bad input and for generation requests, and
no KV left behind after concurrent requests."""

from __future__ import annotations

import concurrent.futures
import re

import httpx
import numpy as np
import openai
import pytest
import torch

from engine.errors import NOT_A_GENERATION_MODEL
from utils_process import wait_until

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

SERVER_ARGS = ["--is-embedding", "--enable-metrics"]
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog, again and again.",
         "日本語のテキストと絵文字 🎉", "x", "def f(x):\n    return x * 2  # code"]


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def builtin():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def post(server_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server_url}{path}", json=body, timeout=120.0)


def test_openai_client_float_and_base64(client: openai.OpenAI, builtin) -> None:
    tok, _ = builtin
    floats = client.embeddings.create(model="engine-builtin", input=TEXTS, encoding_format="float")
    packed = client.embeddings.create(model="engine-builtin", input=TEXTS)  # the client asks for base64
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    for a, b in zip(floats.data, packed.data):
        assert len(a.embedding) == len(b.embedding) == 256
        # Not bit-equal: the second request reuses the first one's cached prefixes.
        assert np.allclose(a.embedding, b.embedding, atol=1e-5)
        assert np.linalg.norm(a.embedding) == pytest.approx(1.0, abs=1e-5)
    tokens = sum(len(tok(t).input_ids) for t in TEXTS)
    assert floats.usage.prompt_tokens == tokens and floats.usage.total_tokens == tokens
    assert floats.model == "engine-builtin"


def test_vectors_equal_transformers_last_token_hidden_state(server_url: str, builtin) -> None:
    tok, hf = builtin
    body = post(server_url, "/v1/embeddings", {"input": TEXTS}).json()
    got = torch.tensor([d["embedding"] for d in body["data"]])
    with torch.inference_mode():
        want = torch.stack([
            torch.nn.functional.normalize(hf.model(torch.tensor([tok(t).input_ids])).last_hidden_state[0, -1], dim=-1)
            for t in TEXTS])
    assert float(torch.nn.functional.cosine_similarity(got, want).min()) >= 0.9999
    assert torch.allclose(got, want, atol=1e-4)


def test_batch_of_mixed_lengths_equals_single_requests(server_url: str) -> None:
    texts = ["short", "a much longer input " * 30, "medium sized input text " * 4, "🙂"]
    batch = post(server_url, "/v1/embeddings", {"input": texts}).json()["data"]
    for text, item in zip(texts, batch):
        alone = post(server_url, "/v1/embeddings", {"input": text}).json()["data"][0]["embedding"]
        assert np.allclose(item["embedding"], alone, atol=1e-5)


def test_encode_native_text_and_token_ids(server_url: str, builtin) -> None:
    tok, _ = builtin
    ids = tok(TEXTS[1]).input_ids
    by_text = post(server_url, "/encode", {"text": TEXTS[1], "rid": "enc-1"}).json()
    by_ids = post(server_url, "/encode", {"input_ids": [ids, ids[:5]]}).json()
    assert by_text["meta_info"]["id"] == "enc-1" and by_text["meta_info"]["prompt_tokens"] == len(ids)
    assert isinstance(by_ids, list) and len(by_ids) == 2
    assert np.allclose(by_text["embedding"], by_ids[0]["embedding"], atol=1e-6)
    openai_ids = post(server_url, "/v1/embeddings", {"input": ids[:5]}).json()["data"][0]["embedding"]
    assert np.allclose(openai_ids, by_ids[1]["embedding"], atol=1e-6)


@pytest.mark.parametrize("path,body,message", [
    ("/v1/embeddings", {"input": ""}, "empty string"),
    ("/v1/embeddings", {"input": [[]]}, "empty token-id list"),
    ("/v1/embeddings", {"input": [-1]}, "non-negative"),
    ("/v1/embeddings", {"input": [5000]}, "out of range for the vocabulary"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "does not support matryoshka representation"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": list(range(7, 7 + 2049))}, "longer than the model's context length (2048"),
    ("/encode", {"text": "x", "image_data": "a.png"}, "image_data"),
    ("/generate", {"text": "hi"}, NOT_A_GENERATION_MODEL),
    ("/v1/completions", {"model": "m", "prompt": "hi"}, NOT_A_GENERATION_MODEL),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, NOT_A_GENERATION_MODEL),
])
def test_bad_requests_get_400(server_url: str, path: str, body: dict, message: str) -> None:
    resp = post(server_url, path, body)
    assert resp.status_code == 400, resp.text
    assert message in resp.json()["message"]


def test_concurrent_requests_leave_no_kv_behind(server_url: str) -> None:
    shared = "a shared prefix that several inputs start with, " * 5
    bodies = [{"input": [shared + f"item {i}", f"alone {i} " * (i % 7 + 1)]} for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda b: post(server_url, "/v1/embeddings", b), bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies)
    assert all(len(r.json()["data"]) == 2 for r in responses)

    def state() -> dict:
        return httpx.get(f"{server_url}/get_server_info", timeout=30).json()["internal_states"][0]

    assert wait_until(lambda: state()["num_running_reqs"] == 0 and state()["num_waiting_reqs"] == 0)
    s = state()
    # Free + cached (unlocked) = the whole pool: nothing is held by a finished request.
    assert s["available_tokens"] + s["evictable_tokens"] == s["max_total_num_tokens"]
    assert s["protected_tokens"] == 0 and s["evictable_tokens"] > 0  # the prompts stay cached
    assert s["cache_hit_rate"] > 0  # the shared prefix was reused
    assert httpx.post(f"{server_url}/flush_cache", timeout=30).status_code == 200
    s = state()
    assert s["available_tokens"] == s["max_total_num_tokens"]


def test_health_generate_and_model_info(server_url: str) -> None:
    assert httpx.get(f"{server_url}/health_generate", timeout=60).status_code == 200
    info = httpx.get(f"{server_url}/get_model_info", timeout=30).json()
    assert info["is_generation"] is False and info["max_req_input_len"] == 2048


def test_embedding_requests_are_counted_in_metrics(server_url: str) -> None:
    def counters() -> tuple:
        text = httpx.get(f"{server_url}/metrics", timeout=30).text
        requests = re.search(r"^sglang:num_requests_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        prompt = re.search(r"^sglang:prompt_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M)
        return float(requests.group(1)) if requests else 0.0, float(prompt.group(1)) if prompt else 0.0

    before = counters()
    body = post(server_url, "/v1/embeddings", {"input": [[5, 6, 7], [8, 9]]}).json()
    assert body["usage"]["prompt_tokens"] == 5
    after = counters()
    assert after[0] - before[0] == 2 and after[1] - before[1] == 5
