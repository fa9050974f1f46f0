"""A whole server on the simulated accelerator (--simulated-device-forward-ms): /generate and the
OpenAI routes, streaming and not, give the device's deterministic tokens through the real
scheduler, detokenizer and HTTP layer."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from engine.builtin_model import ensure_builtin_model
from engine.model_executor.simulated_device import ordinary_token_ids, simulated_next_tokens, special_token_ids

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

SERVER_ARGS = ["--simulated-device-forward-ms", "2,0.01", "--max-running-requests", "64"]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_builtin_model())


def expected_ids(prompt: list[int], n: int) -> list[int]:
    """The oracle: the simulated device's token function applied one position at a time."""
    path = ensure_builtin_model()
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    allowed = ordinary_token_ids(config["vocab_size"], special_token_ids(path) | {config["eos_token_id"]})
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(simulated_next_tokens(torch.tensor([seq[-1]]), torch.tensor([len(seq) - 1]), allowed)[0]))
    return seq[len(prompt):]


def generate(url: str, prompt: list[int], n: int, stream: bool = False) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0.7}, "stream": stream}
    if not stream:
        r = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()
    last = None
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    outputs = [json.loads(c) for c in chunks[:-1]]
    # At most one chunk per token (outputs that arrive together are coalesced), text cumulative.
    assert 1 <= len(outputs) <= n
    for out in outputs:
        if last is not None:
            assert out["text"].startswith(last["text"])
            assert out["meta_info"]["completion_tokens"] > last["meta_info"]["completion_tokens"]
        last = out
    return last


def test_generate_gives_the_token_function(server_url, tokenizer):
    prompt = [11, 250, 1033, 7]
    out = generate(server_url, prompt, 12)
    assert out["output_ids"] == expected_ids(prompt, 12)
    assert out["text"] == tokenizer.decode(out["output_ids"])
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


def test_streaming_equals_non_streaming(server_url):
    prompt = [99, 98, 97]
    streamed, whole = generate(server_url, prompt, 9, stream=True), generate(server_url, prompt, 9)
    assert streamed["text"] == whole["text"]
    assert streamed["output_ids"] == whole["output_ids"] == expected_ids(prompt, 9)


def test_concurrent_requests_are_deterministic(server_url):
    prompts = [[20 + i, 300 + 7 * i, 40] for i in range(48)]

    async def run_all() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as client:
            async def one(p):
                r = await client.post(f"{server_url}/generate",
                                      json={"input_ids": p, "sampling_params": {"max_new_tokens": 16}})
                assert r.status_code == 200, r.text
                return r.json()

            return await asyncio.gather(*(one(p) for p in prompts))

    first, second = asyncio.run(run_all()), asyncio.run(run_all())
    for prompt, a, b in zip(prompts, first, second):
        assert a["output_ids"] == b["output_ids"] == expected_ids(prompt, 16)
        assert a["text"] == b["text"]


def test_chat_completion_streams(server_url):
    body = {"model": "engine-builtin", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    r = httpx.post(f"{server_url}/v1/chat/completions", json={**body, "stream": False, "stream_options": None}, timeout=60)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == text
