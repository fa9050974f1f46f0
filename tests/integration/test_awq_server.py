"""A server on an AWQ checkpoint of the built-in model (written by the test to AutoAWQ's layout: groups of
128, down_proj kept float since its 688 inputs are no whole groups), float32, no --quantization (detected
from config.json): greedy /generate equals transformers run on the built-in model with each quantized
projection's weight replaced by the weight the checkpoint stands for, token for token, for a single
request and a batch, with float activations (ENGINE_INT4_INT8_ACTIVATIONS=0)."""

from __future__ import annotations

import httpx
import pytest
import torch

from conftest import post_greedy, start_server_process

pytestmark = pytest.mark.slow  # starts a server (processes)

N_NEW = 24
PROMPTS = [[900, 901, 902, 44], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [17, 250, 1999, 40, 812, 5, 77, 1204]]


@pytest.fixture(scope="module")
def awq_server(tmp_path_factory):
    import transformers
    from utils_models import hf_greedy
    from utils_quant import write_int4_checkpoint

    from engine.builtin_model import ensure_builtin_model

    src = ensure_builtin_model()
    path = str(tmp_path_factory.mktemp("awq"))
    weights = write_int4_checkpoint(src, path, "awq", group=128, skip=("down_proj",))
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    plain = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, weight in weights.items():
            params[name].copy_(weight)
    expected = [hf_greedy(hf, p, N_NEW) for p in PROMPTS]
    # Every prompt continues differently on the unquantized model (within 2 tokens, measured), so the test
    # tells a server that loaded the 4-bit weights from one that did not.
    assert all(p != e for p, e in zip(plain, expected))
    # Float activations: the oracle is the dequantized weights' float product (the default int8 activations of
    # the CPU's 4-bit kernel are tested against their own oracle in tests/unit/test_prequantized.py).
    server = start_server_process(["--model-path", path, "--dtype", "float32"],
                                  env={"ENGINE_INT4_INT8_ACTIVATIONS": "0"})
    try:
        yield server.url, expected
    finally:
        server.stop()


def test_greedy_equals_dequantized_transformers(awq_server):
    url, expected = awq_server
    for prompt, tokens in zip(PROMPTS, expected):
        assert post_greedy(url, prompt, N_NEW).json()["output_ids"] == tokens


def test_batch_equals_dequantized_transformers(awq_server):
    url, expected = awq_server
    body = {"input_ids": PROMPTS, "sampling_params": {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}}
    outs = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    assert [o["output_ids"] for o in outs] == expected
