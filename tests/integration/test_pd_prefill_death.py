"""kill -9 of the prefill server while requests wait for their KV, behind sglang-router.

The prefill's forwards are slowed down (a test aid) so the requests are surely waiting for their
KV on the decode server when the prefill is killed. The decode server's heartbeat notices the dead
prefill; every request in flight gets an error answer (none hangs); the decode server stays
healthy with its whole KV pool free; and once a prefill server is back at the same address, the
router and the decode server serve again.
"""

from __future__ import annotations

import concurrent.futures
import tempfile
from typing import Iterator, List, Tuple

import httpx
import psutil
import pytest

from conftest import ServerProcess, start_server_process
from utils_http import TIMEOUT, post, server_state, wait_idle
from utils_pd import needs_router, pd_cluster
from utils_process import running, wait_until
from engine.utils.network_utils import get_free_port

pytestmark = needs_router

HEARTBEAT = ["--disaggregation-heartbeat-interval", "0.5", "--disaggregation-heartbeat-max-failures", "2"]
ROUTER_ARGS = ["--health-check-interval-secs", "1", "--disable-retries", "--disable-circuit-breaker"]
SLOW_FORWARD = {"ENGINE_TEST_FORWARD_SLEEP_S": "600"}  # a prefill forward that never ends in the test
BODY = {"sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def deployment() -> Iterator[Tuple[List[ServerProcess], ServerProcess, str, int]]:
    """(the prefill servers started so far (the last one is live), the decode server, router URL,
    bootstrap port)."""
    bootstrap_port = get_free_port()
    prefills = [start_server_process(pd_cluster.prefill_server_args(bootstrap_port), wait=False, env=SLOW_FORWARD)]
    decode = start_server_process(pd_cluster.decode_server_args() + HEARTBEAT, wait=False)
    router = None
    with tempfile.TemporaryFile() as log:
        try:
            prefills[0].wait_healthy()
            decode.wait_healthy()
            router, url = pd_cluster.start_pd_router(
                [pd_cluster.PrefillEndpoint(prefills[0].url, bootstrap_port)], [decode.url], "round_robin", log,
                ROUTER_ARGS)
            pd_cluster.wait_router_ready(router, url, num_workers=2)
            yield prefills, decode, url, bootstrap_port
        finally:
            if router is not None:
                pd_cluster.stop_process(router)
            for server in prefills + [decode]:
                server.stop()


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


def test_prefill_death_fails_requests_in_flight_and_decode_serves_again(deployment) -> None:
    prefills, decode, router_url, bootstrap_port = deployment
    prompts = [f"request {i} waits for a prefill that dies" for i in range(3)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts) * 2) as pool:
        streamed = [pool.submit(_stream_status, router_url, {**BODY, "text": p, "stream": True}) for p in prompts[:2]]
        plain = pool.submit(post, router_url, "/generate", {**BODY, "text": prompts[2]})

        def all_waiting_for_kv() -> bool:
            pd = server_state(decode.url)["disaggregation"]
            return pd["num_decode_transfer_queue_reqs"] == len(prompts)

        assert wait_until(all_waiting_for_kv, 60, interval=0.1)
        _kill_tree(prefills[-1])
        results = [f.result(timeout=60) for f in streamed]
        answer = plain.result(timeout=60)
    # Every request got a terminal error, none hung and none succeeded without its prefill.
    for status, body in results:
        assert status == 500, body
        assert "prefill server" in body and "heartbeat" in body
    assert answer.status_code == 500, answer.text
    # The decode server is healthy and lost nothing.
    assert httpx.get(f"{decode.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{decode.url}/health_generate", timeout=60).status_code == 200
    state = wait_idle(decode.url)
    assert state["disaggregation"]["metrics"]["kv_transfer_failed_reqs_by_cause"].get("peer_dead") == len(prompts)
    assert state["disaggregation"]["num_decode_transfer_queue_reqs"] == 0

    # A prefill server comes back at the same address (a normal one this time).
    port = int(prefills[-1].url.rsplit(":", 1)[1])
    prefills.append(start_server_process(pd_cluster.prefill_server_args(bootstrap_port), port=port))

    def router_serves() -> bool:
        return post(router_url, "/generate", {**BODY, "text": "after the restart"}).status_code == 200

    assert wait_until(router_serves, 120, interval=0.5)
    again = post(router_url, "/generate", {**BODY, "text": prompts[0]})
    assert again.status_code == 200, again.text
    assert again.json()["meta_info"]["completion_tokens"] == 4
    wait_idle(decode.url)
    wait_idle(prefills[-1].url)


def _stream_status(url: str, body: dict) -> Tuple[int, str]:
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=TIMEOUT) as response:
        return response.status_code, response.read().decode(errors="replace")
