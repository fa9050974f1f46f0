"""Issue 34, items 1-5, against a real server (the built-in model): each attack in miniature is
refused with a 4xx and an OpenAI-style body, the server keeps serving, and requests within the
bounds behave as before (oracle: the same request without the attack's extras).
"""

from __future__ import annotations

import asyncio
from typing import Iterator

import httpx
import pytest

from engine.tokenizer.request_normalizer import MAX_CHARS_PER_TOKEN

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _assert_refused(response: httpx.Response, status: int, fragment: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == status and fragment in body["message"], body


def test_a_stop_regex_that_would_unroll_to_millions_of_nodes_is_a_400(server_url):
    response = httpx.post(f"{server_url}/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4, "stop_regex": "(((a{100}){100}){100})"}}, timeout=60)
    _assert_refused(response, 400, "too complex")
    response = httpx.post(f"{server_url}/v1/completions", json={
        "prompt": "Hello", "max_tokens": 4, "stop_regex": ["(x{2000}){2}"]}, timeout=60)
    _assert_refused(response, 400, "too complex")


def test_long_stop_lists_are_a_400_on_every_route(server_url):
    stops = [f"{i:04d}" + "x" * 246 for i in range(4000)]
    response = httpx.post(f"{server_url}/generate", json={
        "text": "Hello", "stream": True, "sampling_params": {"max_new_tokens": 4, "n": 8, "stop": stops}}, timeout=60)
    _assert_refused(response, 400, "at most 32 strings")
    response = httpx.post(f"{server_url}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stop": ["y" * 300]}, timeout=60)
    _assert_refused(response, 400, "at most 256 characters")


def test_stops_within_the_bounds_still_end_requests(server_url):
    base = {"text": "The capital of France", "sampling_params": {"max_new_tokens": 24, **GREEDY}}
    full = httpx.post(f"{server_url}/generate", json=base, timeout=60).json()["text"]
    assert len(full) > 6
    stop = full[3:6]
    cut = httpx.post(f"{server_url}/generate", json={
        **base, "sampling_params": {**base["sampling_params"], "stop": [stop, "z" * 256]}}, timeout=60).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert full.startswith(cut["text"]) and stop not in cut["text"]
    pattern = "(?s).*" + "".join("\\" + c if not c.isalnum() else c for c in full[8:10])
    matched = httpx.post(f"{server_url}/generate", json={
        **base, "sampling_params": {**base["sampling_params"], "stop_regex": [pattern]}}, timeout=60).json()
    assert matched["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}


def test_an_oversized_text_is_a_400_and_health_stays_up(server_url):
    info = httpx.get(f"{server_url}/get_model_info", timeout=30).json()
    huge = "fox " * (info["context_len"] * MAX_CHARS_PER_TOKEN // 4 + 1)

    async def run():
        async with httpx.AsyncClient(base_url=server_url, timeout=60) as client:
            big = asyncio.gather(*(client.post("/generate", json={"text": huge}) for _ in range(4)))
            health = await client.get("/health")
            return health, await big

    health, responses = asyncio.run(run())
    assert health.status_code == 200
    for response in responses:
        _assert_refused(response, 400, "refused before they are tokenized")


def test_input_logprobs_are_bounded_per_request(server_url):
    info = httpx.get(f"{server_url}/get_model_info", timeout=30).json()
    prompt = list(range(10, 10 + info["context_len"] - 8))
    response = httpx.post(f"{server_url}/generate", json={
        "input_ids": prompt, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20,
        "sampling_params": {"max_new_tokens": 1, "n": 128}}, timeout=60)
    _assert_refused(response, 400, "input logprobs")
    # One sample of the same prompt is within the bounds.
    ok = httpx.post(f"{server_url}/generate", json={
        "input_ids": prompt[:64], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 1}}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["meta_info"]["input_token_logprobs"]) == 64


def _chunks(total: int) -> Iterator[bytes]:
    for _ in range(total // (1 << 20)):
        yield b"x" * (1 << 20)


def test_a_chunked_get_body_over_the_limit_is_a_413(server_url):
    response = httpx.request("GET", f"{server_url}/get_weights_by_name", content=_chunks(40 << 20), timeout=120)
    _assert_refused(response, 413, "larger than the limit")
    assert httpx.get(f"{server_url}/health", timeout=30).status_code == 200
