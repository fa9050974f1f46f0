"""A server with --speculative-algorithm NGRAM: greedy /generate equals transformers' greedy run
token for token (streamed or not), meta_info carries SGLang's speculative figures and
/get_server_info and /metrics the mean accept length."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow  # starts a server (processes)

# Every eligible step verifies (the counts below assume it; the switch is tested in test_speculative_switch.py).
SERVER_ARGS = ["--speculative-algorithm", "NGRAM", "--strict-memory-check", "--enable-metrics",
               "--disable-speculative-adaptive"]
N_NEW = 40


@pytest.fixture(scope="module")
def case():
    """A prompt and transformers' greedy continuation of it (the built-in model repeats itself,
    so the drafter's proposals get accepted)."""
    from transformers import AutoModelForCausalLM

    from engine.builtin_model import ensure_builtin_model

    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin_model(), dtype=torch.float32).eval()
    prompt = [17, 250, 1999, 40, 812, 5, 77, 1204]
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    return prompt, out[0, len(prompt):].tolist()


def _body(prompt, stream=False):
    return {"input_ids": prompt, "stream": stream,
            "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}


def test_greedy_generate_equals_transformers_with_speculative_meta(server_url, case):
    prompt, expected = case
    out = httpx.post(f"{server_url}/generate", json=_body(prompt), timeout=120).json()
    assert out["output_ids"] == expected
    meta = out["meta_info"]
    assert meta["completion_tokens"] == N_NEW
    assert 0 < meta["spec_verify_ct"] < N_NEW  # fewer verify steps than tokens: drafts were accepted
    assert meta["spec_accept_length"] == pytest.approx(N_NEW / meta["spec_verify_ct"])
    assert meta["spec_accept_length"] > 1.5
    assert 0 < meta["spec_accept_rate"] <= 1
    assert meta["spec_accept_token_num"] + meta["spec_verify_ct"] == N_NEW - 1


def test_streamed_output_equals_and_server_reports_mean_accept_length(server_url, case):
    prompt, expected = case
    ids = []
    last_meta = None
    with httpx.stream("POST", f"{server_url}/generate", json=_body(prompt, stream=True), timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:"):])
            ids = chunk["output_ids"]
            last_meta = chunk["meta_info"]
    assert ids == expected
    assert last_meta is not None and last_meta["spec_verify_ct"] > 0
    state = httpx.get(f"{server_url}/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["avg_spec_accept_length"] > 1.5
    assert state["spec_verify_ct"] > 0
    metrics = httpx.get(f"{server_url}/metrics", timeout=30).text
    line = next(m for m in metrics.splitlines() if m.startswith("sglang:spec_accept_length{"))
    assert float(line.rsplit(" ", 1)[1]) > 1.5
