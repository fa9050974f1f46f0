"""Metrics and production behaviour of the front end, in-process.

- TokenizerMetricsCollector: SGLang's names with a `model_name` label, values after scripted
  outputs (TTFT, inter-token latency, e2e, token counters), scheduler gauges at scrape time.
- The TokenizerManager against the fake scheduler of test_tokenizer_manager: metrics observed as
  outputs arrive, concurrent health checks sharing one probe, graceful shutdown ending streams.
- The HTTP app: /metrics only with --enable-metrics, behind the API key like every route but /health.
"""

from __future__ import annotations

import asyncio
from typing import Any, Dict, List

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from engine.entrypoints.http_server import create_app
from engine.io_struct import AbortReq, TokenizedGenerateReqInput
from engine.tokenizer.metrics import RequestTimer, TokenizerMetricsCollector
from engine.tokenizer.tokenizer_manager import GenerateReqInput
from engine.server_args import ServerArgs

from test_tokenizer_manager import build_test_tokenizer, run_manager_with_fake_scheduler

from utils_process import wait_until

MODEL = "test-model"


def samples(text: str) -> Dict[str, List[Any]]:
    """Exposition text -> {sample name: [(labels, value), ...]} (parsed by prometheus_client)."""
    out: Dict[str, List[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def value(parsed: Dict[str, List[Any]], name: str, **labels: str) -> float:
    matches = [v for lab, v in parsed[name] if all(lab.get(k) == x for k, x in labels.items())]
    assert len(matches) == 1, (name, labels, parsed.get(name))
    return matches[0]


def render(collector: TokenizerMetricsCollector) -> Dict[str, List[Any]]:
    return samples(collector.render().decode())


# ---------------------------------------------------------------------------- the collector
def test_streamed_request_observes_ttft_itl_e2e_and_tokens():
    collector = TokenizerMetricsCollector(MODEL)
    timer = RequestTimer(created=100.0)
    collector.observe_output(timer, prompt_tokens=7, completion_tokens=1, finished=False, now=100.3)
    collector.observe_output(timer, prompt_tokens=7, completion_tokens=2, finished=False, now=100.32)
    # Three tokens in one output after 0.09 s: three gaps of 0.03 s.
    collector.observe_output(timer, prompt_tokens=7, completion_tokens=5, finished=True, now=100.41)
    parsed = render(collector)

    assert value(parsed, "sglang:prompt_tokens_total", model_name=MODEL) == 7
    assert value(parsed, "sglang:generation_tokens_total", model_name=MODEL) == 5
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL) == 1
    assert value(parsed, "sglang:time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert value(parsed, "sglang:time_to_first_token_seconds_sum", model_name=MODEL) == pytest.approx(0.3)
    assert value(parsed, "sglang:time_to_first_token_seconds_bucket", model_name=MODEL, le="0.25") == 0
    assert value(parsed, "sglang:time_to_first_token_seconds_bucket", model_name=MODEL, le="0.5") == 1
    # Four gaps between five tokens: 0.02, then 3 x 0.03.
    assert value(parsed, "sglang:inter_token_latency_seconds_count", model_name=MODEL) == 4
    assert value(parsed, "sglang:inter_token_latency_seconds_sum", model_name=MODEL) == pytest.approx(0.11)
    assert value(parsed, "sglang:inter_token_latency_seconds_bucket", model_name=MODEL, le="0.02") == 1
    assert value(parsed, "sglang:inter_token_latency_seconds_bucket", model_name=MODEL, le="0.04") == 4
    assert value(parsed, "sglang:e2e_request_latency_seconds_count", model_name=MODEL) == 1
    assert value(parsed, "sglang:e2e_request_latency_seconds_sum", model_name=MODEL) == pytest.approx(0.41)
    assert value(parsed, "sglang:e2e_request_latency_seconds_bucket", model_name=MODEL, le="+Inf") == 1


def test_non_streamed_request_and_abort_without_tokens():
    collector = TokenizerMetricsCollector(MODEL)
    # A non-streamed request: one output with everything; its TTFT is its e2e latency.
    collector.observe_output(RequestTimer(created=0.0), 4, 3, True, now=2.0)
    # Rejected before any token: counted as a request, with no TTFT.
    collector.observe_output(RequestTimer(created=0.0), 9, 0, True, now=0.01)
    parsed = render(collector)
    assert value(parsed, "sglang:prompt_tokens_total", model_name=MODEL) == 13
    assert value(parsed, "sglang:generation_tokens_total", model_name=MODEL) == 3
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL) == 2
    assert value(parsed, "sglang:time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert value(parsed, "sglang:time_to_first_token_seconds_sum", model_name=MODEL) == pytest.approx(2.0)
    assert value(parsed, "sglang:inter_token_latency_seconds_count", model_name=MODEL) == 0
    assert value(parsed, "sglang:e2e_request_latency_seconds_count", model_name=MODEL) == 2


def test_gauges_come_from_scheduler_states_and_vanish_without_them():
    collector = TokenizerMetricsCollector(MODEL)
    assert "sglang:num_running_reqs" not in render(collector)
    collector.set_scheduler_states([
        {"num_running_reqs": 3, "num_waiting_reqs": 5, "token_usage": 0.5, "cache_hit_rate": 0.2,
         "gen_throughput": 100.0, "num_grammar_queue_reqs": 2},
        {"num_running_reqs": 1, "num_waiting_reqs": 0, "token_usage": 0.1, "cache_hit_rate": 0.4,
         "gen_throughput": 50.0, "num_grammar_queue_reqs": 1},
    ])
    parsed = render(collector)
    assert value(parsed, "sglang:num_running_reqs", model_name=MODEL) == 4
    assert value(parsed, "sglang:num_queue_reqs", model_name=MODEL) == 5
    assert value(parsed, "sglang:num_grammar_queue_reqs", model_name=MODEL) == 3
    assert value(parsed, "sglang:token_usage", model_name=MODEL) == pytest.approx(0.3)
    assert value(parsed, "sglang:cache_hit_rate", model_name=MODEL) == pytest.approx(0.3)
    assert value(parsed, "sglang:gen_throughput", model_name=MODEL) == pytest.approx(150.0)
    # A scrape that could not reach the scheduler shows no stale gauge.
    collector.set_scheduler_states(None)
    parsed = render(collector)
    assert "sglang:num_running_reqs" not in parsed and "sglang:prompt_tokens_total" in parsed


def test_collectors_have_separate_registries():
    first, second = TokenizerMetricsCollector("a"), TokenizerMetricsCollector("b")
    first.observe_one_finished_request(10, 2, 0.5)
    assert value(render(first), "sglang:prompt_tokens_total", model_name="a") == 10
    assert value(render(second), "sglang:prompt_tokens_total", model_name="b") == 0


# ---------------------------------------------------------------------------- the TokenizerManager
@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@pytest.fixture
def runtime(tokenizer, monkeypatch):
    yield from run_manager_with_fake_scheduler(tokenizer, monkeypatch, served_model_name=MODEL, enable_metrics=True)


def run(coro: Any, timeout: float = 30) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_manager_observes_metrics_as_outputs_arrive(runtime, tokenizer):
    manager, fake = runtime

    async def generate() -> List[dict]:
        outs = []
        for stream in (True, False):
            obj = GenerateReqInput(text="Hello world", stream=stream,
                                   sampling_params={"max_new_tokens": 4, "ignore_eos": True})
            outs += [out async for out in manager.generate_request(obj)]
        # A health probe is not a user request: it must not show up in the counters.
        assert await manager.health_generate(timeout=10) is True
        return outs

    outs = run(generate())
    prompt_len = len(tokenizer.encode("Hello world"))
    assert outs[-1]["meta_info"]["completion_tokens"] == 4
    parsed = render(manager.metrics_collector)
    assert value(parsed, "sglang:num_requests_total", model_name=MODEL) == 2
    assert value(parsed, "sglang:prompt_tokens_total", model_name=MODEL) == 2 * prompt_len
    assert value(parsed, "sglang:generation_tokens_total", model_name=MODEL) == 8
    assert value(parsed, "sglang:time_to_first_token_seconds_count", model_name=MODEL) == 2
    # The fake scheduler sends one token per output: each later token is one ITL sample.
    assert value(parsed, "sglang:inter_token_latency_seconds_count", model_name=MODEL) == 6
    assert value(parsed, "sglang:e2e_request_latency_seconds_count", model_name=MODEL) == 2


def test_concurrent_health_checks_share_one_probe_and_abort_it(runtime):
    manager, fake = runtime
    fake.paused.set()  # a stuck scheduler: nothing completes

    async def probes() -> List[bool]:
        return list(await asyncio.gather(*(manager.health_generate(timeout=0.5) for _ in range(5))))

    assert run(probes()) == [False] * 5
    probes_sent = [m for m in fake.messages(TokenizedGenerateReqInput) if m.rid.startswith("HEALTH_CHECK")]
    assert len(probes_sent) == 1
    assert wait_until(lambda: any(m.rid == probes_sent[0].rid for m in fake.messages(AbortReq))), \
        "the timed-out probe was not aborted"
    # Once the scheduler moves again, a new probe succeeds.
    fake.paused.clear()
    assert run(manager.health_generate(timeout=10)) is True


def test_begin_shutdown_ends_streams_with_503_and_refuses_new_requests(runtime):
    manager, fake = runtime
    fake.paused.set()

    async def scenario() -> tuple[List[dict], Exception]:
        obj = GenerateReqInput(text="Hello", stream=True, sampling_params={"max_new_tokens": 50})
        outs: List[dict] = []

        async def consume() -> None:
            async for out in manager.generate_request(obj):
                outs.append(out)

        task = asyncio.ensure_future(consume())
        while not fake.messages(TokenizedGenerateReqInput):
            await asyncio.sleep(0.01)
        manager.begin_shutdown()
        await task
        try:
            async for _ in manager.generate_request(GenerateReqInput(text="late")):
                pass
        except Exception as exc:  # noqa: BLE001 - inspected below
            return outs, exc
        raise AssertionError("a request after shutdown was accepted")

    outs, late_error = run(scenario())
    reason = outs[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 503
    assert "shutting down" in reason["message"]
    assert getattr(late_error, "status_code", None) == 503
    assert not manager.is_alive()
    assert wait_until(lambda: any(m.abort_all for m in fake.messages(AbortReq)))


# ---------------------------------------------------------------------------- the HTTP app
class MetricsManager:
    """Just enough of the TokenizerManager contract for /metrics and /health."""

    served_model_name = MODEL

    def __init__(self, state_error: bool = False) -> None:
        self.metrics_collector = TokenizerMetricsCollector(MODEL)
        self.state_error = state_error

    async def get_internal_state(self) -> List[dict]:
        if self.state_error:
            from engine.errors import EngineRequestError

            raise EngineRequestError("no reply", 503)
        return [{"num_running_reqs": 2, "num_waiting_reqs": 1, "token_usage": 0.25, "cache_hit_rate": 0.5,
                 "gen_throughput": 12.5}]

    def is_alive(self) -> bool:
        return True


def test_metrics_route_only_with_enable_metrics():
    manager = MetricsManager()
    with TestClient(create_app(manager, ServerArgs(device="cpu"))) as client:
        assert client.get("/metrics").status_code == 404
    manager.metrics_collector.observe_one_finished_request(3, 4, 0.2)
    with TestClient(create_app(manager, ServerArgs(device="cpu", enable_metrics=True))) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    parsed = samples(response.text)
    assert value(parsed, "sglang:prompt_tokens_total", model_name=MODEL) == 3
    assert value(parsed, "sglang:generation_tokens_total", model_name=MODEL) == 4
    assert value(parsed, "sglang:num_running_reqs", model_name=MODEL) == 2
    assert value(parsed, "sglang:num_queue_reqs", model_name=MODEL) == 1
    assert value(parsed, "sglang:token_usage", model_name=MODEL) == 0.25


def test_metrics_scrape_survives_an_unreachable_scheduler():
    manager = MetricsManager(state_error=True)
    with TestClient(create_app(manager, ServerArgs(device="cpu", enable_metrics=True))) as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    parsed = samples(response.text)
    assert "sglang:num_running_reqs" not in parsed
    assert value(parsed, "sglang:prompt_tokens_total", model_name=MODEL) == 0


def test_metrics_needs_the_api_key_but_health_does_not():
    manager = MetricsManager()
    args = ServerArgs(device="cpu", enable_metrics=True, api_key="sekret")
    with TestClient(create_app(manager, args)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert client.get("/health").status_code == 200
