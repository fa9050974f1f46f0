"""Schema-driven fuzzing of a real server with schemathesis: no 5xx, the server stays up, no leak.

Requests are generated from the server's own /openapi.json. Token budgets in generated bodies are
capped (a fuzzer must not ask for a million tokens), and the number of examples per route is
bounded so the whole run takes well under a minute on two cores.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SERVER_ARGS = ["--max-running-requests", "16"]
MAX_EXAMPLES = 25
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


@pytest.mark.timeout(240)
def test_fuzz_public_routes_no_5xx_no_leak(server):
    url = server.url
    spec = httpx.get(f"{url}/openapi.json", timeout=30).json()
    schema = schemathesis.openapi.from_dict(spec)
    server_errors: List[str] = []
    statuses: Dict[str, set] = {}
    started = time.monotonic()

    for method, path in FUZZED_ROUTES:
        operation = schema[path][method]

        @seed(1234)
        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case: Any) -> None:
            if isinstance(case.body, (dict, list)):
                case.body = bound_body(path, case.body)
            response = case.call(base_url=url, timeout=60)
            statuses.setdefault(f"{method} {path}", set()).add(response.status_code)
            if response.status_code >= 500:
                server_errors.append(f"{method} {path} {response.status_code}: {str(case.body)[:300]} -> "
                                     f"{response.text[:300]}")
            assert server.proc.poll() is None, f"the server died on {method} {path}: {case.body!r}"

        run()

    @seed(4321)
    @settings(max_examples=3 * MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=NATIVE_BODIES)
    def run_native(body: Dict[str, Any]) -> None:
        body = bound_body("/generate", body)
        response = httpx.post(f"{url}/generate", json=body, timeout=60)
        statuses.setdefault("native /generate", set()).add(response.status_code)
        if response.status_code >= 500:
            server_errors.append(f"native /generate {response.status_code}: {body!r:.300} -> {response.text[:300]}")
        assert server.proc.poll() is None, f"the server died on /generate: {body!r}"

    run_native()

    assert not server_errors, server_errors[:5]
    # Generation was reached, not only validation errors.
    for route in ("native /generate", "POST /v1/completions", "POST /v1/chat/completions"):
        assert {200, 400} <= statuses[route], statuses
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    wait_idle_and_balanced(url)
    ok = httpx.post(f"{url}/generate", timeout=60, json={"text": "still fine", "sampling_params": {
        "max_new_tokens": 3, "ignore_eos": True}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 3
    assert time.monotonic() - started < 120
