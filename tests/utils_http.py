"""HTTP helpers the server tests share: posting, reading SSE streams, comparing generations,
and waiting until a server has gone back to idle with its whole KV pool free."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import httpx
import pytest

from utils_process import wait_until

TIMEOUT = httpx.Timeout(120.0)


def post(url: str, path: str, body: Dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)


def server_state(url: str) -> Dict[str, Any]:
    """Scheduler rank 0's internal state (GET /get_server_info)."""
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]


def same_generation(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    """Two native /generate outputs of the same greedy request agree token for token."""
    assert (a["text"], a["output_ids"]) == (b["text"], b["output_ids"])
    for key in ("prompt_tokens", "completion_tokens", "finish_reason"):
        assert a["meta_info"][key] == b["meta_info"][key], key
    for key in ("output_token_logprobs", "input_token_logprobs"):
        if key in a["meta_info"]:
            mine, theirs = a["meta_info"][key], b["meta_info"][key]
            assert [e[1:] for e in mine] == [e[1:] for e in theirs]  # token ids and texts
            # Values may differ in the last bits: a prefix-cache hit changes the prefill's shape.
            assert all(x[0] == pytest.approx(y[0], abs=1e-3) for x, y in zip(mine, theirs) if x[0] is not None)


def sse_payloads(response_lines: List[str]) -> List[str]:
    return [line[len("data:"):].strip() for line in response_lines if line.startswith("data:")]


def stream_events(url: str, path: str, body: Dict[str, Any]) -> List[Any]:
    """Every event of a streamed response (200 and a final [DONE] asserted)."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200, response.read()
        payloads = sse_payloads(list(response.iter_lines()))
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def wait_idle(url: str) -> Dict[str, Any]:
    """Wait until the server runs and queues nothing; then its KV pool must be whole again."""
    last: Dict[str, Any] = {}

    def idle() -> bool:
        nonlocal last
        last = server_state(url)
        return last["num_running_reqs"] == 0 and last["num_waiting_reqs"] == 0

    assert wait_until(idle, 60, interval=0.2), last
    assert last["available_tokens"] + last["evictable_tokens"] == last["max_total_num_tokens"], last
    assert last["protected_tokens"] == 0, last
    return last
