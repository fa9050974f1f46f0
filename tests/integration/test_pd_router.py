"""PD disaggregation end to end: prefill and decode servers behind the real sglang-router.

One deployment for the module: two prefill servers (tp=1) and two decode servers (one tp=1, one
tp=2: each of its ranks pulls half of the KV heads) on the tcp backend over 127.0.0.1, behind
three routers in --pd-disaggregation mode (cache_aware, round_robin, power_of_two), plus a
unified server as the oracle.

- Greedy outputs through every router equal the unified server's token for token, streaming and
  not, with logprobs (the router merges the prefill's input logprobs into the decode's answer),
  on /generate and the OpenAI routes.
- The decode servers computed no prompt token (all arrived by transfer); every server ends at its
  empty-pool baseline with no transfer state left (and --strict-memory-check would have killed a
  server that leaked).
- Last: kill -9 of a prefill server while requests wait for their KV: each gets an error answer,
  the decode servers stay healthy and idle, and a prefill back at the same address serves again.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import psutil
import pytest

from conftest import ServerProcess, start_server_process
from engine.utils.network_utils import get_free_port
from utils_http import TIMEOUT, post, same_generation, server_state, stream_events, wait_idle
from utils_process import running, wait_until
from utils_router import (PrefillEndpoint, RouterProcess, decode_server_args, needs_router, prefill_server_args,
                          start_pd_router)
pytestmark = [needs_router, pytest.mark.slow]  # servers and a router: the full suite runs it

POLICIES = ("cache_aware", "round_robin", "power_of_two")
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
WORKER_ARGS = ["--enable-metrics"]
# Fast heartbeats, so a dead prefill is noticed within about a second.
DECODE_ARGS = ["--disaggregation-heartbeat-interval", "0.5", "--disaggregation-heartbeat-max-failures", "2"]
ROUTER_ARGS = ["--health-check-interval-secs", "1", "--disable-retries", "--disable-circuit-breaker"]
# The PD planes authenticated with a shared secret (from the environment, off the command line):
# the router talks HTTP to the servers only, so it needs nothing (docs/security.md).
PD_ENV = {"ENGINE_DISAGGREGATION_SECRET": "pd-router-test-secret"}


@dataclass
class PDCluster:
    unified: ServerProcess
    prefills: List[ServerProcess]
    bootstrap_ports: List[int]
    decodes: List[ServerProcess]
    routers: Dict[str, str] = field(default_factory=dict)
    router_procs: List[RouterProcess] = field(default_factory=list)

    def servers(self) -> List[ServerProcess]:
        return [self.unified, *self.prefills, *self.decodes]

    def start_router(self, prefills: List[Tuple[str, int]], policy: str) -> str:
        endpoints = [PrefillEndpoint(url, port) for url, port in prefills]
        router = start_pd_router(endpoints, [d.url for d in self.decodes], policy, ROUTER_ARGS)
        self.router_procs.append(router)
        return router.url


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    servers: List[ServerProcess] = []
    result = None
    try:
        ports = [get_free_port() for _ in range(2)]
        prefills = [start_server_process(WORKER_ARGS + prefill_server_args(p), wait=False, env=PD_ENV)
                    for p in ports]
        decodes = [start_server_process(WORKER_ARGS + decode_server_args() + DECODE_ARGS, wait=False, env=PD_ENV),
                   start_server_process(WORKER_ARGS + decode_server_args() + DECODE_ARGS + ["--tp-size", "2"],
                                        wait=False, env={**PD_ENV, "ENGINE_CHECK_TP_SAMPLING": "1"})]  # ranks agree
        unified = start_server_process(WORKER_ARGS, wait=False)
        servers = [unified, *prefills, *decodes]
        for server in servers:
            server.wait_healthy()
        result = PDCluster(unified, prefills, ports, decodes)
        for policy in POLICIES:
            result.routers[policy] = result.start_router(list(zip([p.url for p in prefills], ports)), policy)
        yield result
    finally:
        if result is not None:
            for router in result.router_procs:
                router.stop()
            servers = result.servers()
        for server in servers:
            server.stop()


PROMPTS = ["The capital of France is", "Disaggregated serving splits prefill from decode because",
           "1 2 3 4 5 6 7 8 9 10 11 12"]


# ---------------------------------------------------------------------------- equal to unified
@pytest.mark.parametrize("policy", POLICIES)
def test_generate_through_pd_router_equals_unified(cluster: PDCluster, policy: str) -> None:
    for prompt in PROMPTS:
        body = {"text": prompt, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0,
                "top_logprobs_num": 2, "return_text_in_logprobs": True}
        routed = post(cluster.routers[policy], "/generate", body)
        direct = post(cluster.unified.url, "/generate", body)
        assert routed.status_code == 200, routed.text
        assert direct.status_code == 200, direct.text
        routed, direct = routed.json(), direct.json()
        # Output logprobs come from the decode server (the first one travelled in the metadata
        # row); input logprobs from the prefill server, merged by the router.
        same_generation(routed, direct)
        assert len(routed["meta_info"]["input_token_logprobs"]) == routed["meta_info"]["prompt_tokens"]
        top = [[t[1] for t in pos] for pos in routed["meta_info"]["output_top_logprobs"]]
        assert top == [[t[1] for t in pos] for pos in direct["meta_info"]["output_top_logprobs"]]


def test_streaming_through_pd_router_equals_unified(cluster: PDCluster) -> None:
    body = {"text": PROMPTS[1], "stream": True, "return_logprob": True,
            "sampling_params": {**GREEDY, "max_new_tokens": 8}}
    routed = stream_events(cluster.routers["round_robin"], "/generate", body)
    direct = stream_events(cluster.unified.url, "/generate", body)
    # The router merges the prefill's input logprobs only into non-streamed answers (it reads the
    # prefill's body as one JSON object); streamed, they come from the decode server: none.
    assert routed[-1]["meta_info"]["input_token_logprobs"] == []
    for event in (routed[-1], direct[-1]):
        del event["meta_info"]["input_token_logprobs"]
    same_generation(routed[-1], direct[-1])
    assert len(routed[0]["output_ids"]) >= 1  # the first event already carries the prefill's token
    texts = [event["text"] for event in routed]
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))
    plain = post(cluster.routers["round_robin"], "/generate", {**body, "stream": False}).json()
    assert plain["output_ids"] == routed[-1]["output_ids"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 6,
                              "temperature": 0}),
], ids=["completions", "chat"])
def test_openai_routes_through_pd_router_equal_unified(cluster: PDCluster, path: str, body: Dict[str, Any]) -> None:
    body = {**body, "model": "engine-builtin"}
    routed = post(cluster.routers["cache_aware"], path, body)
    direct = post(cluster.unified.url, path, body)
    assert routed.status_code == 200, routed.text
    key = "text" if path == "/v1/completions" else "message"
    assert routed.json()["choices"][0][key] == direct.json()["choices"][0][key]
    # cached_tokens depends on what earlier requests left in each server's radix cache (the router
    # spreads them over two prefill servers); the token counts do not.
    usage = [{k: v for k, v in r.json()["usage"].items() if k != "prompt_tokens_details"} for r in (routed, direct)]
    assert usage[0] == usage[1]
    streamed = stream_events(cluster.routers["round_robin"], path, {**body, "stream": True})
    text = "".join((c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "")
                   for c in streamed if c.get("choices"))
    expected = direct.json()["choices"][0]
    assert text == (expected["text"] if key == "text" else expected["message"]["content"])


def test_a_pd_server_needs_the_bootstrap_fields(cluster: PDCluster) -> None:
    missing = post(cluster.decodes[0].url, "/generate", {"text": "no room", "sampling_params": GREEDY})
    assert missing.status_code == 400 and "bootstrap_room" in missing.json()["message"]
    zero = post(cluster.decodes[0].url, "/generate", {"text": "room zero", "sampling_params": GREEDY,
                                                     "bootstrap_host": "127.0.0.1", "bootstrap_port": 1,
                                                     "bootstrap_room": 0})
    assert zero.status_code == 400 and "[1, 2^63)" in zero.json()["message"]
    # Health probes of a PD server go through the fake transfer: no peer is needed.
    for server in cluster.prefills + cluster.decodes:
        assert httpx.get(f"{server.url}/health_generate", timeout=60).status_code == 200


def _rank_states(url: str) -> List[Dict[str, Any]]:
    states = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]
    return [r for s in states for r in s.get("tp_rank_states", [s])]


def test_decode_servers_computed_no_prompt_and_every_server_is_idle(cluster: PDCluster) -> None:
    for server in cluster.servers():
        wait_idle(server.url)
    for decode in cluster.decodes:
        ranks = _rank_states(decode.url)
        for rank in ranks:  # both ranks of the tp=2 decode server too
            pd = rank["disaggregation"]
            assert rank["num_extend_tokens_computed"] == 0  # no prefill on a decode server, ever
            assert (pd["num_decode_prealloc_queue_reqs"], pd["num_decode_transfer_queue_reqs"],
                    pd["num_decode_retracted_queue_reqs"], pd["num_decode_waiting_reqs"]) == (0, 0, 0, 0)
            assert pd["metrics"]["num_transfer_failed_reqs"] == 0
            assert pd["metrics"]["num_transferred_prompt_tokens"] > 0
            assert rank["available_tokens"] == rank["max_total_num_tokens"]
        metrics = httpx.get(f"{decode.url}/metrics", timeout=30).text
        assert "sglang:num_transferred_prompt_tokens_total" in metrics
        assert "sglang:kv_transfer_latency_ms_bucket" in metrics
    assert len(_rank_states(cluster.decodes[1].url)) == 2
    for prefill in cluster.prefills:
        state = server_state(prefill.url)
        assert state["num_extend_tokens_computed"] > 0
        pd = state["disaggregation"]
        assert (pd["num_prefill_prealloc_queue_reqs"], pd["num_prefill_inflight_queue_reqs"]) == (0, 0)


# ---------------------------------------------------------------------------- prefill death (last)
def _kill_tree(server: ServerProcess) -> None:
    """SIGKILL to the server and every process it started, as when its machine dies."""
    procs = [psutil.Process(server.pid)] + server.descendants()
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    server.proc.wait(timeout=30)
    assert wait_until(lambda: not any(running(p) for p in procs), 30)


def _stream_status(url: str, body: dict) -> Tuple[int, str]:
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=TIMEOUT) as response:
        return response.status_code, response.read().decode(errors="replace")


def test_kill_prefill_mid_transfer_then_serve_again(cluster: PDCluster) -> None:
    victim, port = cluster.prefills[1], cluster.bootstrap_ports[1]
    router = cluster.start_router([(victim.url, port)], "round_robin")  # every request to the victim
    scheduler = victim.find_child("scheduler")
    os.kill(scheduler.pid, signal.SIGSTOP)  # frozen: the requests wait for KV that never comes
    body = {"sampling_params": {**GREEDY, "max_new_tokens": 4}}
    prompts = [f"request {i} waits for a prefill that dies" for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        streamed = [pool.submit(_stream_status, router, {**body, "text": p, "stream": True}) for p in prompts[:3]]
        plain = pool.submit(post, router, "/generate", {**body, "text": prompts[3]})

        def all_waiting_for_kv() -> bool:
            return sum(s["disaggregation"]["num_decode_transfer_queue_reqs"]
                       for d in cluster.decodes for s in [server_state(d.url)]) == len(prompts)

        assert wait_until(all_waiting_for_kv, 60, interval=0.1)
        _kill_tree(victim)
        results = [f.result(timeout=60) for f in streamed]
        answer = plain.result(timeout=60)
    # Every request got a terminal error: none hung, none finished without its prefill.
    for status, text in results:
        assert status == 500, text
        assert "prefill server" in text and "heartbeat" in text
    assert answer.status_code == 500, answer.text
    # The decode servers are healthy and lost nothing.
    failed = 0
    for decode in cluster.decodes:
        assert httpx.get(f"{decode.url}/health", timeout=30).status_code == 200
        assert httpx.get(f"{decode.url}/health_generate", timeout=60).status_code == 200
        failed += wait_idle(decode.url)["disaggregation"]["metrics"]["kv_transfer_failed_reqs_by_cause"].get(
            "peer_dead", 0)
    assert failed == len(prompts)

    # A prefill server comes back at the same address.
    cluster.prefills[1] = start_server_process(WORKER_ARGS + prefill_server_args(port),
                                               port=int(victim.url.rsplit(":", 1)[1]), env=PD_ENV)

    def router_serves() -> bool:
        return post(router, "/generate", {**body, "text": "after the restart"}).status_code == 200

    assert wait_until(router_serves, 120, interval=0.5)
    again = post(router, "/generate", {**body, "text": prompts[0]})
    assert again.status_code == 200, again.text
    expected = post(cluster.unified.url, "/generate", {**body, "text": prompts[0]}).json()
    assert again.json()["output_ids"] == expected["output_ids"]
    for server in cluster.servers():
        wait_idle(server.url)
