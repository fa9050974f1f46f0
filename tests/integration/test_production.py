"""Production behaviour of a real server: load, auth, limits, metrics, health, faults, shutdown.

The module server runs with --enable-metrics, --api-key and --log-requests; its last test sends
it SIGTERM under load. Fault tests (kill -9 of a child, a stuck forward) start their own servers.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from typing import Any, Dict, List, Optional

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from utils_process import running, wait_until

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

API_KEY = "sekret-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "engine-builtin"
SERVER_ARGS = ["--enable-metrics", "--api-key", API_KEY, "--log-requests", "--log-level", "info"]


# ---------------------------------------------------------------------------- helpers
def internal_state(url: str, headers: Optional[dict] = None) -> dict:
    response = httpx.get(f"{url}/get_server_info", headers=headers or {}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["internal_states"][0]


def wait_idle_and_balanced(url: str, headers: Optional[dict] = None, timeout: float = 30) -> dict:
    """Wait until nothing runs or waits; then every KV slot is free or evictable (no leak)."""
    last: Dict[str, Any] = {}

    def idle() -> bool:
        nonlocal last
        last = internal_state(url, headers)
        return last["num_running_reqs"] == 0 and last["num_waiting_reqs"] == 0

    assert wait_until(idle, timeout, interval=0.2), last
    assert last["available_tokens"] + last["evictable_tokens"] == last["max_total_num_tokens"], last
    assert last["protected_tokens"] == 0, last
    return last


def metric_samples(text: str) -> Dict[str, float]:
    """{name: value} of the samples labelled with our model (histogram buckets left out)."""
    out: Dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") == MODEL and "le" not in sample.labels:
                out[sample.name] = sample.value
    return out


def sse_payloads(raw: str) -> List[Any]:
    """The `data:` payloads of an SSE body, `[DONE]` kept as the string."""
    payloads = []
    for block in raw.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


# ---------------------------------------------------------------------------- auth and limits
def test_auth_on_every_route_but_health(server):
    url = server.url
    spec = httpx.get(f"{url}/openapi.json", headers=AUTH, timeout=30).json()
    routes = [(method.upper(), path.replace("{model_id}", MODEL))
              for path, item in spec["paths"].items() for method in item]
    routes += [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/metrics"), ("GET", "/no-such-route")]
    assert ("POST", "/v1/chat/completions") in routes and ("POST", "/generate") in routes
    with httpx.Client(base_url=url, timeout=30) as client:
        for method, path in routes:
            if path == "/health":
                continue
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                response = client.request(method, path, headers=headers, json={})
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.json()["type"] == "AuthenticationError"
        assert client.get("/health").status_code == 200
        assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", {"prompt": "a", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "a", "stop": [f"s{i}" for i in range(33)]}, "stop"),
    ("/v1/completions", {"prompt": "a", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 1000}, "n"),
    ("/generate", {"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/generate", {"text": "a", "sampling_params": {"n": 1000}}, "n"),
])
def test_limits_are_clear_400s(server, path, body, needle):
    response = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400
    assert needle in error["message"], error["message"]


def test_request_body_over_the_limit_is_413(server):
    body = b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}'
    response = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 413
    assert "larger than the limit" in response.json()["message"]


# ---------------------------------------------------------------------------- load
def test_load_500_streams_openai_client(server):
    """500 streaming requests, 64 at a time, through the official client; zero errors, no leak.

    Health checks during the load answer 200 although the probe waits behind real work.
    """
    from openai import AsyncOpenAI

    num_requests, concurrency = 500, 64

    async def run() -> tuple[List[Optional[str]], List[int]]:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
        limit = asyncio.Semaphore(concurrency)
        health_codes: List[int] = []

        async def one(i: int) -> Optional[str]:
            async with limit:
                finish = None
                text = ""
                if i % 2:
                    stream = await client.completions.create(
                        model=MODEL, prompt=f"Request {i} says", max_tokens=8, stream=True,
                        temperature=0.7, seed=i)
                    async for chunk in stream:
                        text += chunk.choices[0].text
                        finish = chunk.choices[0].finish_reason or finish
                else:
                    stream = await client.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=8,
                        stream=True)
                    async for chunk in stream:
                        text += chunk.choices[0].delta.content or ""
                        finish = chunk.choices[0].finish_reason or finish
                return finish

        async def probe_health(http: httpx.AsyncClient) -> None:
            for _ in range(3):
                health_codes.append((await http.get("/health_generate", headers=AUTH)).status_code)

        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            results = asyncio.gather(*(one(i) for i in range(num_requests)), return_exceptions=True)
            await asyncio.sleep(0)  # the load is submitted before the probes start
            _, finishes = await asyncio.gather(probe_health(http), results)
        await client.close()
        return finishes, health_codes

    finishes, health_codes = asyncio.run(run())
    errors = [f for f in finishes if isinstance(f, BaseException)]
    assert not errors, errors[:3]
    assert all(f in ("stop", "length") for f in finishes), set(map(str, finishes))
    assert health_codes == [200, 200, 200]
    wait_idle_and_balanced(server.url, AUTH)


# ---------------------------------------------------------------------------- metrics and logs
def test_metrics_names_labels_and_values(server):
    http = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
    before = metric_samples(http.get("/metrics").text)
    prompt_tokens = 0
    for text in ("one", "two three", "four five six"):
        body = {"text": text, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}}
        response = http.post("/generate", json=body)
        assert response.status_code == 200, response.text
        prompt_tokens += response.json()["meta_info"]["prompt_tokens"]
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    after = metric_samples(response.text)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert delta("sglang:prompt_tokens_total") == prompt_tokens
    assert delta("sglang:generation_tokens_total") == 15
    assert delta("sglang:num_requests_total") == 3
    assert delta("sglang:time_to_first_token_seconds_count") == 3
    assert delta("sglang:e2e_request_latency_seconds_count") == 3
    assert delta("sglang:e2e_request_latency_seconds_sum") > 0
    assert "sglang:inter_token_latency_seconds_count" in after
    # Gauges from the scheduler at scrape time: nothing runs now.
    assert after["sglang:num_running_reqs"] == 0
    assert after["sglang:num_queue_reqs"] == 0
    assert 0.0 <= after["sglang:token_usage"] <= 1.0
    assert 0.0 <= after["sglang:cache_hit_rate"] <= 1.0
    assert "sglang:gen_throughput" in after  # its values: the next test
    http.close()


def test_gen_throughput_while_decoding_and_when_idle(server):
    """gen_throughput is the decode rate of the last --decode-log-interval (40) decode batches
    while a request decodes, and 0 once the scheduler is idle."""
    body = {"text": "Throughput probe", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}}
    wait_idle_and_balanced(server.url, AUTH)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["meta_info"]["completion_tokens"] >= 60:
                    break  # more than 40 decode batches ran: the rate was measured once
            decoding = metric_samples(http.get("/metrics").text)
        # Leaving the stream aborts the request (far from its 1500 tokens).
        assert decoding["sglang:num_running_reqs"] == 1
        assert decoding["sglang:gen_throughput"] > 0.0
        wait_idle_and_balanced(server.url, AUTH)
        idle: Dict[str, float] = {}

        def throughput_reset() -> bool:
            nonlocal idle
            idle = metric_samples(http.get("/metrics").text)
            return idle["sglang:gen_throughput"] == 0.0

        assert wait_until(throughput_reset, 30), idle


def test_log_requests_and_batch_lines(server):
    """The lines --log-requests and the batch logger write for a request this test sends itself
    (48 decode steps: more than the decode log interval of 40)."""
    rid = "log-lines-probe"
    body = {"text": "log me", "rid": rid, "sampling_params": {"max_new_tokens": 48, "ignore_eos": True}}
    with open(server.log_path, errors="replace") as f:
        start = len(f.read())
    assert httpx.post(f"{server.url}/generate", json=body, headers=AUTH, timeout=60).status_code == 200

    def new_log() -> str:
        with open(server.log_path, errors="replace") as f:
            return f.read()[start:]

    assert wait_until(lambda: f"Finish: rid={rid}" in new_log()), new_log()[-3000:]
    log = new_log()
    assert f"Receive: rid={rid}" in log
    assert "Prefill batch, #new-seq" in log and "Decode batch, #running-req" in log


# ---------------------------------------------------------------------------- disconnects
def test_client_disconnect_mid_stream_leaves_nothing_running(server):
    body = {"model": MODEL, "prompt": "Disconnect me", "max_tokens": 2000, "stream": True,
            "ignore_eos": True}
    chunks = 0
    forwards_before = wait_idle_and_balanced(server.url, AUTH)["forward_ct"]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    chunks += 1
                if chunks >= 10:
                    break
    state = wait_idle_and_balanced(server.url, AUTH, timeout=120)
    # Far fewer forwards than the ~2000 decoding the rest would take: it was aborted.
    assert state["forward_ct"] - forwards_before < 1000, state


# ---------------------------------------------------------------------------- shutdown
def test_sigterm_under_load_ends_streams_and_exits_0(launch_server):
    """SIGTERM while streams run: every stream ends with an error event + [DONE], exit code 0.
    Its own server, so no other test depends on running before it."""
    server = launch_server(SERVER_ARGS)
    descendants = server.descendants()
    assert descendants
    routes = [
        ("/v1/completions", {"model": MODEL, "prompt": "Long story", "max_tokens": 600, "stream": True,
                             "ignore_eos": True}),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Go on"}],
                                  "max_tokens": 600, "stream": True, "ignore_eos": True}),
        ("/generate", {"text": "Long story", "stream": True,
                       "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}),
    ]
    # Few and short enough to all fit the KV pool at once (no stream waits in the queue), long
    # enough to be mid-generation when SIGTERM comes.
    num_streams = 8
    bodies: List[str] = [""] * num_streams
    started = [threading.Event() for _ in range(num_streams)]
    failures: List[BaseException] = []

    def consume(i: int) -> None:
        path, body = routes[i % len(routes)]
        try:
            with httpx.stream("POST", f"{server.url}{path}", json=body, headers=AUTH, timeout=60) as response:
                for text in response.iter_text():
                    bodies[i] += text
                    if "data: " in bodies[i]:
                        started[i].set()
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            failures.append(exc)
        finally:
            started[i].set()

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=30) == 0, server.log()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "a stream hung after SIGTERM"
    assert not failures, failures[:3]
    for raw in bodies:
        payloads = sse_payloads(raw)
        assert payloads[-1] == "[DONE]", raw[-300:]
        final = payloads[-2]
        assert "error" in final, final
        assert final["error"]["code"] == 503 and "shutting down" in final["error"]["message"]
    assert wait_until(lambda: not any(running(p) for p in descendants), 30)


# ---------------------------------------------------------------------------- faults
def poll_health_until_exit(server: Any, timeout: float = 60.0) -> List[Any]:
    """/health answers until the server exits; returns the status codes (or error names) seen."""
    seen: List[Any] = []
    deadline = time.monotonic() + timeout
    while server.proc.poll() is None and time.monotonic() < deadline:
        try:
            seen.append(httpx.get(f"{server.url}/health", timeout=1.0).status_code)
        except httpx.HTTPError as exc:
            seen.append(type(exc).__name__)
        time.sleep(0.02)
    return seen


def test_queue_limit_and_disconnect_before_first_token_then_kill_scheduler(launch_server):
    server = launch_server(["--max-running-requests", "1", "--max-queued-requests", "1"])
    http = httpx.Client(base_url=server.url, timeout=60)
    long_body = {"text": "Occupy", "sampling_params": {"max_new_tokens": 1900, "ignore_eos": True}}

    # One request runs (the only slot), so the next one waits in the queue with no token yet.
    runner = threading.Thread(target=lambda: httpx.post(f"{server.url}/generate", json=long_body, timeout=120),
                              daemon=True)
    runner.start()
    assert wait_until(lambda: internal_state(server.url)["num_running_reqs"] == 1, 30)
    with pytest.raises(httpx.ReadTimeout):
        # The client gives up before its first token and closes the connection.
        httpx.post(f"{server.url}/generate", json={**long_body, "stream": True}, timeout=httpx.Timeout(60, read=1.0))
    assert wait_until(lambda: internal_state(server.url)["num_waiting_reqs"] == 0, 30)

    # Fill the one queue slot, then every further request is refused with 503, streamed or not.
    queued = threading.Thread(target=lambda: httpx.post(f"{server.url}/generate", json=long_body, timeout=120),
                              daemon=True)
    queued.start()
    assert wait_until(lambda: internal_state(server.url)["num_waiting_reqs"] == 1, 30)
    refused = http.post("/generate", json=long_body)
    assert refused.status_code == 503 and "queue is full" in refused.json()["message"], refused.text
    refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
    assert refused.status_code == 503 and "queue is full" in refused.json()["message"], refused.text
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    wait_idle_and_balanced(server.url)

    scheduler = server.find_child("engine::scheduler_TP0")
    assert scheduler is not None
    others = [c for c in server.descendants() if c.pid != scheduler.pid]
    os.kill(scheduler.pid, signal.SIGKILL)
    # SIGKILL lands asynchronously: poll from the moment the process is really gone.
    assert wait_until(lambda: not running(scheduler), 30, interval=0.001)
    seen = poll_health_until_exit(server)
    assert server.proc.wait(timeout=60) != 0
    assert 200 not in seen, seen
    assert wait_until(lambda: not any(running(c) for c in others), 30)
    http.close()


def test_killed_detokenizer_makes_server_exit_nonzero(launch_server):
    server = launch_server()
    detokenizer = server.find_child("engine::detokenizer")
    assert detokenizer is not None
    others = [c for c in server.descendants() if c.pid != detokenizer.pid]
    os.kill(detokenizer.pid, signal.SIGKILL)
    assert wait_until(lambda: not running(detokenizer), 30, interval=0.001)
    seen = poll_health_until_exit(server)
    assert server.proc.wait(timeout=60) != 0
    assert 200 not in seen, seen
    assert "Child process detokenizer" in server.log()
    assert wait_until(lambda: not any(running(c) for c in others), 30)


def test_stuck_forward_fails_health_generate_with_one_probe_then_watchdog(launch_server, monkeypatch):
    """A forward that takes 60 s: /health_generate gives up after 2 s (five callers, one probe),
    then the 12 s watchdog takes the whole server down with a log line that says so. The margins
    are wide so that a slow or loaded machine cannot reorder the three events."""
    monkeypatch.setenv("ENGINE_TEST_FORWARD_SLEEP_S", "60")
    server = launch_server(["--watchdog-timeout", "12", "--health-check-timeout", "2", "--log-requests",
                            "--log-level", "info"])

    async def probes() -> List[int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            responses = await asyncio.gather(*(client.get("/health_generate") for _ in range(5)))
        return [r.status_code for r in responses]

    codes = asyncio.run(probes())
    assert codes == [503] * 5  # answered before the forward ended (it would have said 200)
    assert server.proc.poll() is None  # still up: unhealthy, not dead yet

    code = server.proc.wait(timeout=60)
    assert code != 0
    with open(server.log_path, errors="replace") as f:
        log = f.read()
    assert "watchdog timeout" in log.lower(), log[-3000:]
    assert log.count("Receive: rid=HEALTH_CHECK") == 1, log[-3000:]
