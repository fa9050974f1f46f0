"""PD with different TP sizes: a tp=1 prefill server and a tp=2 decode server (gloo on the CPU).

Each decode rank holds half of the KV heads: it sends its own destination (with its head slice)
and the prefill rank serves both. The decode ranks move requests between queues on polls
reduced with a MIN all-reduce, so both always agree. Requests are sent to both servers with the
bootstrap fields, as sglang-router does. Greedy outputs equal transformers'; both decode ranks end
idle with their KV pools whole, having computed no prompt token.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Dict, List

import httpx
import pytest

from engine.builtin_model import ensure_builtin_model
from engine.utils.network_utils import get_free_port
from utils_process import wait_until

PROMPTS = ["Hello, my name is", "1 2 3 4", "The capital of France", "Heads are split across the ranks"]
STEPS = 6


@pytest.fixture(scope="module")
def oracle():
    """transformers' greedy continuation (float32) of a prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_builtin_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()

    def greedy(prompt: str) -> List[int]:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=STEPS,
                                 min_new_tokens=STEPS, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    return greedy


def _rank_states(url: str) -> List[Dict[str, Any]]:
    states = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"]
    return [r for s in states for r in s.get("tp_rank_states", [s])]


def test_tp2_decode_with_tp1_prefill(launch_server, oracle, monkeypatch) -> None:
    monkeypatch.setenv("ENGINE_CHECK_TP_SAMPLING", "1")  # decode ranks fail if their sampled ids differ
    bootstrap_port = get_free_port()
    prefill = launch_server(["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                             str(bootstrap_port)], wait=False)
    decode = launch_server(["--disaggregation-mode", "decode", "--tp-size", "2"], wait=False)
    prefill.wait_healthy()
    decode.wait_healthy()

    def both(i: int, prompt: str) -> Dict[str, Any]:
        body = {"text": prompt, "sampling_params": {"max_new_tokens": STEPS, "temperature": 0.0, "ignore_eos": True},
                "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": 1000 + i}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            half = pool.submit(httpx.post, f"{prefill.url}/generate", json=body, timeout=120)
            answer = httpx.post(f"{decode.url}/generate", json=body, timeout=120)
            assert half.result().status_code == 200, half.result().text
        assert answer.status_code == 200, answer.text
        return answer.json()

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(both, range(len(PROMPTS)), PROMPTS))
    for prompt, answer in zip(PROMPTS, answers):
        assert answer["output_ids"] == oracle(prompt), prompt

    def idle() -> bool:
        ranks = _rank_states(decode.url)
        return all(r["num_running_reqs"] == 0 and r["available_tokens"] == r["max_total_num_tokens"]
                   for r in ranks)

    assert wait_until(idle, 60, interval=0.2), _rank_states(decode.url)
    ranks = _rank_states(decode.url)
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["num_extend_tokens_computed"] == 0
        pd = rank["disaggregation"]
        assert pd["metrics"]["num_transferred_prompt_tokens"] > 0
        assert pd["num_decode_transfer_queue_reqs"] == pd["num_decode_prealloc_queue_reqs"] == 0
