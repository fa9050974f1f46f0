"""PD disaggregation end to end: prefill and decode servers behind the real sglang-router.

Two prefill servers and two decode servers (tcp backend on 127.0.0.1) behind three routers in
--pd-disaggregation mode, one per policy (cache_aware, round_robin, power_of_two), and one unified
server as the oracle. Greedy outputs through every router equal the unified server's token for
token (streaming and not, with logprobs; the router merges the prefill's input logprobs into the
decode's answer); the decode servers computed no prompt token (they all arrived by transfer); and
every server is back at its empty-pool baseline with no transfer state left.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List

import httpx
import pytest

from conftest import ServerProcess, start_server_process
from utils_http import post, same_generation, server_state, stream_events, wait_idle
from utils_pd import needs_router, pd_cluster
from engine.utils.network_utils import get_free_port

pytestmark = needs_router

POLICIES = ("cache_aware", "round_robin", "power_of_two")
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
WORKER_ARGS = ["--enable-metrics"]
ROUTER_ARGS = ["--health-check-interval-secs", "1", "--disable-retries"]


@dataclass
class PDCluster:
    unified: ServerProcess
    prefills: List[ServerProcess]
    decodes: List[ServerProcess]
    routers: Dict[str, str] = field(default_factory=dict)

    def servers(self) -> List[ServerProcess]:
        return [self.unified, *self.prefills, *self.decodes]


@pytest.fixture(scope="module")
def cluster() -> Iterator[PDCluster]:
    servers: List[ServerProcess] = []
    routers = []
    with tempfile.TemporaryFile() as router_log:
        try:
            ports = [get_free_port() for _ in range(2)]
            prefills = [start_server_process(WORKER_ARGS + pd_cluster.prefill_server_args(p), wait=False)
                        for p in ports]
            decodes = [start_server_process(WORKER_ARGS + pd_cluster.decode_server_args(), wait=False)
                       for _ in range(2)]
            unified = start_server_process(WORKER_ARGS, wait=False)
            servers = [unified, *prefills, *decodes]
            for server in servers:
                server.wait_healthy()
            result = PDCluster(unified, prefills, decodes)
            endpoints = [pd_cluster.PrefillEndpoint(s.url, p) for s, p in zip(prefills, ports)]
            for policy in POLICIES:
                proc, url = pd_cluster.start_pd_router(endpoints, [d.url for d in decodes], policy, router_log,
                                                       ROUTER_ARGS)
                routers.append(proc)
                result.routers[policy] = url
            for proc, url in zip(routers, result.routers.values()):
                try:
                    pd_cluster.wait_router_ready(proc, url, num_workers=4)
                except (RuntimeError, TimeoutError):
                    router_log.seek(0)
                    raise RuntimeError(router_log.read().decode(errors="replace")[-4000:]) from None
            yield result
        finally:
            for proc in routers:
                pd_cluster.stop_process(proc)
            for server in servers:
                server.stop()


PROMPTS = ["The capital of France is", "Disaggregated serving splits prefill from decode because",
           "1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.mark.parametrize("policy", POLICIES)
def test_generate_through_pd_router_equals_unified(cluster: PDCluster, policy: str) -> None:
    for i, prompt in enumerate(PROMPTS):
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
    assert routed.json()["usage"] == direct.json()["usage"]
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


def test_decode_servers_computed_no_prompt_and_every_server_is_idle(cluster: PDCluster) -> None:
    """Runs last in the module: what the requests above left behind."""
    transferred = 0
    for server in cluster.servers():
        wait_idle(server.url)
    for decode in cluster.decodes:
        state = server_state(decode.url)
        pd = state["disaggregation"]
        assert state["num_extend_tokens_computed"] == 0  # no prefill on a decode server, ever
        assert (pd["num_decode_prealloc_queue_reqs"], pd["num_decode_transfer_queue_reqs"],
                pd["num_decode_retracted_queue_reqs"], pd["num_decode_waiting_reqs"]) == (0, 0, 0, 0)
        assert pd["metrics"]["num_transfer_failed_reqs"] == 0
        transferred += pd["metrics"]["num_transferred_prompt_tokens"]
        metrics = httpx.get(f"{decode.url}/metrics", timeout=30).text
        assert "sglang:num_transferred_prompt_tokens_total" in metrics
        assert "sglang:kv_transfer_latency_ms_bucket" in metrics
    assert transferred > 0
    assert all(server_state(p.url)["num_extend_tokens_computed"] > 0 for p in cluster.prefills)
    for prefill in cluster.prefills:
        pd = server_state(prefill.url)["disaggregation"]
        assert (pd["num_prefill_prealloc_queue_reqs"], pd["num_prefill_inflight_queue_reqs"]) == (0, 0)
    assert all(s.proc.poll() is None for s in cluster.servers())  # nobody died of a leak (strict check)
