"""EAGLE speculative decoding on a PD pair at TP 2: a decode server at --tp-size 2 with a random EAGLE head,
fed by a prefill server at --tp-size 2 (rank to rank) and by one at --tp-size 1 (each decode rank pulls its
half of the KV heads, and the target's features, from the one prefill rank); tcp transfer over 127.0.0.1.

Greedy outputs equal the target's greedy run without speculation (transformers, float32: what a unified
TP 1 server returns, test_speculative_server.py / test_http_api.py), and the decode answers carry verify
steps, so the head drafted from the features the prefill ranks sent. The decode ranks check that they
sampled and verified the same tokens at every step (ENGINE_CHECK_TP_SAMPLING), and the prefill servers
load no head (they only send the features): their /get_server_info counts the features' bytes alone.
"""

from __future__ import annotations

import concurrent.futures
import random
from typing import Any, Dict, Iterator, List, Tuple

import httpx
import pytest
import torch

from conftest import ServerProcess, start_server_process
from engine.builtin_model import ensure_builtin_model
from engine.utils.network_utils import get_free_port

pytestmark = pytest.mark.slow  # five scheduler processes

PD_ENV = {"ENGINE_DISAGGREGATION_SECRET": "speculative-pd-tp-test-secret"}
N_NEW = 12
PROMPTS = [[17, 250, 1999, 40, 812, 5, 77, 1204], [3, 9, 27, 81, 243, 729, 2187, 5, 9, 13, 17, 21, 25, 29, 33],
           [1000, 1001, 1002]]


@pytest.fixture(scope="module")
def eagle_head(tmp_path_factory) -> str:
    from utils_models import build_eagle_head

    return build_eagle_head(str(tmp_path_factory.mktemp("pd_tp_eagle_head")), ensure_builtin_model(), seed=1)


@pytest.fixture(scope="module")
def expected() -> List[List[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin_model(), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


@pytest.fixture(scope="module")
def servers(eagle_head: str) -> Iterator[Tuple[Dict[int, Tuple[ServerProcess, int]], ServerProcess]]:
    """({prefill TP size: (server, bootstrap port)}, the TP 2 decode server)."""
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", eagle_head]
    started: List[ServerProcess] = []
    try:
        prefills: Dict[int, Tuple[ServerProcess, int]] = {}
        for tp in (2, 1):
            port = get_free_port()
            server = start_server_process(spec + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                                  str(port), "--tp-size", str(tp)], wait=False, env=PD_ENV)
            started.append(server)
            prefills[tp] = (server, port)
        # Every decode step verifies (no switch, no batch-size limit): the counts below see the drafts.
        decode = start_server_process(spec + ["--disaggregation-mode", "decode", "--tp-size", "2",
                                              "--disable-speculative-adaptive",
                                              "--speculative-batch-size-threshold", "64"],
                                      wait=False, env={**PD_ENV, "ENGINE_CHECK_TP_SAMPLING": "1"})
        started.append(decode)
        for server in started:
            server.wait_healthy()
        yield prefills, decode
    finally:
        for server in started:
            server.stop()


def _generate_pd(prefill: ServerProcess, bootstrap_port: int, decode: ServerProcess,
                 prompts: List[List[int]]) -> List[Dict[str, Any]]:
    """Each prompt sent to both servers at once with one bootstrap room (what a PD router does); the
    decode server's answers."""
    def body(prompt: List[int]) -> Dict[str, Any]:
        return {"input_ids": prompt, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                "bootstrap_room": random.randrange(1, 1 << 62),
                "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}}

    bodies = [body(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(2 * len(prompts)) as pool:
        halves = [pool.submit(httpx.post, f"{prefill.url}/generate", json=b, timeout=300) for b in bodies]
        answers = [pool.submit(httpx.post, f"{decode.url}/generate", json=b, timeout=300) for b in bodies]
        for half in halves:
            assert half.result().status_code == 200, half.result().text
        results = [a.result() for a in answers]
    for r in results:
        assert r.status_code == 200, r.text
    return [r.json() for r in results]


@pytest.mark.parametrize("prefill_tp", [2, 1], ids=["prefill-tp2", "prefill-tp1"])
def test_eagle_decode_tp2_equals_greedy_without_speculation(servers, expected, prefill_tp: int) -> None:
    prefills, decode = servers
    prefill, bootstrap_port = prefills[prefill_tp]
    outs = _generate_pd(prefill, bootstrap_port, decode, PROMPTS)
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)  # the head drafted on the decode side


def test_prefill_servers_load_no_head(servers) -> None:
    """A prefill server's draft memory is the target's features alone, no head K/V: per slot the built-in
    target's K/V take 4 layers x 2 x (4 / TP) heads x 32 floats, its feature 256 floats (the whole hidden
    state on every rank); the TP 2 decode server adds its head's K/V (1 layer x 2 x 2 heads x 32)."""
    prefills, decode = servers
    for tp, (prefill, _) in prefills.items():
        state = httpx.get(f"{prefill.url}/get_server_info", timeout=30).json()["internal_states"][0]
        assert state["draft_kv_pool_bytes"] * 4 == state["kv_pool_bytes"] * tp, state
    state = httpx.get(f"{decode.url}/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["draft_kv_pool_bytes"] * 4 == state["kv_pool_bytes"] * 3, state
