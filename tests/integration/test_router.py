"""Two engine servers behind the real SGLang router (`sglang-router`, a Rust binary) on loopback.

Every route the router forwards answers through it as it does directly (greedy, token for token);
what the router reads from a worker (/server_info, /model_info, /get_load, /health) has the shape
it parses; a storm of client disconnects through the router leaves both workers idle with no KV
leaked and no request decoded to its end; kill -9 of one worker under load leaves the router
serving from the other. The module shares one router and two workers; the kill test runs last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx
import pytest

from conftest import ServerProcess, start_server_process
from utils_http import TIMEOUT, post, same_generation, server_state, sse_payloads, stream_events, wait_idle
from utils_process import running, wait_until
from utils_router import RouterProcess, needs_router, router_workers, start_router

pytestmark = [needs_router, pytest.mark.slow]  # servers and a router: the full suite runs it

MODEL = "engine-builtin"
WORKER_ARGS = ["--enable-metrics"]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
KILL_TOKENS = 16  # per request of the kill test
LONG = {"max_new_tokens": 1900, "ignore_eos": True}  # far longer than any test waits for
# Fast health checks, so that a killed worker is taken out within seconds.
ROUTER_ARGS = ["--health-check-interval-secs", "1", "--health-failure-threshold", "2",
               "--health-check-timeout-secs", "5"]


@dataclass
class Cluster:
    router_url: str
    workers: List[ServerProcess]

    @property
    def worker_urls(self) -> List[str]:
        return [w.url for w in self.workers]


def _router_workers(url: str) -> List[Dict[str, Any]]:
    return router_workers(url)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    workers: List[ServerProcess] = []
    router: Optional[RouterProcess] = None
    try:
        # Every forward takes at least 5 ms (a testing aid), so an abandoned LONG request cannot
        # decode to its end before the disconnect reaches the worker, however fast the machine.
        workers = [start_server_process(WORKER_ARGS, wait=False, env={"ENGINE_TEST_FORWARD_SLEEP_S": "0.005"})
                   for _ in range(2)]
        for worker in workers:
            worker.wait_healthy()
        router = start_router([w.url for w in workers], "cache_aware", ROUTER_ARGS)
        yield Cluster(router.url, workers)
    finally:
        if router is not None:
            router.stop()
        for worker in workers:
            worker.stop()


# ---------------------------------------------------------------------------- native /generate
NATIVE_BODIES = [
    {"text": "The capital of France is", "sampling_params": GREEDY},
    {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY},
    {"input_ids": [[5, 6, 7], [9, 10]], "sampling_params": GREEDY},
    {"text": "Hello there", "sampling_params": {**GREEDY, "n": 2}},
    {"text": "Logprobs please", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
     "return_text_in_logprobs": True, "sampling_params": GREEDY},
    {"text": "With a rid", "rid": "router-rid-1", "sampling_params": GREEDY},
]


@pytest.mark.parametrize("body", NATIVE_BODIES, ids=["text", "ids", "ids-batch", "n2", "logprobs", "rid"])
def test_generate_through_router_equals_direct(cluster: Cluster, body: Dict[str, Any]) -> None:
    routed = post(cluster.router_url, "/generate", body)
    direct = post(cluster.worker_urls[0], "/generate", body)
    assert routed.status_code == 200, routed.text
    assert direct.status_code == 200, direct.text
    routed_outs, direct_outs = routed.json(), direct.json()
    if isinstance(direct_outs, dict):
        routed_outs, direct_outs = [routed_outs], [direct_outs]
    assert len(routed_outs) == len(direct_outs)
    for a, b in zip(routed_outs, direct_outs):
        same_generation(a, b)
    if "rid" in body:
        assert routed_outs[0]["meta_info"]["id"] == body["rid"]


def test_generate_stream_through_router_equals_direct(cluster: Cluster) -> None:
    body = {"text": "Streaming through", "stream": True, "return_logprob": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    routed = stream_events(cluster.router_url, "/generate", body)
    direct = stream_events(cluster.worker_urls[1], "/generate", body)
    same_generation(routed[-1], direct[-1])
    # Cumulative text, as SGLang streams it: every event extends the one before.
    texts = [event["text"] for event in routed]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    assert routed[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_router_refuses_a_batch_of_texts(cluster: Cluster) -> None:
    """The router's request type has `text: string`: a list of texts never reaches a worker."""
    body = {"text": ["one", "two"], "sampling_params": GREEDY}
    assert post(cluster.router_url, "/generate", body).status_code == 422
    direct = post(cluster.worker_urls[0], "/generate", body)
    assert direct.status_code == 200 and len(direct.json()) == 2


def test_sglang_fields_pass_when_unset_and_are_refused_when_used(cluster: Cluster) -> None:
    unset = {"text": "Fields", "sampling_params": {**GREEDY, "regex": None, "json_schema": None},
             "model": MODEL, "image_data": None, "lora_path": None, "return_hidden_states": False,
             "log_metrics": True, "no_logs": False, "session_params": None, "priority": None}
    routed = post(cluster.router_url, "/generate", unset)
    direct = post(cluster.worker_urls[0], "/generate", unset)
    assert routed.status_code == 200 and direct.status_code == 200, (routed.text, direct.text)
    same_generation(routed.json(), direct.json())
    for url in (cluster.router_url, cluster.worker_urls[0]):
        refused = post(url, "/generate", {"text": "x", "lora_path": "my-adapter"})
        assert refused.status_code == 400
        assert "lora_path" in refused.json()["message"]


# ---------------------------------------------------------------------------- OpenAI routes
def _choices(outputs: Dict[str, Any]) -> List[Tuple[int, str, Optional[str]]]:
    key = "message" if outputs["object"] == "chat.completion" else None
    return [(c["index"], c[key]["content"] if key else c["text"], c["finish_reason"]) for c in outputs["choices"]]


def _usage(usage: Dict[str, Any]) -> Tuple[int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Once upon a time", "n": 2, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "logprobs": True,
                              "top_logprobs": 2}),
], ids=["completions", "chat"])
def test_openai_through_router_equals_direct(cluster: Cluster, path: str, body: Dict[str, Any]) -> None:
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0, "ignore_eos": True, **body}
    routed, direct = post(cluster.router_url, path, body), post(cluster.worker_urls[1], path, body)
    assert routed.status_code == 200 and direct.status_code == 200, (routed.text, direct.text)
    assert _choices(routed.json()) == _choices(direct.json())
    assert _usage(routed.json()["usage"]) == _usage(direct.json()["usage"])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Streams of", "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Stream it"}], "n": 2}),
], ids=["completions", "chat"])
def test_openai_stream_through_router_equals_direct(cluster: Cluster, path: str, body: Dict[str, Any]) -> None:
    body = {"model": MODEL, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **body}

    def assemble(chunks: List[Dict[str, Any]]) -> Tuple[Dict[int, str], Dict[int, str], Tuple[int, int]]:
        texts: Dict[int, str] = {}
        reasons: Dict[int, str] = {}
        for chunk in chunks[:-1]:
            for choice in chunk["choices"]:
                delta = choice["delta"].get("content") if "delta" in choice else choice["text"]
                texts[choice["index"]] = texts.get(choice["index"], "") + (delta or "")
                if choice["finish_reason"] is not None:
                    reasons[choice["index"]] = choice["finish_reason"]
        assert chunks[-1]["choices"] == []  # the include_usage chunk comes last
        return texts, reasons, _usage(chunks[-1]["usage"])

    routed = assemble(stream_events(cluster.router_url, path, body))
    assert routed == assemble(stream_events(cluster.worker_urls[0], path, body))
    assert set(routed[0]) == {0, 1} and routed[1] == {0: "length", 1: "length"}


def test_models_through_router(cluster: Cluster) -> None:
    routed = httpx.get(f"{cluster.router_url}/v1/models", timeout=30)
    assert routed.status_code == 200
    assert [m["id"] for m in routed.json()["data"]] == [MODEL]


# ---------------------------------------------------------------------------- control routes
def test_info_routes_and_what_the_router_reads(cluster: Cluster) -> None:
    for path in ("/get_model_info", "/health"):
        routed = httpx.get(f"{cluster.router_url}{path}", timeout=30)
        direct = httpx.get(f"{cluster.worker_urls[0]}{path}", timeout=30)
        assert routed.status_code == direct.status_code == 200
        if path == "/get_model_info":
            assert routed.json() == direct.json()
    # The router answers these itself, from the workers it has registered.
    assert httpx.get(f"{cluster.router_url}/health_generate", timeout=30).status_code == 200
    assert httpx.get(f"{cluster.router_url}/get_server_info", timeout=30).status_code == 200
    # Registration read /server_info and /model_info: model id and labels come from our answers.
    info = httpx.get(f"{cluster.worker_urls[0]}/model_info", timeout=30).json()
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    for worker in _router_workers(cluster.router_url):
        assert worker["model_id"] == MODEL and worker["is_healthy"]
        assert worker["metadata"]["served_model_name"] == MODEL
        assert worker["metadata"]["model_path"] == info["model_path"]


def test_flush_cache_through_router_reaches_both_workers(cluster: Cluster) -> None:
    for url in cluster.worker_urls:  # something cached on each
        assert post(url, "/generate", {"text": "fill the cache", "sampling_params": GREEDY}).status_code == 200
    assert all(server_state(url)["evictable_tokens"] > 0 for url in cluster.worker_urls)
    response = httpx.post(f"{cluster.router_url}/flush_cache", timeout=60)
    assert response.status_code == 200, response.text
    assert all(server_state(url)["evictable_tokens"] == 0 for url in cluster.worker_urls)


def test_engine_metrics_through_router(cluster: Cluster) -> None:
    for url in cluster.worker_urls:  # a finished request on each, so that its counters exist
        assert post(url, "/generate", {"text": "count me", "sampling_params": GREEDY}).status_code == 200
    response = httpx.get(f"{cluster.router_url}/engine_metrics", timeout=30)
    assert response.status_code == 200, response.text
    # The router merges the workers' /metrics, one `worker_addr` label per worker (and spells the
    # metric names with `_` where ours have `sglang:`).
    totals = {}
    for line in response.text.splitlines():
        if line.startswith(("sglang:num_requests_total{", "sglang_num_requests_total{")):
            labels, value = line.rsplit(" ", 1)
            totals[labels.split('worker_addr="', 1)[1].split('"', 1)[0]] = float(value)
    assert set(totals) == set(cluster.worker_urls) and all(v >= 1 for v in totals.values()), totals


def test_abort_and_load_while_a_stream_runs_through_the_router(cluster: Cluster) -> None:
    """/abort_request goes to the workers (the router does not forward it); /get_load shows the load."""
    assert httpx.post(f"{cluster.router_url}/abort_request", json={"rid": "x"}, timeout=30).status_code == 404
    body = {"text": "Abort me later", "rid": "router-abort-me", "stream": True, "sampling_params": LONG}
    with httpx.stream("POST", f"{cluster.router_url}/generate", json=body, timeout=TIMEOUT) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        loads = {url: httpx.get(f"{url}/get_load", timeout=30).json() for url in cluster.worker_urls}
        busy = [url for url, load in loads.items() if load[0]["num_reqs"] == 1]
        assert len(busy) == 1, loads
        assert set(loads[busy[0]][0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
        assert loads[busy[0]][0]["num_tokens"] > 0
        # The router's own view of the loads, fetched from our /get_load (power_of_two uses it).
        routed = httpx.get(f"{cluster.router_url}/get_loads", timeout=30).json()["workers"]
        by_url = {entry["worker"]: entry["load"] for entry in routed}
        assert by_url[busy[0]] > 0 and all(by_url[u] == 0 for u in cluster.worker_urls if u != busy[0])
        for url in cluster.worker_urls:
            aborted = httpx.post(f"{url}/abort_request", json={"rid": "router-abort-me"}, timeout=30)
            assert aborted.status_code == 200
        rest = sse_payloads(list(lines))
    # A client abort ends the stream as in SGLang: its partial output with finish_reason abort.
    assert rest[-1] == "[DONE]"
    assert json.loads(rest[-2])["meta_info"]["finish_reason"]["type"] == "abort", rest[-2]


# ---------------------------------------------------------------------------- disconnects
async def _disconnect_storm(router_url: str, worker_urls: List[str], streams: int, plain: int) -> None:
    """Non-streaming requests that are abandoned while they decode, and streams left after one event."""
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        async def stream_then_leave(i: int) -> None:
            body = {"text": f"storm stream {i}", "stream": True, "sampling_params": LONG}
            async with client.stream("POST", f"{router_url}/generate", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        return  # one event seen: the request runs; now hang up

        async def wait_forever(i: int) -> None:
            await client.post(f"{router_url}/generate", json={"text": f"storm plain {i}", "sampling_params": LONG})

        def plain_running() -> bool:  # every non-streaming request has reached a worker
            return sum(server_state(u)["num_running_reqs"] + server_state(u)["num_waiting_reqs"] for u in worker_urls) >= plain

        plain_tasks = [asyncio.create_task(wait_forever(i)) for i in range(plain)]
        assert await asyncio.to_thread(wait_until, plain_running, 60, 0.2)
        await asyncio.gather(*(stream_then_leave(i) for i in range(streams)))
        for task in plain_tasks:
            task.cancel()  # closes their connections to the router
        await asyncio.gather(*plain_tasks, return_exceptions=True)


def test_disconnect_storm_leaves_both_workers_idle(cluster: Cluster) -> None:
    before = {url: server_state(url)["forward_ct"] for url in cluster.worker_urls}
    asyncio.run(_disconnect_storm(cluster.router_url, cluster.worker_urls, streams=3, plain=3))
    for url in cluster.worker_urls:
        after = wait_idle(url)
        # A request that was not aborted would have needed max_new_tokens decode steps.
        assert after["forward_ct"] - before[url] < LONG["max_new_tokens"], (before[url], after)
    # The router's own in-flight counters are back to zero too.
    assert wait_until(lambda: all(w["load"] == 0 for w in _router_workers(cluster.router_url)), 30, 0.2)


# ---------------------------------------------------------------------------- a worker dies
async def _requests_under_kill(cluster: Cluster, prompts: List[str]) -> Tuple[List[Any], ServerProcess, list]:
    """Send `prompts` through the router and kill -9 a worker that is decoding some of them.

    Returns the outcomes, the killed worker and its child processes (taken before the kill).
    """
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        async def one(i: int, prompt: str) -> Any:
            params = {**GREEDY, "max_new_tokens": KILL_TOKENS}
            body = {"text": prompt, "stream": i % 4 == 0, "sampling_params": params}
            try:
                if not body["stream"]:
                    response = await client.post(f"{cluster.router_url}/generate", json=body)
                    return response.status_code, response.json()["text"] if response.status_code == 200 else None
                async with client.stream("POST", f"{cluster.router_url}/generate", json=body) as response:
                    payloads = sse_payloads([line async for line in response.aiter_lines()])
                return response.status_code, payloads
            except httpx.TransportError as exc:  # the stream was cut: a clean failure
                return "cut", repr(exc)

        tasks = [asyncio.create_task(one(i, p)) for i, p in enumerate(prompts)]
        running_reqs: Dict[str, int] = {}

        def some_worker_decodes() -> bool:
            running_reqs.update({w.url: server_state(w.url)["num_running_reqs"] for w in cluster.workers})
            return any(running_reqs.values())

        # cache_aware sends prompts with a shared prefix to one worker: kill that one.
        assert await asyncio.to_thread(wait_until, some_worker_decodes, 60, 0.05)
        victim = max(cluster.workers, key=lambda w: running_reqs[w.url])
        children = victim.descendants()
        os.kill(victim.pid, signal.SIGKILL)
        return list(await asyncio.gather(*tasks)), victim, children


def test_kill_one_worker_under_load_router_serves_from_the_other(cluster: Cluster) -> None:
    prompts = [f"Under load, request {i} says" for i in range(8)]
    batch = {"text": prompts, "sampling_params": {**GREEDY, "max_new_tokens": KILL_TOKENS}}
    expected = post(cluster.worker_urls[0], "/generate", batch)
    assert expected.status_code == 200
    expected_texts = [out["text"] for out in expected.json()]
    children: list = []
    try:
        results, victim, children = asyncio.run(_requests_under_kill(cluster, prompts))
        _check_results_under_kill(results, prompts, expected_texts)

        # The router's health checks take the dead worker out; the survivor serves everything.
        def victim_out() -> bool:
            return all(not w["is_healthy"] for w in _router_workers(cluster.router_url) if w["url"] == victim.url)

        assert wait_until(victim_out, 30, interval=0.25), _router_workers(cluster.router_url)
        for prompt, text in zip(prompts[:2], expected_texts):
            body = {"text": prompt, "sampling_params": {**GREEDY, "max_new_tokens": KILL_TOKENS}}
            response = post(cluster.router_url, "/generate", body)
            assert response.status_code == 200 and response.json()["text"] == text
        # The killed server's children follow it (no orphans left behind).
        assert wait_until(lambda: not any(running(c) for c in children), 15)
    finally:
        for child in children:
            if running(child):
                child.kill()


def _check_results_under_kill(results: List[Any], prompts: List[str], expected_texts: List[str]) -> None:
    """Each request either got the right answer (from its worker, or retried on the other) or
    failed visibly: an error status, a cut connection, or a stream that ends without its finish
    event and `[DONE]`. None hangs (the client would time out) and none looks complete but is not."""
    for (status, payload), prompt, text in zip(results, prompts, expected_texts):
        if status == "cut":
            continue
        if status != 200:
            assert status >= 500, (status, payload)
        elif isinstance(payload, str):
            assert payload == text, prompt
        elif payload and payload[-1] == "[DONE]":
            assert json.loads(payload[-2])["text"] == text, prompt
        elif payload:
            last = json.loads(payload[-1])
            assert last["meta_info"]["finish_reason"] is None and text.startswith(last["text"]), prompt
