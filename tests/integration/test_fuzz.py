"""Fuzzing a real server: no 5xx, the server stays up, nothing leaks, and generation is reached.

Two kinds of bodies are sent:
- schema-driven ones (schemathesis, from the server's own /openapi.json) and hand-built native
  /generate bodies full of wrong types and out-of-range values: the server must answer each
  without a 5xx and without dying; which of them happen to be valid depends on the draw, so
  nothing is asserted about that;
- valid bodies by construction for each generating route (hypothesis strategies that only draw
  values the API accepts, streaming and not): every one of them must be answered 200 with a
  well-formed result, so generation is reached on every route whatever the draw.

Token budgets are capped (a fuzzer must not ask for a million tokens) and the number of examples
per route is bounded, so the module takes about a minute on two cores.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Dict, List

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from engine.builtin_model import VOCAB_SIZE  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

SERVER_ARGS = ["--max-running-requests", "16"]
MAX_EXAMPLES = 25
VALID_EXAMPLES = 20
# Fields that set how much work a request asks for, and the most the fuzzer may ask.
TOKEN_CAPS = {"max_tokens": 4, "max_new_tokens": 4, "max_completion_tokens": 4, "min_tokens": 2,
              "min_new_tokens": 2, "n": 2, "best_of": 2}
FUZZED_ROUTES = [
    ("POST", "/generate"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/abort_request"),
    ("POST", "/flush_cache"),
    ("GET", "/flush_cache"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("GET", "/get_model_info"),
    ("GET", "/get_server_info"),
    ("GET", "/health"),
]
FUZZ_SETTINGS = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
# A request gets this long before it counts as hung: each asks for at most a few tokens, but on a
# shared 2-core machine under heavy load the whole suite has been seen to run 12x slower.
REQUEST_TIMEOUT_S = 300


def cap_work(value: Any) -> Any:
    """Clamp every token budget (at any depth: batched sampling_params are lists of dicts)."""
    if isinstance(value, dict):
        capped = {}
        for key, item in value.items():
            limit = TOKEN_CAPS.get(key)
            if limit is not None and isinstance(item, int) and not isinstance(item, bool) and item > limit:
                item = limit
            capped[key] = cap_work(item)
        return capped
    if isinstance(value, list):
        return [cap_work(item) for item in value]
    return value


def bound_body(path: str, body: Any) -> Any:
    """Cap token budgets, and give a budget to a request that has none: a chat request without
    max_tokens may generate up to the whole context, far too slow for a fuzzing loop."""
    body = cap_work(body)
    if not isinstance(body, dict):
        return body
    if path in ("/v1/completions", "/v1/chat/completions"):
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = TOKEN_CAPS["max_tokens"]
    elif path == "/generate":
        params = body.get("sampling_params")
        if params is None:
            body["sampling_params"] = {"max_new_tokens": TOKEN_CAPS["max_new_tokens"]}
        elif isinstance(params, dict):
            params.setdefault("max_new_tokens", TOKEN_CAPS["max_new_tokens"])
    return body


# ---------------------------------------------------------------------------- anything goes
# Native /generate bodies built field by field: the schema leaves sampling_params free-form, so
# schema-driven generation rarely gets past "exactly one of text or input_ids".
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
_sampling_params = st.fixed_dictionaries({}, optional={
    "max_new_tokens": st.integers(-2, 6) | _scalars,
    "min_new_tokens": st.integers(-1, 4) | _scalars,
    "temperature": st.floats(-1, 3) | _scalars,
    "top_p": st.floats(-0.5, 1.5) | _scalars,
    "top_k": st.integers(-2, 50) | _scalars,
    "min_p": st.floats(-0.5, 1.5) | _scalars,
    "frequency_penalty": st.floats(-3, 3) | _scalars,
    "presence_penalty": st.floats(-3, 3) | _scalars,
    "repetition_penalty": st.floats(-1, 3) | _scalars,
    "stop": st.lists(st.text(max_size=4), max_size=4) | _scalars,
    "stop_token_ids": st.lists(st.integers(-3, 70000), max_size=3) | _scalars,
    "ignore_eos": st.booleans() | _scalars,
    "n": st.integers(-1, 3) | _scalars,
    "sampling_seed": _scalars,
    "logit_bias": st.dictionaries(st.text(max_size=5), _scalars, max_size=2),
    "skip_special_tokens": _scalars,
    "no_stop_trim": _scalars,
    "bogus_key": _scalars,
})
NATIVE_BODIES = st.fixed_dictionaries({}, optional={
    "text": st.text(max_size=40) | st.lists(st.text(max_size=20), max_size=3),
    "input_ids": st.lists(st.integers(-2, 70000), max_size=10)
    | st.lists(st.lists(st.integers(0, 600), max_size=5), max_size=3),
    "sampling_params": _sampling_params | st.lists(_sampling_params, max_size=3),
    "stream": st.booleans(),
    "return_logprob": st.booleans() | _scalars,
    "top_logprobs_num": st.integers(-1, 25),
    "logprob_start_len": st.integers(-3, 10),
    "rid": st.text(max_size=6),
})

# ---------------------------------------------------------------------------- valid by construction
# Only values the API documents as valid: every body drawn here must reach generation.
_text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=30)
_stops = st.lists(st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=4), max_size=3)
_common_sampling = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50]),
    "min_p": st.floats(0, 1),
    "frequency_penalty": st.floats(-2, 2),
    "presence_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
}
_native_prompt = (st.fixed_dictionaries({"text": _text})
                  | st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, VOCAB_SIZE - 1),
                                                                 min_size=1, max_size=12)}))
VALID_NATIVE = st.tuples(_native_prompt, st.fixed_dictionaries(
    {"sampling_params": st.fixed_dictionaries({"max_new_tokens": st.integers(1, 4)}, optional={
        **_common_sampling,
        "min_new_tokens": st.integers(0, 1),
        "n": st.integers(1, 2),
        "stop": _stops,
        "stop_token_ids": st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3),
        "sampling_seed": st.integers(0, 2**63 - 1),
    })},
    optional={
        "stream": st.booleans(),
        "return_logprob": st.booleans(),
        "top_logprobs_num": st.integers(0, 5),
        "logprob_start_len": st.sampled_from([-1, 0]),
    },
)).map(lambda pair: {**pair[0], **pair[1]})
_openai_sampling = {**{k: v for k, v in _common_sampling.items() if k not in ("skip_special_tokens", "no_stop_trim")},
                    "n": st.integers(1, 2), "stop": _stops, "seed": st.integers(0, 2**63 - 1),
                    "min_tokens": st.integers(0, 1)}
VALID_COMPLETIONS = st.fixed_dictionaries(
    {"prompt": _text | st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12),
     "max_tokens": st.integers(1, 4)},
    optional={**_openai_sampling, "logprobs": st.integers(0, 5), "echo": st.booleans(),
              "stream": st.booleans()},
)
_message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                  "content": _text | st.lists(st.fixed_dictionaries(
                                      {"type": st.just("text"), "text": _text}), min_size=1, max_size=2)})
VALID_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(_message, min_size=1, max_size=3), "max_tokens": st.integers(1, 4)},
    optional={**_openai_sampling, "logprobs": st.booleans(), "stream": st.booleans()},
).map(lambda body: {**body, "top_logprobs": 2} if body.get("logprobs") else body)


def stream_chunks(response: httpx.Response) -> List[Dict[str, Any]]:
    """The JSON chunks of a complete SSE stream: it ends with [DONE] and carries no error chunk."""
    payloads = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]", response.text[-300:]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks and all("error" not in chunk for chunk in chunks), response.text[-300:]
    return chunks


def check_native(body: Dict[str, Any], response: httpx.Response) -> None:
    assert response.status_code == 200, (body, response.text[:300])
    if body.get("stream"):
        last = {chunk.get("index", 0): chunk for chunk in stream_chunks(response)}  # cumulative: last counts
        outputs = list(last.values())
    else:
        result = response.json()
        outputs = result if isinstance(result, list) else [result]
    params = body["sampling_params"]
    assert len(outputs) == params.get("n", 1), outputs
    for output in outputs:
        assert isinstance(output["text"], str)
        assert output["meta_info"]["finish_reason"] is not None, output
        assert output["meta_info"]["completion_tokens"] <= params["max_new_tokens"], output


def check_openai(body: Dict[str, Any], response: httpx.Response) -> None:
    assert response.status_code == 200, (body, response.text[:300])
    if body.get("stream"):
        chunks = stream_chunks(response)
        finished = {c["index"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")}
        assert finished == set(range(body.get("n", 1))), chunks[-1]
    else:
        result = response.json()
        assert len(result["choices"]) == body.get("n", 1), result
        assert result["usage"]["completion_tokens"] <= body["max_tokens"] * body.get("n", 1), result


def wait_idle_and_balanced(url: str, timeout: float = 60) -> dict:
    state: Dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
        if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
            break
        time.sleep(0.2)
    assert state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0, state
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"], state
    assert state["protected_tokens"] == 0, state
    return state


@pytest.mark.timeout(1800)
def test_fuzz_public_routes_no_5xx_no_leak(server):
    url = server.url
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    server_errors: List[str] = []

    def note(route: str, body: Any, response: httpx.Response) -> None:
        if response.status_code >= 500:
            server_errors.append(f"{route} {response.status_code}: {str(body)[:300]} -> {response.text[:300]}")
        assert server.proc.poll() is None, f"the server died on {route}: {body!r}"

    for method, path in FUZZED_ROUTES:
        operation = schema[path][method]

        @seed(1234)
        @settings(max_examples=MAX_EXAMPLES, **FUZZ_SETTINGS)
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            if isinstance(case.body, (dict, list)):
                case.body = bound_body(path, case.body)
            note(f"{method} {path}", case.body, case.call(base_url=url, timeout=REQUEST_TIMEOUT_S))

        run()

    @seed(4321)
    @settings(max_examples=3 * MAX_EXAMPLES, **FUZZ_SETTINGS)
    @given(body=NATIVE_BODIES)
    def run_native(body: Dict[str, Any]) -> None:
        body = bound_body("/generate", body)
        note("native /generate", body, httpx.post(f"{url}/generate", json=body, timeout=REQUEST_TIMEOUT_S))

    run_native()
    assert not server_errors, server_errors[:5]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    wait_idle_and_balanced(url)


@pytest.mark.parametrize("path, strategy, check", [
    ("/generate", VALID_NATIVE, check_native),
    ("/v1/completions", VALID_COMPLETIONS, check_openai),
    ("/v1/chat/completions", VALID_CHAT, check_openai),
], ids=["generate", "completions", "chat"])
@pytest.mark.timeout(1800)
def test_valid_bodies_reach_generation(server, path: str, strategy: st.SearchStrategy,
                                       check: Callable[[Dict[str, Any], httpx.Response], None]):
    """Every valid body is answered 200 with a complete result: generation is reached by
    construction, and a route that fails valid requests (5xx, an error chunk, a wrong shape) fails
    here whatever the draw."""
    url = server.url

    @seed(2024)
    @settings(max_examples=VALID_EXAMPLES, **FUZZ_SETTINGS)
    @given(body=strategy)
    def run(body: Dict[str, Any]) -> None:
        check(body, httpx.post(f"{url}{path}", json=body, timeout=REQUEST_TIMEOUT_S))
        assert server.proc.poll() is None, f"the server died on {path}: {body!r}"

    run()
    wait_idle_and_balanced(url)
    ok = httpx.post(f"{url}/generate", timeout=60, json={"text": "still fine", "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}),
    ("/generate", {"text": "hi", "input_ids": [1, 2]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}),
])
def test_invalid_bodies_get_400(server, path: str, body: Dict[str, Any]):
    response = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["object"] == "error"
