"""Real servers with tensor and data parallelism on the CPU (gloo), the built-in model.

- tp=2: greedy output equals transformers; aborts and client disconnects leave both ranks idle
  with no leaked KV; kill -9 of rank 1 takes the server down, non-zero, within 10 s.
- dp=2 (shortest_queue): 64 concurrent requests, both replicas take work, outputs equal the
  oracle (which dp=1 is held to as well); flush_cache reaches both replicas; a request naming a
  replica (routed_dp_rank / data_parallel_rank, SGLang's DP-aware gateway) runs there, a bad one is a 400. dp=2 with
  --is-embedding: the vectors of both replicas come back and equal transformers'.
- two "nodes" over loopback: node 0 (HTTP + rank 0) and node 1 (rank 1 only) serve together, and
  stopping node 1 takes node 0 down.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any, Dict, List

import httpx
import pytest

from engine.builtin_model import ensure_builtin_model
from engine.utils.network_utils import get_free_port

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

GREEDY = {"temperature": 0.0}
PROMPTS = ["Hello, my name is", "1 2 3 4", "The capital of France", "Parallel ranks agree"]
STEPS = 6


@pytest.fixture(scope="module")
def oracle(tokenizer):
    """transformers' greedy continuation (float32) of a prompt, by text."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_builtin_model(), torch_dtype=torch.float32).eval()
    cache: Dict[str, List[int]] = {}

    def greedy(prompt: str, steps: int = STEPS) -> List[int]:
        if prompt not in cache:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0)
            cache[prompt] = out[0, ids.shape[1]:].tolist()
        return cache[prompt]

    return greedy


def _generate(url: str, prompt: str, steps: int = STEPS) -> Dict[str, Any]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": steps, "ignore_eos": True, **GREEDY}}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _internal_states(url: str) -> List[Dict[str, Any]]:
    return httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]


def _is_idle(state: Dict[str, Any]) -> bool:
    return (state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0
            and state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"]
            and state["protected_tokens"] == 0)


def _wait_all_ranks_idle(url: str, timeout: float = 30.0) -> List[Dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        states = _internal_states(url)
        ranks = [r for s in states for r in s.get("tp_rank_states", [s])]
        if all(_is_idle(r) for r in ranks):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout} s: {ranks}")
        time.sleep(0.1)


def _wait_exit(server, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while server.proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"server still running {timeout} s after the rank died:\n{server.log()}")
        time.sleep(0.05)
    return server.proc.returncode


def test_tp2_server_outputs_aborts_and_rank_death(launch_server, oracle, monkeypatch) -> None:
    monkeypatch.setenv("ENGINE_CHECK_TP_SAMPLING", "1")  # ranks fail if their sampled ids ever differ
    server = launch_server(["--tp-size", "2"])  # strict memory check: conftest.BASE_ARGS
    url = server.url
    for prompt in PROMPTS:
        assert _generate(url, prompt)["output_ids"] == oracle(prompt), prompt

    # A streaming client that disconnects mid-stream, and a request aborted by rid.
    long_body = {"sampling_params": {"max_new_tokens": 600, "ignore_eos": True, **GREEDY}, "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/generate", json={**long_body, "text": "disconnect me"}) as response:
            assert response.status_code == 200
            for i, _ in enumerate(response.iter_lines()):
                if i >= 3:
                    break  # leaving the block closes the connection
        _wait_all_ranks_idle(url)  # the disconnect aborted the request on both ranks

        async def abort_by_rid() -> httpx.Response:
            async with httpx.AsyncClient(base_url=url, timeout=60) as aclient:
                body = {**long_body, "stream": False, "text": "abort me", "rid": "abort-me-1"}
                task = asyncio.create_task(aclient.post("/generate", json=body))
                deadline = time.monotonic() + 30
                while True:
                    states = (await aclient.get("/get_server_info")).json()["internal_states"]
                    if any(s["num_running_reqs"] + s["num_waiting_reqs"] for s in states):
                        break
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                await aclient.post("/abort_request", json={"rid": "abort-me-1"})
                return await asyncio.wait_for(task, 30)

        aborted = asyncio.run(abort_by_rid())
        # As SGLang: 200 with the partial output and a graceful abort reason.
        assert aborted.status_code == 200, aborted.text
        assert aborted.json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert aborted.json()["meta_info"]["finish_reason"]["status_code"] is None

    states = _wait_all_ranks_idle(url)
    assert len(states) == 1 and [r["tp_rank"] for r in states[0]["tp_rank_states"]] == [0, 1]
    # Both ranks ran the same steps on the same requests.
    assert len({r["forward_ct"] for r in states[0]["tp_rank_states"]}) == 1

    rank1 = server.find_child("scheduler_TP1")
    assert rank1 is not None
    rank1.send_signal(signal.SIGKILL)
    assert _wait_exit(server, 10.0) != 0
    assert "scheduler_TP1" in server.log()


def test_dp2_server_spreads_64_requests(launch_server, oracle) -> None:
    server = launch_server(["--dp-size", "2", "--load-balance-method", "shortest_queue"])
    # 8 distinct prompts (the oracle is slow), each sent 8 times, so the radix cache is shared too.
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i % 8}" for i in range(64)]

    async def run() -> List[Dict[str, Any]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=300.0, limits=limits) as client:
            async def one(prompt: str) -> Dict[str, Any]:
                body = {"text": prompt, "sampling_params": {"max_new_tokens": STEPS, "ignore_eos": True, **GREEDY}}
                response = await client.post("/generate", json=body)
                assert response.status_code == 200, response.text
                return response.json()

            return await asyncio.gather(*(one(p) for p in prompts))

    outputs = asyncio.run(run())
    for prompt, out in zip(prompts, outputs):
        assert out["output_ids"] == oracle(prompt), prompt
    states = _wait_all_ranks_idle(server.url)
    assert sorted(s["dp_rank"] for s in states) == [0, 1]
    assert all(s["forward_ct"] > 0 for s in states), states  # both replicas took work
    flushed = httpx.post(f"{server.url}/flush_cache", timeout=30)
    assert flushed.status_code == 200
    assert all(s["evictable_tokens"] == 0 for s in _internal_states(server.url))

    # DP-aware routing (SGLang's gateway names the replica): the named rank alone caches the prompt.
    def cached_by_rank() -> Dict[int, int]:
        return {s["dp_rank"]: s["evictable_tokens"] for s in _wait_all_ranks_idle(server.url)}

    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 2, **GREEDY}, "routed_dp_rank": 1}
    for _ in range(2):
        assert httpx.post(f"{server.url}/generate", json=body, timeout=120).status_code == 200
    cached = cached_by_rank()
    assert cached[1] > 0 and cached[0] == 0, cached
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "data_parallel_rank": 0}
    for _ in range(2):
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
    cached = cached_by_rank()
    assert cached[0] > 0 and cached[1] == 0, cached
    for bad in ({**body, "routed_dp_rank": 2}, {**body, "routed_dp_rank": -1}):
        refused = httpx.post(f"{server.url}/generate", json=bad, timeout=30)
        assert refused.status_code == 400 and "routed_dp_rank" in refused.text, refused.text
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "data_parallel_rank": 5}, timeout=30)
    assert refused.status_code == 400 and "routed_dp_rank must be in [0, 2)" in refused.text, refused.text


def test_dp2_embedding_server(launch_server, tokenizer) -> None:
    """Embedding outputs of both replicas reach the client (they go through the DP controller)."""
    import torch
    from transformers import AutoModelForCausalLM

    server = launch_server(["--dp-size", "2", "--is-embedding"])
    texts = [f"{PROMPTS[i % len(PROMPTS)]} number {i}" for i in range(16)]

    async def run() -> List[List[float]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as client:
            async def one(text: str) -> List[float]:
                response = await client.post("/v1/embeddings", json={"input": text})
                assert response.status_code == 200, response.text
                return response.json()["data"][0]["embedding"]

            return await asyncio.gather(*(one(t) for t in texts))

    got = torch.tensor(asyncio.run(run()))
    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin_model(), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = torch.stack([torch.nn.functional.normalize(
            hf.model(torch.tensor([tokenizer(t).input_ids])).last_hidden_state[0, -1], dim=-1) for t in texts])
    assert torch.allclose(got, want, atol=1e-4)
    states = _wait_all_ranks_idle(server.url)
    assert all(s["forward_ct"] > 0 for s in states), states  # both replicas embedded


def test_two_nodes_over_loopback(launch_server, oracle) -> None:
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{get_free_port()}"]
    node1 = launch_server([*common, "--node-rank", "1"], wait=False)  # no HTTP server on node 1
    node0 = launch_server([*common, "--node-rank", "0"])
    for prompt in PROMPTS[:2]:
        assert _generate(node0.url, prompt)["output_ids"] == oracle(prompt), prompt
    states = _internal_states(node0.url)
    assert [r["tp_rank"] for r in states[0]["tp_rank_states"]] == [0, 1]
    assert node1.proc.poll() is None
    node1.proc.send_signal(signal.SIGTERM)
    assert _wait_exit(node0, 10.0) != 0
