"""SGLang's request labels that change something here: `custom_labels` label the request metrics
(only the names --tokenizer-metrics-allowed-custom-labels allows; OpenAI routes read them from the
--tokenizer-metrics-custom-labels-header JSON header), and `routing_key` (body, or the OpenAI
routes' x-smg-routing-key header) reaches the scheduler for --schedule-policy routing-key."""

from __future__ import annotations

import asyncio
import json
from typing import Any, List

import pytest
from fastapi.testclient import TestClient

from engine.entrypoints.http_server import create_app
from engine.tokenizer import metrics as metrics_module
from engine.errors import EngineRequestError
from engine.io_struct import TokenizedGenerateReqInput
from engine.tokenizer.metrics import (
    OVERFLOW_LABEL_VALUE,
    RequestTimer,
    TokenizerMetricsCollector,
    checked_custom_labels,
    custom_label_names_error,
)
from engine.tokenizer.tokenizer_manager import GenerateReqInput
from engine.server_args import ServerArgs, ServerArgsError

from test_metrics import MODEL, render, samples, value
from test_tokenizer_manager import build_test_tokenizer, run_manager_with_fake_scheduler

LABELS = ["team", "tier"]


# ---------------------------------------------------------------------------- the collector
def test_custom_labels_label_every_request_metric():
    collector = TokenizerMetricsCollector(MODEL, custom_label_names=LABELS)
    collector.observe_output(RequestTimer(created=0.0, labels=collector.label_values({"team": "a"})), 3, 2, True, 1.0)
    collector.observe_output(RequestTimer(created=0.0, labels=collector.label_values(None)), 5, 1, True, 1.0)
    parsed = render(collector)
    assert value(parsed, "sglang:prompt_tokens_total", model_name=MODEL, team="a", tier="") == 3
    assert value(parsed, "sglang:prompt_tokens_total", model_name=MODEL, team="", tier="") == 5
    assert value(parsed, "sglang:time_to_first_token_seconds_count", model_name=MODEL, team="a", tier="") == 1
    assert value(parsed, "sglang:inter_token_latency_seconds_count", model_name=MODEL, team="a", tier="") == 0


def test_label_sets_are_capped(monkeypatch):
    monkeypatch.setattr(metrics_module, "MAX_CUSTOM_LABEL_SETS", 3)
    collector = TokenizerMetricsCollector(MODEL, custom_label_names=["team"])  # holds ("",)
    assert [collector.label_values({"team": t}) for t in "abcab"] == [
        ("a",), ("b",), (OVERFLOW_LABEL_VALUE,), ("a",), ("b",)]
    for team in "abcdefgh":
        collector.observe_one_finished_request(1, 1, 0.1, collector.label_values({"team": team}))
    parsed = render(collector)
    assert {lab["team"] for lab, _ in parsed["sglang:num_requests_total"]} == {"", "a", "b", OVERFLOW_LABEL_VALUE}
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL, team=OVERFLOW_LABEL_VALUE) == 6


def test_label_names_and_values_are_bounded():
    assert custom_label_names_error(["team", "tier_2"]) is None
    for bad in (["bad-name"], ["1x"], ["__x"], ["model_name"], ["le"], ["a", "a"], [f"l{i}" for i in range(17)]):
        assert custom_label_names_error(bad) is not None, bad
        with pytest.raises(ServerArgsError):
            ServerArgs(device="cpu", tokenizer_metrics_allowed_custom_labels=bad)
    assert checked_custom_labels({"team": "a", "other": "x"}, LABELS) == {"team": "a"}
    assert checked_custom_labels({"other": "x"}, LABELS) is None
    assert checked_custom_labels({"other": 5}, LABELS) is None  # not allowed: dropped unchecked
    for bad in ({"team": 5}, {"team": "x" * 129}, ["team"]):
        with pytest.raises(ValueError):
            checked_custom_labels(bad, LABELS)


# ---------------------------------------------------------------------------- manager and HTTP
@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@pytest.fixture
def runtime(tokenizer, monkeypatch):
    yield from run_manager_with_fake_scheduler(tokenizer, monkeypatch, served_model_name=MODEL, enable_metrics=True,
                                               tokenizer_metrics_allowed_custom_labels=LABELS)


def generate(manager: Any, **fields: Any) -> List[dict]:
    async def run() -> List[dict]:
        obj = GenerateReqInput(text="Hello", sampling_params={"max_new_tokens": 2, "ignore_eos": True}, **fields)
        return [out async for out in manager.generate_request(obj)]

    return asyncio.run(asyncio.wait_for(run(), 30))


def test_generate_labels_metrics_and_sends_the_routing_key(runtime):
    manager, fake = runtime
    generate(manager, custom_labels={"team": "search", "unknown": "dropped"}, routing_key="user-7")
    generate(manager)
    parsed = render(manager.metrics_collector)
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL, team="search", tier="") == 1
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL, team="", tier="") == 1
    assert all("unknown" not in labels for labels, _ in parsed["sglang:num_requests_total"])
    assert [m.options.routing_key for m in fake.messages(TokenizedGenerateReqInput)] == ["user-7", None]
    with pytest.raises(EngineRequestError, match="custom_labels"):
        generate(manager, custom_labels={"team": 3})
    with pytest.raises(EngineRequestError, match="routing_key"):
        generate(manager, routing_key="k" * 257)


def test_openai_routes_read_labels_and_routing_key_from_headers(runtime):
    manager, fake = runtime
    server_args = ServerArgs(model_path="unused", device="cpu", enable_metrics=True, served_model_name=MODEL,
                             tokenizer_metrics_allowed_custom_labels=LABELS)
    with TestClient(create_app(manager, server_args)) as client:
        headers = {"x-custom-labels": json.dumps({"tier": "gold", "nope": "x"}), "x-smg-routing-key": "tenant-1"}
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        assert client.post("/v1/completions", json=body, headers=headers).status_code == 200
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat, headers=headers).status_code == 200
        # Not a JSON object: ignored, as SGLang.
        assert client.post("/v1/completions", json=body, headers={"x-custom-labels": "[1"}).status_code == 200
        native = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}, "custom_labels": {"team": "t"},
                  "routing_key": "r"}
        assert client.post("/generate", json=native).status_code == 200
        bad = client.post("/v1/completions", json=body, headers={"x-custom-labels": json.dumps({"tier": "x" * 200})})
        assert bad.status_code == 400 and "custom_labels" in bad.text
        parsed = samples(client.get("/metrics").text)
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL, team="", tier="gold") == 2
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL, team="", tier="") == 1
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL, team="t", tier="") == 1
    keys = [m.options.routing_key for m in fake.messages(TokenizedGenerateReqInput)]
    assert keys == ["tenant-1", "tenant-1", None, "r"]
