"""A --tp-size 2 server with LoRA: the ranks serve their shards of each adapter exactly (peft's greedy
tokens), and an adapter loaded and unloaded while serving is loaded and unloaded on both ranks."""

from __future__ import annotations

import httpx
import pytest
import torch

pytest.importorskip("peft", reason="peft is the oracle of the LoRA tests (pip install peft)")

from conftest import post_greedy, start_server_process  # noqa: E402
from lora_utils import ALL_MODULES, build_adapters, peft_greedy  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server with two TP ranks

N_NEW = 6
PROMPTS = [[17, 250, 1999, 40, 812, 5, 77], [3, 4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from engine.builtin_model import ensure_builtin_model

    hf = AutoModelForCausalLM.from_pretrained(ensure_builtin_model(), dtype=torch.float32).eval()
    paths = build_adapters(hf, str(tmp_path_factory.mktemp("adapters")),
                           {"a": dict(rank=8, targets=ALL_MODULES, seed=21),
                            "b": dict(rank=4, targets=["q_proj", "v_proj", "down_proj"], seed=22)})
    expected = {name: peft_greedy(hf, path, PROMPTS, N_NEW) for name, path in paths.items()}
    server = start_server_process(["--tp-size", "2", "--lora-paths", f"a={paths['a']}", "--max-lora-rank", "8",
                                   "--lora-target-modules", "all", "--dtype", "float32"])
    try:
        yield server, paths, expected
    finally:
        server.stop()


def _generate(url, lora):
    return [o["output_ids"] for o in post_greedy(url, PROMPTS, N_NEW, lora_path=lora).json()]


def test_tp2_server_serves_loads_and_unloads(setup):
    server, paths, expected = setup
    assert _generate(server.url, ["a", "a"]) == expected["a"]
    r = httpx.post(f"{server.url}/load_lora_adapter", json={"lora_name": "b", "lora_path": paths["b"]}, timeout=120)
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "b"}
    assert _generate(server.url, ["b", "a"]) == [expected["b"][0], expected["a"][1]]
    r = httpx.post(f"{server.url}/unload_lora_adapter", json={"lora_name": "b"}, timeout=120)
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a"}
