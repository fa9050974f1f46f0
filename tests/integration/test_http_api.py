"""The native HTTP API against a real server (built-in model, CPU): streaming, greedy parity with
transformers, concurrency, disconnects, aborts and bad input."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Dict, List

import httpx
import pytest

from engine.builtin_model import ensure_builtin_model

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

GREEDY = {"temperature": 0.0}
# Every forward takes at least 10 ms (a testing aid): the disconnect tests count forwards, and a
# LONG request must not be able to finish before its disconnect is noticed, however fast the
# machine is.
SERVER_ENV = {"ENGINE_TEST_FORWARD_SLEEP_S": "0.01"}


@pytest.fixture(scope="module")
def base_url(server_url: str) -> str:
    return server_url


@pytest.fixture(scope="module")
def http(base_url: str):
    with httpx.Client(base_url=base_url, timeout=120.0) as client:
        yield client


def internal_state(http: httpx.Client) -> Dict[str, Any]:
    info = http.get("/get_server_info")
    assert info.status_code == 200, info.text
    states = info.json()["internal_states"]
    assert states, "one internal state per scheduler replica"
    return states[0]


def is_idle(state: Dict[str, Any]) -> bool:
    return (
        state["num_running_reqs"] == 0
        and state["num_waiting_reqs"] == 0
        and state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"]
    )


def wait_idle(http: httpx.Client, timeout: float) -> Dict[str, Any]:
    deadline = time.monotonic() + timeout
    state = internal_state(http)
    while not is_idle(state) and time.monotonic() < deadline:
        time.sleep(0.1)
        state = internal_state(http)
    return state


def sse_payloads(lines: List[str]) -> List[Any]:
    events = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def assert_error(response: httpx.Response, status: int, needle: str = "") -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error" and body["code"] == status
    assert needle.lower() in body["message"].lower(), body["message"]


# ---------------------------------------------------------------------------- basics
def test_health_and_info(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and "model_path" in info and "tokenizer_path" in info
    server = http.get("/get_server_info").json()
    assert server["tp_size"] == 1 and "version" in server
    assert internal_state(http)["max_total_num_tokens"] > 0
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == info["served_model_name"]


def test_test_servers_run_the_strict_memory_check(http: httpx.Client) -> None:
    # A leak in any integration test kills its server instead of scrolling past in a log.
    assert http.get("/get_server_info").json()["strict_memory_check"] is True


def test_flush_cache_when_idle(http: httpx.Client) -> None:
    wait_idle(http, 30)
    response = http.post("/flush_cache")
    assert response.status_code == 200, response.text


def test_generate_batch_and_logprobs(http: httpx.Client) -> None:
    out = http.post("/generate", json={
        "text": ["Hello", "The sky"], "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, **GREEDY},
        "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0, "return_text_in_logprobs": True,
    }).json()
    assert isinstance(out, list) and len(out) == 2
    for item in out:
        meta = item["meta_info"]
        assert meta["completion_tokens"] == 3 and meta["finish_reason"]["type"] == "length"
        assert [e[1] for e in meta["output_token_logprobs"]] == item["output_ids"]
        assert all(len(top) == 2 for top in meta["output_top_logprobs"])
        # Greedy: the chosen token is the most likely one.
        for chosen, top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
            assert chosen[1] == top[0][1]
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
        assert meta["input_token_logprobs"][0][0] is None


def test_logprob_start_len_at_the_prompt_length_gives_no_input_logprobs(http: httpx.Client) -> None:
    params = {"max_new_tokens": 3, "ignore_eos": True, **GREEDY}
    plain = http.post("/generate", json={"text": "The sky", "sampling_params": params}).json()
    n = plain["meta_info"]["prompt_tokens"]
    out = http.post("/generate", json={"text": "The sky", "sampling_params": params, "return_logprob": True,
                                       "top_logprobs_num": 2, "logprob_start_len": n})
    assert out.status_code == 200, out.text
    meta = out.json()["meta_info"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []
    assert [e[1] for e in meta["output_token_logprobs"]] == out.json()["output_ids"] == plain["output_ids"]
    too_far = http.post("/generate", json={"text": "The sky", "sampling_params": params, "return_logprob": True,
                                           "logprob_start_len": n + 1})
    assert_error(too_far, 400, "logprob_start_len")


# ---------------------------------------------------------------------------- streaming
def test_generate_stream_deltas_equal_final_text(http: httpx.Client, tokenizer) -> None:
    body = {"text": "Once upon a time", "stream": True,
            "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, **GREEDY}}
    with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_payloads(list(response.iter_lines()))
    texts = [e["text"] for e in events]
    deltas = []
    previous = ""
    for text in texts:
        assert text.startswith(previous), "the streamed text is cumulative"
        deltas.append(text[len(previous):])
        previous = text
    final = events[-1]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert "".join(deltas) == final["text"]
    assert final["text"] == tokenizer.decode(final["output_ids"], skip_special_tokens=True)
    non_stream = http.post("/generate", json={**body, "stream": False}).json()
    assert non_stream["output_ids"] == final["output_ids"]


def stream_text(http: httpx.Client, body: Dict[str, Any]) -> tuple:
    """(concatenation of the streamed deltas, last event) of a streaming /generate."""
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = sse_payloads(list(response.iter_lines()))
    previous = ""
    deltas = []
    for event in events:
        assert event["text"].startswith(previous), "the streamed text is cumulative"
        deltas.append(event["text"][len(previous):])
        previous = event["text"]
    return "".join(deltas), events[-1]


def test_stop_string_ends_the_request_before_min_new_tokens(http: httpx.Client, tokenizer) -> None:
    # As SGLang: min_new_tokens holds back EOS and stop token ids only; a stop string ends the request
    # at its first occurrence, however early. The built-in model answers this prompt with
    # " pr pr pr pr prlälä pr pr ...": "lä" occurs early.
    stop = "lä"
    params = {"max_new_tokens": 40, "ignore_eos": True, **GREEDY}
    ref = http.post("/generate", json={"text": "The capital of France is", "sampling_params": params}).json()
    ids = ref["output_ids"]
    first = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    body = {"text": "The capital of France is",
            "sampling_params": {**params, "stop": stop, "min_new_tokens": first + 2}}
    final = http.post("/generate", json=body).json()
    streamed, last = stream_text(http, body)
    text = final["text"]
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert final["meta_info"]["completion_tokens"] == first
    assert text == ref["text"][:ref["text"].index(stop)]
    assert streamed == text == last["text"]


def test_greedy_matches_transformers(http: httpx.Client, tokenizer) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_builtin_model(), torch_dtype=torch.float32)
    model.eval()
    steps = 8
    for prompt in ("Hello, my name is", "1 2 3 4"):
        ids = tokenizer(prompt)["input_ids"]
        out = http.post("/generate", json={
            "input_ids": ids, "sampling_params": {"max_new_tokens": steps, "ignore_eos": True, **GREEDY}}).json()
        expected: List[int] = []
        current = torch.tensor([ids])
        with torch.no_grad():
            for _ in range(steps):
                next_id = int(model(current).logits[0, -1].argmax())
                expected.append(next_id)
                current = torch.cat([current, torch.tensor([[next_id]])], dim=1)
        assert out["output_ids"] == expected, prompt


def test_64_concurrent_streams_then_idle(http: httpx.Client, base_url: str) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> Dict[str, Any]:
        body = {"text": f"Request number {i}", "stream": True,
                "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, **GREEDY}}
        async with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            lines = [line async for line in response.aiter_lines()]
        return sse_payloads(lines)[-1]

    async def run() -> List[Dict[str, Any]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=base_url, timeout=300.0, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    finals = asyncio.run(run())
    assert len(finals) == 64
    assert all(f["meta_info"]["completion_tokens"] == 6 for f in finals)
    assert all(f["meta_info"]["finish_reason"]["type"] == "length" for f in finals)
    state = wait_idle(http, 30)
    assert is_idle(state), state


LONG = 2000  # output tokens: at least 20 s of decoding (10 ms a forward) unless aborted


def stream_and_hang_up(base_url: str, events_to_read: int) -> None:
    """Stream a long request, read some events, hang up."""
    body = {"text": "Tell me a long story", "stream": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    events = 0
    with httpx.Client(base_url=base_url, timeout=60.0) as client:
        with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                events += line.startswith("data: ")
                if events == events_to_read:
                    break


def assert_aborted(http: httpx.Client, forwards_before: int) -> None:
    """Idle again after far fewer forwards than the request's LONG tokens: it was aborted. The
    bound holds whatever the machine's speed as long as the disconnect is noticed within 10 s
    (1000 forwards of at least 10 ms); it is noticed within about 2.5 s."""
    state = wait_idle(http, 120)
    assert is_idle(state), state
    assert state["forward_ct"] - forwards_before < LONG // 2, state


def test_client_disconnect_mid_stream_aborts(http: httpx.Client, base_url: str) -> None:
    before = wait_idle(http, 30)["forward_ct"]
    stream_and_hang_up(base_url, events_to_read=12)
    assert_aborted(http, before)


def test_client_disconnect_non_streaming_aborts(http: httpx.Client, base_url: str) -> None:
    before = wait_idle(http, 30)["forward_ct"]
    body = {"text": "Another long story", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
    with httpx.Client(base_url=base_url, timeout=1.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json=body)
    # The server notices a vanished non-streaming client by polling (every second).
    assert_aborted(http, before)


def test_abort_request_endpoint(http: httpx.Client, base_url: str, tokenizer) -> None:
    # As SGLang: a request aborted through /abort_request is answered 200 with its partial output
    # and finish_reason abort (no status code: a graceful abort, not an error).
    wait_idle(http, 30)

    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
            body = {"text": "Abort me", "rid": "abort-me-please",
                    "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}}
            task = asyncio.ensure_future(client.post("/generate", json=body))
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                info = (await client.get("/get_server_info")).json()["internal_states"][0]
                if info["num_running_reqs"] + info["num_waiting_reqs"] > 0:
                    break
                await asyncio.sleep(0.05)
            aborted = await client.post("/abort_request", json={"rid": "abort-me-please"})
            assert aborted.status_code == 200
            return await asyncio.wait_for(task, 30)

    response = asyncio.run(run())
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["finish_reason"]["status_code"] is None
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] < LONG
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)
    assert is_idle(wait_idle(http, 20))


def test_abort_request_mid_stream_ends_the_stream_with_the_partial_output(http: httpx.Client) -> None:
    wait_idle(http, 30)
    body = {"text": "Abort me while streaming", "rid": "abort-stream", "stream": True,
            "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, **GREEDY}}
    lines: List[str] = []
    with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data: {") and sum(x.startswith("data: {") for x in lines) == 3:
                assert http.post("/abort_request", json={"rid": "abort-stream"}).status_code == 200
    events = sse_payloads(lines)
    last = events[-1]
    assert "error" not in last
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    partial = last["output_ids"]
    assert 3 <= len(partial) < LONG
    # The partial output is the greedy output so far.
    ref = http.post("/generate", json={"text": body["text"], "sampling_params": {
        **body["sampling_params"], "max_new_tokens": len(partial)}}).json()
    assert ref["output_ids"] == partial and ref["text"] == last["text"]
    assert is_idle(wait_idle(http, 20))


# ---------------------------------------------------------------------------- bad input
BAD_GENERATE = [
    ({}, "text or input_ids"),
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({"text": 3}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [10 ** 9]}, "vocabulary"),
    ({"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "x"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"no_such_param": 1}}, "no_such_param"),
    ({"text": "a", "sampling_params": {"n": 0}}, "n"),
    ({"text": "hello " * 2100}, "context length"),
    ({"text": ["a", "b"], "rid": ["same"]}, "rid"),
    ({"text": "a", "sampling_params": {"sampling_seed": 2 ** 80}}, "sampling_seed"),
    ({"text": "a", "sampling_params": {"n": 10 ** 6}}, "n must be"),
]


def test_bad_native_inputs_get_400_and_server_survives(http: httpx.Client) -> None:
    for body, needle in BAD_GENERATE:
        assert_error(http.post("/generate", json=body), 400, needle)
        assert_error(http.post("/generate", json={**body, "stream": True}), 400, needle)
    assert_error(http.post("/generate", content=b"{oops", headers={"content-type": "application/json"}), 400, "json")
    good = http.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}})
    assert good.status_code == 200 and good.json()["meta_info"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200


def test_bad_openai_inputs_get_400(http: httpx.Client) -> None:
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "n": 500}, "n"),
        ("/v1/completions", {"prompt": "a", "logprobs": 50}, "logprobs"),
        ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
        ("/v1/completions", {"prompt": "hello " * 2100}, "context length"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 5000}, "context length"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "alien", "content": "x"}]}, "role"),
        ("/v1/chat/completions", {"messages": user, "top_logprobs": 30, "logprobs": True}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": user, "response_format": {"type": "json_schema"}}, "json_schema"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 2100}]}, "context length"),
    ]
    for path, body, needle in cases:
        assert_error(http.post(path, json=body), 400, needle)
        assert_error(http.post(path, json={**body, "stream": True}), 400, needle)
    ok = http.post("/v1/chat/completions", json={"messages": user, "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_embedding_requests_to_a_generation_server_get_400(http: httpx.Client) -> None:
    from engine.errors import NOT_AN_EMBEDDING_MODEL

    for path, body in (("/v1/embeddings", {"input": "hello"}), ("/encode", {"text": "hello"})):
        response = http.post(path, json=body)
        assert_error(response, 400, "--is-embedding")
        assert response.json()["message"] == NOT_AN_EMBEDDING_MODEL
    assert http.get("/get_model_info").json()["is_generation"] is True


def test_oversized_body_gets_413(http: httpx.Client) -> None:
    response = http.post("/v1/completions", content=b"x" * (33 * 1024 * 1024),
                         headers={"content-type": "application/json"})
    assert_error(response, 413)
    assert http.get("/health").status_code == 200
