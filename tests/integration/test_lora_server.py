"""A server with --lora-paths: /generate (lora_path, a list for a batch) and the OpenAI routes
(model "base:adapter") return peft's greedy tokens for each adapter, /v1/models lists the adapters,
adapters load and unload while serving (unload waits for the requests that use it), bad input is a 400."""

from __future__ import annotations

import threading

import httpx
import orjson
import pytest
import torch

pytest.importorskip("peft", reason="peft is the oracle of the LoRA tests (pip install peft)")

from conftest import post_greedy, start_server_process  # noqa: E402
from lora_utils import ALL_MODULES, build_adapters, peft_greedy  # noqa: E402
from utils_models import hf_greedy  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server (processes)

N_NEW = 8
PROMPTS = [[17, 250, 1999, 40, 812, 5, 77], [3, 4, 5, 6, 7, 8], [1204, 5, 77, 17, 250]]
ADAPTERS = {"qv": dict(rank=4, targets=["q_proj", "v_proj"], seed=11),
            "all": dict(rank=8, targets=ALL_MODULES, seed=12),
            "late": dict(rank=8, targets=["o_proj", "down_proj"], seed=13)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from engine.builtin_model import ensure_builtin_model

    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin_model(), dtype=torch.float32).eval()
    paths = build_adapters(hf, str(tmp_path_factory.mktemp("adapters")), ADAPTERS)
    expected = {name: peft_greedy(hf, path, PROMPTS, N_NEW) for name, path in paths.items()}
    expected[None] = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    assert all(expected[name] != expected[None] for name in paths)  # every adapter changes the output
    server = start_server_process(["--lora-paths", f"qv={paths['qv']}", f"all={paths['all']}",
                                   "--max-loras-per-batch", "2", "--max-lora-rank", "8",
                                   "--lora-target-modules", "all", "--dtype", "float32"])
    try:
        yield server, paths, expected
    finally:
        server.stop()


def _generate(url: str, input_ids, lora_path, **extra):
    return post_greedy(url, input_ids, N_NEW, lora_path=lora_path, **extra)


def test_batch_with_an_adapter_per_prompt_equals_peft(setup):
    server, _, expected = setup
    names = [None, "qv", "all"]
    for offset in range(3):  # every prompt under every adapter, in mixed batches
        lora = [names[(i + offset) % 3] for i in range(len(PROMPTS))]
        out = _generate(server.url, PROMPTS, lora).json()
        for i, item in enumerate(out):
            assert item["output_ids"] == expected[lora[i]][i], (lora[i], i)


def test_openai_model_names_the_adapter_and_models_list(setup, tokenizer):
    """model "base:adapter" and the adapter's name alone select it; the base name alone runs the base."""
    server, paths, expected = setup
    cards = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"]
    base = cards[0]["id"]
    assert {m["id"] for m in cards[1:]} == {"qv", "all"} and all(m["parent"] == base for m in cards[1:])
    for model, adapter in ((f"{base}:all", "all"), ("qv", "qv"), (base, None)):
        body = {"model": model, "prompt": PROMPTS[1], "max_tokens": N_NEW, "temperature": 0}
        out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
        assert out["choices"][0]["text"] == tokenizer.decode(expected[adapter][1]), model


def test_bad_requests_are_400(setup):
    server, paths, _ = setup
    r = _generate(server.url, PROMPTS[0], "nope")
    assert r.status_code == 400 and "not loaded" in r.text
    r = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"}, timeout=60)
    assert r.status_code == 400 and "adapter_config.json" in r.text
    r = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "nope"}, timeout=60)
    assert r.status_code == 400
    r = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "", "lora_path": paths["qv"]}, timeout=60)
    assert r.status_code == 400
    # Still serving exactly afterwards.
    assert _generate(server.url, PROMPTS[0], "qv").json()["output_ids"] == setup[2]["qv"][0]


def test_load_and_unload_under_load(setup):
    server, paths, expected = setup
    r = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "late", "lora_path": paths["late"]},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert set(r.json()["loaded_adapters"]) == {"qv", "all", "late"}
    results, errors = [], []
    admitted = threading.Semaphore(0)  # one release per "late" request the server has started

    def client(name, i):
        first = True
        try:
            if name != "late":
                results.append((name, i, _generate(server.url, PROMPTS[i], name).json()["output_ids"]))
                return
            # Streamed, so the unload below is sent only once every "late" request is in the server
            # (a request arriving after the unload began would be refused: another case).
            body = {"input_ids": PROMPTS[i], "lora_path": name, "stream": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}
            ids = None
            with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=300) as response:
                assert response.status_code == 200, response.read()
                for line in response.iter_lines():
                    if line.startswith("data:") and line.strip() != "data: [DONE]":
                        ids = orjson.loads(line[len("data:"):])["output_ids"]
                        if first:
                            admitted.release()
                            first = False
            results.append((name, i, ids))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))
        finally:
            if name == "late" and first:
                admitted.release()  # failed before its first event: do not hold the test up

    threads = [threading.Thread(target=client, args=(name, i)) for name in ("late", "qv", None, "all")
               for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for _ in PROMPTS:
        assert admitted.acquire(timeout=300)
    # Unload while those run: it waits for the requests that use "late", which all complete.
    r = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "late"}, timeout=300)
    for t in threads:
        t.join(timeout=300)
    assert r.status_code == 200, r.text
    assert not errors
    assert len(results) == 12
    for name, i, ids in results:
        assert ids == expected[name][i], (name, i)
    assert _generate(server.url, PROMPTS[0], "late").status_code == 400
