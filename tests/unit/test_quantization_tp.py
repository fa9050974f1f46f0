"""--quantization with tensor parallelism: 2 spawned ranks over gloo, each quantizing its own shards.

Oracle: the unquantized engine at tp=1 on a checkpoint whose linears were replaced by what the two
ranks hold together: column-parallel weights (q/k/v, gate/up) dequantized per output channel, and
row-parallel ones (o, down) quantized per output channel over each rank's half of the input
columns, dequantized and put side by side (and, with --quantize-lm-head, the LM head dequantized per
vocabulary row, which each rank's slice of rows reproduces). The tp=2 quantized prefill logits equal its
logits to float32 tolerance and the greedy tokens are the same."""

from __future__ import annotations

import json
import os
import shutil
import pytest
import torch

from tp_utils import TP, prefill_and_decode, run_tp_ranks, tp_runner
from utils_models import build_tiny_model, make_runner

from engine.layers.quantization import quantize_weight

pytestmark = pytest.mark.slow  # spawns two ranks

STEPS = 8
PROMPTS = [[3, 17, 250, 9, 44], [100, 7, 7, 7, 31, 480, 2, 65, 11], [401]]
ROW_PARALLEL = ("o_proj", "down_proj")


def _run(runner) -> tuple[torch.Tensor, list[list[int]]]:
    return prefill_and_decode(runner, PROMPTS, STEPS)


def _tp2_work(job: tuple[str, str, bool]) -> tuple[torch.Tensor, list[list[int]]]:
    path, method, head = job
    return _run(tp_runner(path, TP, max_total_tokens=4096, quantization=method, quantize_lm_head=head))


def _oracle_checkpoint(src: str, dst: str, method: str, head: bool = False) -> None:
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            continue
        tensors = load_file(os.path.join(src, name))
        for key, w in tensors.items():
            if head and key == "lm_head.weight":
                tensors[key] = quantize_weight(w, method).dequantize().to(w.dtype)
            if ".layers." not in key or w.dim() != 2:
                continue
            if any(p in key for p in ROW_PARALLEL):
                halves = w.float().chunk(TP, dim=1)
                tensors[key] = torch.cat([quantize_weight(h, method).dequantize() for h in halves], dim=1).to(w.dtype)
            else:
                tensors[key] = quantize_weight(w, method).dequantize().to(w.dtype)
        save_file(tensors, os.path.join(dst, name), metadata={"format": "pt"})


@pytest.mark.parametrize("method, head", [("w8a8_int8", False), ("fp8", False), ("w8a8_int8", True)])
def test_tp2_quantized_equals_its_dequantized_checkpoint(tmp_path, method: str, head: bool, monkeypatch) -> None:
    # Weight-only int8 (the ranks inherit the environment): with int8 activations a row-parallel shard
    # quantizes its own slice of each row with its own scale, which no single-rank checkpoint reproduces.
    monkeypatch.setenv("ENGINE_W8A8_INT8_ACTIVATIONS", "0")
    path, oracle = str(tmp_path / "model"), str(tmp_path / "oracle")
    # With the head: vocabulary 504, so rank 1's rows end in padding.
    build_tiny_model(path, "llama", num_attention_heads=4, num_key_value_heads=2, vocab_size=504 if head else 512)
    _oracle_checkpoint(path, oracle, method, head)
    assert json.load(open(os.path.join(oracle, "config.json")))["num_key_value_heads"] == 2
    expected_logits, expected_tokens = _run(make_runner(oracle))

    logits, tokens = run_tp_ranks(_tp2_work, (path, method, head))
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert tokens == expected_tokens
