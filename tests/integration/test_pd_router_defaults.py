"""PD disaggregation behind the real sglang-router as SGLang's own PD example starts it: `--prefill URL`
with no bootstrap port. The router then sends `"bootstrap_port": null` on every request, and each
server takes its own `--disaggregation-bootstrap-port` (SGLang's scheduler does the same), so the
decode server is started with the prefill's port.

One prefill, one decode, one router and a unified server as the oracle: greedy outputs through the
router equal the unified server's, on /generate and the chat route; so do constrained outputs
(regex, json_schema, ebnf, a JSON-schema response_format), which PD used to refuse with 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

import pytest

from conftest import ServerProcess, start_server_process
from engine.utils.network_utils import get_free_port
from utils_http import post, same_generation, wait_idle
from utils_router import PrefillEndpoint, RouterProcess, needs_router, start_pd_router

pytestmark = [needs_router, pytest.mark.slow]

GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@dataclass
class Deployment:
    unified: ServerProcess
    prefill: ServerProcess
    decode: ServerProcess
    router: str


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    servers: List[ServerProcess] = []
    router: Optional[RouterProcess] = None
    try:
        port = get_free_port()
        bootstrap = ["--disaggregation-bootstrap-port", str(port)]
        compact = ["--constrained-json-disable-any-whitespace"]  # short JSON answers: they finish
        prefill = start_server_process(["--disaggregation-mode", "prefill", *bootstrap, *compact], wait=False)
        decode = start_server_process(["--disaggregation-mode", "decode", *bootstrap, *compact], wait=False)
        unified = start_server_process(compact, wait=False)
        servers = [prefill, decode, unified]
        for server in servers:
            server.wait_healthy()
        router = start_pd_router([PrefillEndpoint(prefill.url, None)], [decode.url], "round_robin")
        yield Deployment(unified, prefill, decode, router.url)
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()


def test_router_without_bootstrap_ports_equals_unified(deployment: Deployment) -> None:
    for text in ("The capital of France is", "1 2 3 4 5 6 7 8"):
        body: Dict[str, Any] = {"text": text, "sampling_params": GREEDY}
        through_pd = post(deployment.router, "/generate", body)
        assert through_pd.status_code == 200, through_pd.text
        same_generation(through_pd.json(), post(deployment.unified.url, "/generate", body).json())
    chat = {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}
    through_pd = post(deployment.router, "/v1/chat/completions", chat)
    assert through_pd.status_code == 200, through_pd.text
    expected = post(deployment.unified.url, "/v1/chat/completions", chat).json()
    assert through_pd.json()["choices"][0]["message"] == expected["choices"][0]["message"]
    for server in (deployment.prefill, deployment.decode):
        wait_idle(server.url)


def test_constrained_outputs_through_pd_equal_unified(deployment: Deployment) -> None:
    pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
              "required": ["city"], "additionalProperties": False}
    constraints: List[Dict[str, Any]] = [
        {"regex": r"[a-z]{2,6}( [a-z]{2,6}){1,2}\."},
        {"json_schema": json.dumps(schema)},
        {"ebnf": 'root ::= "yes" | "no" | ("maybe " [0-9])'},
    ]
    for constraint in constraints:
        body = {"text": "The answer is", "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, **constraint}}
        through_pd = post(deployment.router, "/generate", body)
        assert through_pd.status_code == 200, through_pd.text
        expected = post(deployment.unified.url, "/generate", body).json()
        assert expected["meta_info"]["finish_reason"]["type"] != "abort", expected
        same_generation(through_pd.json(), expected)
    # The OpenAI route's response_format goes the same way.
    chat = {"model": "x", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}}
    through_pd = post(deployment.router, "/v1/chat/completions", chat)
    assert through_pd.status_code == 200, through_pd.text
    expected = post(deployment.unified.url, "/v1/chat/completions", chat).json()
    assert through_pd.json()["choices"][0]["message"] == expected["choices"][0]["message"]
    json.loads(expected["choices"][0]["message"]["content"])
    for server in (deployment.prefill, deployment.decode):
        wait_idle(server.url)
