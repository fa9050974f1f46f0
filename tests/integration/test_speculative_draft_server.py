"""A server with --speculative-algorithm STANDALONE whose draft model is the target itself: the draft
runner is built in the scheduler process beside the target, greedy /generate equals transformers'
greedy run token for token, and every draft is accepted (its K/V follow the target's), which
meta_info shows."""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.builtin_model import ensure_builtin_model

pytestmark = pytest.mark.slow  # starts a server (processes)

SERVER_ARGS = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", ensure_builtin_model(),
               "--strict-memory-check", "--disable-speculative-adaptive"]  # the counts below: every step verifies
N_NEW = 40


@pytest.fixture(scope="module")
def case():
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin_model(), dtype=torch.float32).eval()
    prompt = [17, 250, 1999, 40, 812, 5, 77, 1204]
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False)
    return prompt, out[0, len(prompt):].tolist()


def test_greedy_generate_equals_transformers_with_every_draft_accepted(server_url, case):
    prompt, expected = case
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}
    out = httpx.post(f"{server_url}/generate", json=body, timeout=120).json()
    assert out["output_ids"] == expected
    meta = out["meta_info"]
    # 39 tokens after the prefill's: 9 verify steps of 3 drafts + 1, then one of 2 + 1 (the budget).
    assert meta["spec_verify_ct"] == 10
    assert meta["spec_accept_token_num"] == meta["spec_draft_token_num"] == N_NEW - 1 - 10
    assert meta["spec_accept_length"] == pytest.approx(N_NEW / 10)


def test_sampled_and_greedy_requests_together(server_url, case):
    prompt, expected = case
    greedy = {"input_ids": [prompt, prompt[:5]],
              "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}
    sampled = {"input_ids": prompt, "sampling_params": {"temperature": 1.0, "max_new_tokens": N_NEW,
                                                        "ignore_eos": True}}
    with httpx.Client(timeout=120) as client:
        outs = client.post(f"{server_url}/generate", json=greedy).json()
        drawn = client.post(f"{server_url}/generate", json=sampled).json()
    assert outs[0]["output_ids"] == expected
    assert len(outs[1]["output_ids"]) == N_NEW
    assert len(drawn["output_ids"]) == N_NEW and drawn["meta_info"]["spec_verify_ct"] > 0
    state = httpx.get(f"{server_url}/get_server_info", timeout=30).json()["internal_states"][0]
    assert state["spec_verify_ct"] > 0
