"""The control plane and the per-request extras through HTTP, on one tp=2 server (CPU, gloo).

Oracle: transformers (float32) on the built-in model and on other checkpoints of the same
architecture; the checkpoint files themselves for /get_weights_by_name. tp=2 makes every rank
load, release, gather, receive and compute its own shard. A trainer process (tests/utils_trainer.py)
pushes weights over a gloo group as SGLang's RL trainers do; everything stays on loopback.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Any, Dict, List

import httpx
import pytest
import torch

from engine.builtin_model import ensure_builtin_model
from utils_models import scaled_builtin_checkpoint

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

SERVER_ARGS = ["--tp-size", "2", "--enable-priority-scheduling"]
SERVER_ENV = {"GLOO_SOCKET_IFNAME": "lo"}  # the weight update group's pairs listen on loopback only
GREEDY = {"temperature": 0.0, "ignore_eos": True}
PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4", "Pause me if you can"]
STEPS = 8


@pytest.fixture(scope="module")
def new_checkpoint(tmp_path_factory) -> str:
    """The built-in model with every matrix scaled: same architecture, other outputs."""
    return scaled_builtin_checkpoint(str(tmp_path_factory.mktemp("new_checkpoint")))


@pytest.fixture(scope="module")
def hf(tokenizer):
    from transformers import AutoModelForCausalLM

    cache: Dict[str, Any] = {}

    def model(path: str):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return model


def oracle(hf, tokenizer, prompt: str, path: str = "", steps: int = STEPS) -> List[int]:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        out = hf(path or ensure_builtin_model()).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                          max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def generate(url: str, prompt: str, steps: int = STEPS, **fields) -> Dict[str, Any]:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": steps, **GREEDY}, **fields}
    response = httpx.post(f"{url}/generate", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


# ---------------------------------------------------------------------- per-request extras
def test_hidden_states_and_token_ids_logprob_equal_transformers(server_url, hf, tokenizer):
    ids = [5, 17, 2000]
    out = generate(server_url, PROMPTS[0], return_hidden_states=True, return_logprob=True, logprob_start_len=0,
                   token_ids_logprob=ids)
    meta = out["meta_info"]
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        ref = hf(ensure_builtin_model())(torch.tensor([prompt + out["output_ids"][:-1]]), output_hidden_states=True)
    states = torch.cat([torch.tensor(meta["hidden_states"][0]), torch.tensor(meta["hidden_states"][1:])])
    torch.testing.assert_close(states, ref.hidden_states[-1][0], rtol=1e-3, atol=1e-3)
    logprobs = torch.log_softmax(ref.logits[0].float(), dim=-1)[:, ids]
    got = [[entry[0] for entry in position] for position in meta["output_token_ids_logprobs"]]
    assert [[entry[1] for entry in position] for position in meta["output_token_ids_logprobs"]] == [ids] * STEPS
    torch.testing.assert_close(torch.tensor(got), logprobs[len(prompt) - 1:], rtol=1e-3, atol=1e-3)


def test_cache_salt_over_http(server_url):
    prompt = "A prompt that is long enough to be cached in pieces " * 3

    def cached(**fields) -> int:
        return generate(server_url, prompt, steps=2, **fields)["meta_info"]["cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-a") > 0
    assert cached(cache_salt="tenant-b") == 0
    assert cached(extra_key="k", cache_salt="tenant-a") == 0


def test_stop_regex_and_priority_on_both_apis(server_url, tokenizer):
    full = generate(server_url, "1 2 3 4", steps=40, priority=3)
    ids = full["output_ids"]
    # A piece of what greedy decoding produces from its 4th token on: it must stop right there.
    start = len(tokenizer.decode(ids[:3]))
    pattern = re.escape(full["text"][start:start + 2])
    body = {"text": "1 2 3 4", "priority": 3,
            "sampling_params": {"max_new_tokens": 40, "stop_regex": [pattern], **GREEDY}}
    stopped = httpx.post(f"{server_url}/generate", json=body, timeout=120).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    n = len(stopped["output_ids"])
    assert stopped["output_ids"] == ids[:n] and n < len(ids)
    assert re.search(pattern, tokenizer.decode(ids[:n])) and not re.search(pattern, tokenizer.decode(ids[:n - 1]))
    assert stopped["text"] == tokenizer.decode(ids[:n])  # the match is not trimmed, as in SGLang
    completion = httpx.post(f"{server_url}/v1/completions", timeout=120, json={
        "prompt": "1 2 3 4", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "priority": 3,
        "stop_regex": pattern, "cache_salt": "s"})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"] == stopped["text"]
    assert completion.json()["choices"][0]["finish_reason"] == "stop"


def test_custom_logit_processor_needs_the_flag(server_url):
    response = httpx.post(f"{server_url}/generate", timeout=60,
                          json={"text": "hi", "custom_logit_processor": '{"callable": "00"}'})
    assert response.status_code == 400
    assert "--enable-custom-logit-processor" in response.json()["message"]


# ---------------------------------------------------------------------- pause / continue
async def _open_streams(client: httpx.AsyncClient, prompts: List[str], steps: int) -> List[Any]:
    """Start streaming requests and return once each has produced its first chunk."""
    streams = []
    for prompt in prompts:
        body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": steps, **GREEDY}}
        response = await client.send(client.build_request("POST", "/generate", json=body), stream=True)
        assert response.status_code == 200
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data:"):
                break
        streams.append((response, lines))
    return streams


async def _finish(stream: Any) -> Dict[str, Any]:
    response, lines = stream
    last: Dict[str, Any] = {}
    async for line in lines:
        if line.startswith("data:") and line != "data: [DONE]":
            last = json.loads(line[len("data:"):])
    await response.aclose()
    return last


@pytest.mark.parametrize("mode", ["abort", "retract", "in_place"])
def test_pause_then_continue_loses_no_request(server_url, hf, tokenizer, mode):
    steps = 48

    async def run():
        async with httpx.AsyncClient(base_url=server_url, timeout=300) as client:
            streams = await _open_streams(client, PROMPTS, steps)
            paused = await client.post("/pause_generation", json={"mode": mode})
            assert paused.status_code == 200 and paused.json()["status"] == "ok"
            late = asyncio.create_task(client.post("/generate", json={
                "text": PROMPTS[0], "sampling_params": {"max_new_tokens": steps, **GREEDY}}))
            if mode == "abort":  # every request in flight was answered before the pause returned
                finals = await asyncio.gather(*(_finish(s) for s in streams))
            resumed = await client.post("/continue_generation")
            assert resumed.status_code == 200
            if mode != "abort":
                finals = await asyncio.gather(*(_finish(s) for s in streams))
            return finals, await late

    finals, late = asyncio.run(run())
    assert late.status_code == 200 and late.json()["output_ids"] == oracle(hf, tokenizer, PROMPTS[0], steps=steps)
    for prompt, final in zip(PROMPTS, finals):
        expected = oracle(hf, tokenizer, prompt, steps=steps)
        if mode == "abort":
            assert final["meta_info"]["finish_reason"]["type"] == "abort"
            assert final["output_ids"] == expected[: len(final["output_ids"])]
        else:
            assert final["output_ids"] == expected, prompt


# ---------------------------------------------------------------------- memory
def test_release_then_resume_gives_identical_outputs(server_url):
    before = [generate(server_url, p)["output_ids"] for p in PROMPTS]

    async def refused_while_running():
        async with httpx.AsyncClient(base_url=server_url, timeout=300) as client:
            streams = await _open_streams(client, PROMPTS[:1], 64)
            await client.post("/pause_generation", json={"mode": "in_place"})  # keeps it running
            refused = await client.post("/release_memory_occupation", json={})
            await client.post("/continue_generation")
            await _finish(streams[0])
            return refused

    refused = asyncio.run(refused_while_running())
    assert refused.status_code == 400 and "running" in refused.json()["message"]
    for _ in range(2):  # idempotent
        released = httpx.post(f"{server_url}/release_memory_occupation", json={"tags": None}, timeout=60)
        assert released.status_code == 200, released.text
    assert httpx.post(f"{server_url}/resume_memory_occupation", timeout=60).status_code == 200
    assert [generate(server_url, p)["output_ids"] for p in PROMPTS] == before
    bad = httpx.post(f"{server_url}/release_memory_occupation", json={"tags": ["gpu"]}, timeout=60)
    assert bad.status_code == 400 and "Unknown memory tag" in bad.json()["message"]


# ---------------------------------------------------------------------- weights
def test_get_weights_by_name_reassembles_the_shards(server_url):
    from safetensors.torch import load_file

    weights = load_file(os.path.join(ensure_builtin_model(), "model.safetensors"))
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.layers.1.self_attn.q_proj.weight",
             "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight",
             "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.0.mlp.down_proj.weight", "model.layers.0.input_layernorm.weight", "model.norm.weight"]
    for name in names:
        # 200 rows: more than one rank's shard of the column-parallel projections (128 or 172 rows).
        response = httpx.post(f"{server_url}/get_weights_by_name", json={"name": name, "truncate_size": 200},
                              timeout=60)
        assert response.status_code == 200, response.text
        torch.testing.assert_close(torch.tensor(response.json()), weights[name][:200], rtol=0, atol=0)
    missing = httpx.post(f"{server_url}/get_weights_by_name", json={"name": "model.nothing"}, timeout=60)
    assert missing.status_code == 400


def test_update_weights_from_disk_over_http(server_url, hf, tokenizer, new_checkpoint):
    original = ensure_builtin_model()
    bad = httpx.post(f"{server_url}/update_weights_from_disk", json={"model_path": "/nonexistent"}, timeout=300)
    assert bad.status_code == 400 and bad.json()["success"] is False
    try:
        response = httpx.post(f"{server_url}/update_weights_from_disk",
                              json={"model_path": new_checkpoint, "weight_version": "step-1"}, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["success"] is True
        for prompt in PROMPTS[:2]:
            assert generate(server_url, prompt)["output_ids"] == oracle(hf, tokenizer, prompt, new_checkpoint)
        info = httpx.get(f"{server_url}/model_info", timeout=30).json()
        assert info["model_path"] == new_checkpoint and info["weight_version"] == "step-1"
    finally:
        back = httpx.post(f"{server_url}/update_weights_from_disk", json={"model_path": original}, timeout=300)
    assert back.status_code == 200
    assert generate(server_url, PROMPTS[0])["output_ids"] == oracle(hf, tokenizer, PROMPTS[0])


# ---------------------------------------------------------------------- RL weight sync
@pytest.mark.slow
def test_update_weights_from_distributed_over_http(server_url, hf, tokenizer, tmp_path):
    """The trainer (rank 0) joins with the server's two ranks (1, 2), broadcasts a new checkpoint in
    two buckets while asking /update_weights_from_distributed for each, then leaves the group."""
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    from engine.utils.network_utils import get_free_port
    from utils_trainer import trainer_env

    pushed = scaled_builtin_checkpoint(str(tmp_path), 0.7)
    weights = load_file(os.path.join(pushed, "model.safetensors"))
    names = sorted(weights)
    buckets = []
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        buckets.append(str(tmp_path / f"bucket{i}.safetensors"))
        save_file({n: weights[n] for n in part}, buckets[-1])
    trainer = os.path.join(os.path.dirname(__file__), "..", "utils_trainer.py")
    try:
        done = subprocess.run([sys.executable, trainer, "--port", str(get_free_port()), "--world-size", "3",
                               "--weights", *buckets, "--server", server_url, "--weight-version", "rl-step-3"],
                              env=trainer_env(), capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr
        replies = json.loads(done.stdout.strip().splitlines()[-1])["replies"]
        assert [status for status, _ in replies] == [200] * 4, replies
        assert all(body["success"] for _, body in replies)
        for prompt in PROMPTS[:2]:
            out = generate(server_url, prompt)
            assert out["output_ids"] == oracle(hf, tokenizer, prompt, pushed)
            assert out["meta_info"]["weight_version"] == "rl-step-3"
        assert httpx.get(f"{server_url}/get_weight_version", timeout=30).json() == {"weight_version": "rl-step-3"}
    finally:
        back = httpx.post(f"{server_url}/update_weights_from_disk",
                          json={"model_path": ensure_builtin_model(), "weight_version": "default"}, timeout=300)
    assert back.status_code == 200
    assert generate(server_url, PROMPTS[0])["output_ids"] == oracle(hf, tokenizer, PROMPTS[0])


@pytest.mark.parametrize("route, body, status, message", [
    ("update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[256]]},
     400, "is not initialized"),
    ("update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float128"], "shapes": [[256]]},
     400, "unknown dtype"),
    ("update_weights_from_distributed", {"names": ["a", "b"], "dtypes": ["float32"], "shapes": [[1]]},
     400, "same length"),
    ("update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[-2]]},
     400, "greater than or equal to 0"),
    ("init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                   "world_size": 3, "backend": "nccl"}, 400, "needs CUDA"),
    ("init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                   "world_size": 2, "backend": "gloo"}, 400, "within 1..world_size-1"),
    ("init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0,
                                   "world_size": 3, "backend": "gloo"}, 400, "rank_offset"),
    ("destroy_weights_update_group", {"group_name": "nobody"}, 400, "does not exist"),
    ("update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}, 400, "is not base64"),
    ("update_weights_from_tensor", {"serialized_named_tensors": ["gAN9cQAu"]}, 400,
     "--enable-pickled-weight-updates"),  # a pickle (of {}): refused without the flag
    ("update_weights_from_tensor", {"serialized_named_tensors": ["gAN9cQAu"] * 3}, 400,
     "one per tensor-parallel rank (2)"),
])
def test_weight_sync_refusals(server_url, route, body, status, message):
    response = httpx.post(f"{server_url}/{route}", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert message in response.json()["message"]
    if "success" in response.json():
        assert response.json()["success"] is False


def test_update_weights_from_tensor_over_http(server_url, hf, tokenizer, tmp_path):
    """SGLang's body, with a safetensors payload per TP rank (full tensors of layer 0)."""
    import base64

    from safetensors.torch import load_file, save

    changed = scaled_builtin_checkpoint(str(tmp_path), 0.8, which="layers.0.")
    weights = load_file(os.path.join(changed, "model.safetensors"))
    payload = base64.b64encode(save({k: v for k, v in weights.items() if "layers.0." in k})).decode()
    try:
        response = httpx.post(f"{server_url}/update_weights_from_tensor", timeout=300, json={
            "serialized_named_tensors": [payload, payload], "flush_cache": True, "weight_version": "t-1"})
        assert response.status_code == 200, response.text
        assert response.json()["success"] is True and "t-1" in response.json()["message"]
        assert generate(server_url, PROMPTS[1])["output_ids"] == oracle(hf, tokenizer, PROMPTS[1], changed)
        version = httpx.post(f"{server_url}/update_weight_version", json={"new_version": "t-2"}, timeout=60)
        assert version.json() == {"success": True, "message": "Weight version updated to t-2", "new_version": "t-2"}
        assert httpx.get(f"{server_url}/get_model_info", timeout=30).json()["weight_version"] == "t-2"
    finally:
        back = httpx.post(f"{server_url}/update_weights_from_disk",
                          json={"model_path": ensure_builtin_model(), "weight_version": "default"}, timeout=300)
    assert back.status_code == 200


def test_release_and_resume_accept_every_sglang_tag(server_url):
    """slime releases ["kv_cache", "weights", "cuda_graph"] around training, then resumes them."""
    before = generate(server_url, PROMPTS[2])["output_ids"]
    tags = ["kv_cache", "weights", "cuda_graph", "weights_drafter"]
    released = httpx.post(f"{server_url}/release_memory_occupation", json={"tags": tags}, timeout=60)
    assert released.status_code == 200, released.text
    for group in (["weights"], ["kv_cache", "cuda_graph"], ["weights_drafter"]):
        resumed = httpx.post(f"{server_url}/resume_memory_occupation", json={"tags": group}, timeout=60)
        assert resumed.status_code == 200, resumed.text
    assert generate(server_url, PROMPTS[2])["output_ids"] == before
