"""Block-wise fp8 checkpoints (DeepSeek-V3's quant_method fp8 with weight_block_size [128, 128]).

A random DeepSeek-V3-shaped model (hidden 256, 16 heads: every shard and fused part whole 128-blocks, with
ragged last blocks in q_a_proj [192, 256], kv_a_proj_with_mqa [144, 256] and q_b_proj's 192 inputs) is
quantized here the way DeepSeek's checkpoints are (per 128 x 128 block: scale = amax / 448, the weight
rounded to e4m3 of w / scale, scale stored as weight_scale_inv) on every linear of its layers (the router,
embeddings, LM head and norms stay float). The oracle is transformers on the dequantized weights, float32.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Dict, Tuple

import pytest
import torch
from safetensors.torch import load_file, save_file

from tp_utils import TP, prefill_and_decode, run_tp_ranks, tp_runner
from utils_models import BatchDriver, ExtendReq, build_tiny_model, hf_greedy, hf_logits, make_runner

from engine.layers.block_fp8 import dequantize_block_fp8
from engine.layers.quant_config import resolve_quantization

BLOCK = (128, 128)
FP8_MAX = 448.0
SHAPE = dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=192, kv_lora_rank=128,
             qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, intermediate_size=256,
             moe_intermediate_size=256)
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PROMPTS = [[3, 17, 250, 9, 44], [100, 7, 7, 7, 31, 480, 2, 65, 11, 300, 12, 5], [401]]
DECODE_STEPS = 6


def quantize_block_fp8(weight: torch.Tensor, block: Tuple[int, int] = BLOCK) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's format, computed block by block: (e4m3 weight, scale_inv [ceil(n / bn), ceil(k / bk)])."""
    n, k = weight.shape
    bn, bk = block
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            piece = weight[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            amax = piece.abs().max().item()
            s = amax / FP8_MAX if amax > 0 else 1.0
            scale[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (piece / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    return (name.startswith("model.layers.") and name.endswith(".weight") and tensor.dim() == 2
            and not name.endswith("mlp.gate.weight"))


def write_block_fp8(src: str, dst: str, dequantized_dst: str) -> None:
    """dst: src's model quantized to block-wise fp8; dequantized_dst: the same weights dequantized (the oracle)."""
    weights = load_file(os.path.join(src, "model.safetensors"))
    quantized: Dict[str, torch.Tensor] = {}
    dequantized: Dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if _quantized(name, tensor):
            q, scale = quantize_block_fp8(tensor)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_block_fp8(q, scale, BLOCK)
        else:
            quantized[name] = dequantized[name] = tensor
    for path, tensors in ((dst, quantized), (dequantized_dst, dequantized)):
        os.makedirs(path, exist_ok=True)
        for f in os.listdir(src):
            if f != "model.safetensors":
                shutil.copy(os.path.join(src, f), path)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    _edit_config(dst, quantization_config=QUANT_CONFIG)


def _edit_config(path: str, **fields: object) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the fp8 checkpoint's path, transformers on its dequantized weights)."""
    import transformers

    root = tmp_path_factory.mktemp("blockfp8")
    build_tiny_model(str(root / "float"), "deepseek_v3", seed=5, **SHAPE)
    write_block_fp8(str(root / "float"), str(root / "fp8"), str(root / "dequantized"))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(root / "dequantized"), dtype=torch.float32)
    return str(root / "fp8"), oracle.eval()


def test_dequantize_is_the_block_product():
    """Each [128, 128] block (the last ones ragged) times its own scale, exactly (float32 products)."""
    w = torch.randn(300, 200) * 3
    q, scale = quantize_block_fp8(w)
    out = dequantize_block_fp8(q, scale, BLOCK)
    for i in range(3):
        for j in range(2):
            block = q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float() * scale[i, j]
            assert torch.equal(out[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128], block)
    assert (out - w).abs().max().item() <= w.abs().max().item() / 16  # e4m3's 3 mantissa bits
    with pytest.raises(ValueError, match=r"weight_scale_inv has shape \(2, 2\).*needs \[3, 2\]"):
        dequantize_block_fp8(q, scale[:2], BLOCK)


@pytest.mark.parametrize("change, message", [
    (dict(weight_block_size=[128]), "2 positive integers"),
    (dict(weight_block_size=[128, "128"]), "2 positive integers"),
    (dict(weight_block_size=[0, 128]), "2 positive integers"),
    (dict(weight_block_size=None), "without weight_block_size"),
    (dict(activation_scheme="static"), "activation_scheme 'static'"),
    (dict(fmt="e5m2"), "fmt 'e5m2'"),
    (dict(ignored_layers="lm_head"), "ignored_layers must be a list"),
])
def test_config_refusals(change, message):
    config = {**QUANT_CONFIG, **change}
    with pytest.raises(ValueError, match=message):
        resolve_quantization({"quantization_config": config}, None)


def test_config_accepted():
    quant = resolve_quantization({"quantization_config": {**QUANT_CONFIG, "ignored_layers": ["model.layers.0.mlp"]}},
                                 "fp8")
    assert quant is not None and (quant.method, quant.weights, quant.block) == ("fp8", "block_fp8", (128, 128))
    assert quant.ignores("model.layers.0.mlp.down_proj") and not quant.ignores("model.layers.1.mlp.down_proj")
    with pytest.raises(ValueError, match="does not match"):
        resolve_quantization({"quantization_config": QUANT_CONFIG}, "w8a8_int8")


def _run(path: str, tp_size: int = 1, ep_size: int = 1):
    """Prefill PROMPTS, greedy-decode DECODE_STEPS: (prefill logits of the last positions, tokens per prompt)."""
    runner = tp_runner(path, tp_size, ep_size, page_size=16)
    logits, outputs = prefill_and_decode(runner, PROMPTS, DECODE_STEPS)
    layer = runner.model.model.decoder_layers[1]
    kinds = {"q_a_proj": type(layer.self_attn.q_a_proj.packed_weight).__name__,
             "o_proj": type(layer.self_attn.o_proj.packed_weight).__name__,
             "shared_experts.gate_up_proj": type(layer.mlp.shared_experts.gate_up_proj.packed_weight).__name__,
             "experts": "fp8" if layer.mlp.experts.packed_experts is not None else str(layer.mlp.experts.w13.weight.dtype),
             "kv_b_proj": str(layer.self_attn.kv_b_proj.weight.dtype)}
    return logits, outputs, kinds


def test_greedy_and_logits_match_transformers_on_dequantized_weights(checkpoint):
    path, oracle = checkpoint
    logits, outputs, kinds = _run(path)
    # The linears and the experts keep their fp8 bytes (the CPU kernel); kv_b_proj was dequantized at load.
    assert kinds == {"q_a_proj": "BlockFp8Weight", "o_proj": "BlockFp8Weight",
                     "shared_experts.gate_up_proj": "BlockFp8Weight", "experts": "fp8", "kv_b_proj": "torch.float32"}
    assert outputs == [hf_greedy(oracle, p, DECODE_STEPS + 1) for p in PROMPTS]
    ref = torch.stack([hf_logits(oracle, p)[-1] for p in PROMPTS])
    assert (logits - ref).abs().max().item() < 1e-4


def test_dequantized_at_load_path_matches_transformers(checkpoint, monkeypatch):
    """What a GPU loads (every weight dequantized at load, no fp8 layer kept), run here on the CPU."""
    from engine.layers import block_fp8

    prepare = block_fp8.prepare
    monkeypatch.setattr(block_fp8, "prepare", lambda model, quant, keep_fp8: prepare(model, quant, False))
    path, oracle = checkpoint
    _, outputs, kinds = _run(path)
    assert kinds["o_proj"] != "BlockFp8Weight" and kinds["q_a_proj"] != "BlockFp8Weight"
    assert kinds["experts"] == "torch.float32"
    assert outputs == [hf_greedy(oracle, p, DECODE_STEPS + 1) for p in PROMPTS]


def test_bfloat16_activations_track_float32(checkpoint):
    """--dtype bfloat16: the kernel's bf16 rows (and the experts dequantized to bf16) give logits near the
    float32 run's (bf16 rounding of every activation: a loose bound; the random model's near-ties may pick
    another greedy token)."""
    logits32, _, _ = _run(checkpoint[0])
    runner = make_runner(checkpoint[0], dtype="bfloat16")
    driver = BatchDriver(runner)
    out, _ = driver.run(driver.extend_batch([ExtendReq(driver.new_row(), p) for p in PROMPTS]))
    logits16 = out.next_token_logits.float()
    assert (logits16 - logits32).abs().max().item() < 0.05 * logits32.abs().max().item()
    assert (logits16 - logits32).abs().mean().item() < 0.01 * logits32.abs().max().item()


def test_qwen3_moe_block_fp8_matches_transformers(tmp_path):
    """Qwen3-MoE's own FP8 checkpoints use this format too: the fused q/k/v (parts of 256 / 128 / 128 rows),
    gate_up and the experts keep fp8; greedy tokens equal transformers' on the dequantized weights."""
    import transformers

    build_tiny_model(str(tmp_path / "float"), "qwen3_moe", seed=2, hidden_size=256, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=128, intermediate_size=256, moe_intermediate_size=128)
    write_block_fp8(str(tmp_path / "float"), str(tmp_path / "fp8"), str(tmp_path / "dequantized"))
    oracle = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dequantized"), dtype=torch.float32)
    runner = make_runner(str(tmp_path / "fp8"))
    layer = runner.model.model.decoder_layers[1]
    assert type(layer.self_attn.qkv_proj.packed_weight).__name__ == "BlockFp8Weight"
    assert layer.mlp.experts.packed_experts is not None
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    _, tokens = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, PROMPTS)]))
    outputs = [[int(t)] for t in tokens]
    seq_lens = [len(p) for p in PROMPTS]
    for _ in range(DECODE_STEPS):
        _, tokens = driver.run(driver.decode_batch(rows, [o[-1] for o in outputs], seq_lens))
        seq_lens = [n + 1 for n in seq_lens]
        for o, t in zip(outputs, tokens):
            o.append(int(t))
    assert outputs == [hf_greedy(oracle.eval(), p, DECODE_STEPS + 1) for p in PROMPTS]


def _copy(path: str, dst: str) -> str:
    shutil.copytree(path, dst)
    return dst


def test_scale_shape_not_the_block_grid_is_refused(checkpoint, tmp_path):
    path = _copy(checkpoint[0], str(tmp_path / "bad_scale"))
    weights = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"  # [2, 2]: 144 rows, a ragged block
    weights[name] = weights[name][:1]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"kv_a_proj_with_mqa.weight: weight_scale_inv has shape \(1, 2\)"):
        make_runner(path)


def test_missing_scale_is_refused(checkpoint, tmp_path):
    path = _copy(checkpoint[0], str(tmp_path / "no_scale"))
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="fp8 weights without their weight_scale_inv: model.layers.0.mlp.down_proj"):
        make_runner(path)


def test_ignored_layers_load_as_stored(checkpoint, tmp_path):
    """A module the config lists in ignored_layers is stored in float: it loads as stored (the same values
    here, so the oracle's tokens); the same float weight not listed is refused (it would be read as fp8)."""
    path = _copy(checkpoint[0], str(tmp_path / "ignored"))
    weights = load_file(os.path.join(path, "model.safetensors"))
    module = "model.layers.0.mlp.down_proj"
    weights[f"{module}.weight"] = dequantize_block_fp8(weights[f"{module}.weight"],
                                                       weights.pop(f"{module}.weight_scale_inv"), BLOCK)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"{module}.weight is float32, not fp8, but the config does not list it"):
        make_runner(path)
    _edit_config(path, quantization_config={**QUANT_CONFIG, "ignored_layers": [module]})
    _, outputs, _ = _run(path)
    assert outputs == [hf_greedy(checkpoint[1], p, DECODE_STEPS + 1) for p in PROMPTS]


def test_fused_boundary_inside_a_block_is_refused(checkpoint, tmp_path):
    """Blocks of 96 rows: gate_up's boundary (row 256) falls inside a block; refused before any weight is read."""
    path = _copy(checkpoint[0], str(tmp_path / "misaligned"))
    _edit_config(path, quantization_config={**QUANT_CONFIG, "weight_block_size": [96, 128]})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_up_proj: an output part of 256 rows per rank "
                                         r"is not whole blocks of 96"):
        make_runner(path)


# ----------------------------------------------------------------------------------------------- TP 2
def _tp2_work(paths: Dict[str, str]) -> Dict[str, object]:
    results: Dict[str, object] = {"ok": _run(paths["ok"], TP), "ep2": _run(paths["ok"], TP, ep_size=TP)}
    try:
        _run(paths["misaligned"], TP)
        results["misaligned"] = "loaded"
    except ValueError as e:
        results["misaligned"] = str(e)
    return results


@pytest.mark.slow  # two spawned ranks each load the model (about half a minute on 2 cores)
def test_tp2_matches_tp1(checkpoint, tmp_path):
    """TP 2 (q_b / kv_b / o_proj split by heads, the MLPs and experts by their 256 intermediate rows: whole
    blocks on each rank; and with --ep-size 2, whole experts) gives TP 1's tokens and logits; blocks of
    [256, 128] would cut the shards of 128."""
    path = checkpoint[0]
    misaligned = _copy(path, str(tmp_path / "tp_misaligned"))
    _edit_config(misaligned, quantization_config={**QUANT_CONFIG, "weight_block_size": [256, 128]})
    results = run_tp_ranks(_tp2_work, {"ok": path, "misaligned": misaligned})
    ref_logits, ref_outputs, ref_kinds = _run(path)
    for case in ("ok", "ep2"):  # experts split by their intermediate rows, then whole experts per rank
        logits, outputs, kinds = results[case]
        assert outputs == ref_outputs and kinds == ref_kinds, case
        assert (logits - ref_logits).abs().max().item() < 1e-4, case
    assert "rows per rank is not whole blocks of 256" in str(results["misaligned"])


# --------------------------------------------------------------------------------------------- kernel
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
@pytest.mark.parametrize("rows", [1, 3, 6, 17, 330])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_dequantized_product(kernel_build, block, rows, dtype):
    """csrc/linear_q8.c's linear_fp8_block against the float32 product of the dequantized weight: ragged last
    blocks both ways (300 outputs, 203 inputs: a last block with an 8-lane remainder and a scalar tail); one
    row (the prefetching path), tiles of 4 rows and their remainders, and 330 bf16 rows: more than one
    L2-sized block of rows (322 rows of 203 float32 inputs)."""
    from engine.kernels import library
    from engine.layers.block_fp8_linear import BlockFp8Weight, block_fp8_linear

    if library.linear() is None:
        pytest.skip("the CPU kernel library is not built here")
    if rows > 256 and dtype == torch.float32:
        pytest.skip("float32 batches over 256 rows take the torch path (layers/quantization.py)")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 203, generator=gen)
    q, scale = quantize_block_fp8(w, block)
    packed = BlockFp8Weight(q, scale, block)
    x = torch.randn(rows, 203, generator=gen).to(dtype)
    bias = torch.randn(300, generator=gen)
    ref = x.float() @ dequantize_block_fp8(q, scale, block).T + bias
    out = block_fp8_linear(x, packed, bias)
    assert out.dtype == dtype and out.shape == (rows, 300)
    if dtype == torch.float32:
        assert (out - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
    else:  # one rounding of the float32 result to bf16
        assert torch.equal(out, ref.to(torch.bfloat16)) or (out.float() - ref).abs().max().item() <= (
            ref.abs().max().item() * 2 ** -8)
    # The torch path (long batches, other devices) gives the same product.
    torch_path = torch.nn.functional.linear(x.float(), packed.dequantize(), bias)
    assert (torch_path - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
