"""Pre-quantized checkpoints (layers/quant_config.py, prequantized.py, int4.py, csrc/linear_q4.c).

Oracles: each 4-bit linear against the float64 product with its dequantized weight; whole models against
the same engine, unquantized in float32, on a checkpoint holding the dequantized weights the test itself
computed from what it wrote (compressed-tensors checkpoints by compressed-tensors' own compressor; AWQ
and GPTQ ones by tests/utils_quant.py to the formats' spec)."""

from __future__ import annotations

import json
import os
from typing import Callable, Dict

import pytest
import torch

from utils_models import BatchDriver, ExtendReq, build_tiny_model, make_runner
from utils_quant import awq_pack, gptq_pack_cols, gptq_pack_rows, write_dequantized_checkpoint, write_int4_checkpoint

from engine.layers import quantization as quant
from engine.layers.int4 import Int4Weight, int4_linear, pack_int4
from engine.layers.prequantized import unpack_awq, unpack_gptq_cols, unpack_gptq_rows
from engine.layers.quant_config import QUANTIZATION_METHODS, resolve_quantization

PROMPTS = [[3, 17, 250, 9, 44], [100, 7, 7, 7, 31, 480, 2, 65, 11], [401]]
STEPS = 6


@pytest.fixture(autouse=True)
def float_activations(monkeypatch) -> None:
    """The oracles here are the dequantized weights' float products: 4-bit layers keep float activations
    (linear_q4); the tests of the default int8 activations (linear_w4a8) set ENGINE_INT4_INT8_ACTIVATIONS=1."""
    monkeypatch.setenv("ENGINE_INT4_INT8_ACTIVATIONS", "0")


def test_int8_activations_are_the_cpu_default(monkeypatch) -> None:
    """As SGLang's CPU AWQ / GPTQ kernel (W4A8), 4-bit layers quantize their activations unless told not to."""
    monkeypatch.delenv("ENGINE_INT4_INT8_ACTIVATIONS")
    codes, scale, zero = torch.zeros(8, 64, dtype=torch.uint8), torch.ones(8, 2), torch.zeros(8, 2)
    assert pack_int4(codes, scale, zero, 32).int8_activations
    monkeypatch.setenv("ENGINE_INT4_INT8_ACTIVATIONS", "0")
    assert not pack_int4(codes, scale, zero, 32).int8_activations


# ------------------------------------------------------------------------------------ the formats
def test_word_orders_follow_the_specs() -> None:
    """One int32 word each, values 0..7 for 8 consecutive positions: AutoAWQ puts position AWQ_PACK_ORDER[i]
    in nibble i (0x75316420); GPTQ puts position i in nibble i (0x76543210)."""
    positions = torch.arange(8, dtype=torch.int32).reshape(1, 8)
    assert awq_pack(positions).tolist() == [[0x75316420]]
    assert gptq_pack_cols(positions).tolist() == [[0x76543210]]
    assert gptq_pack_rows(positions.t()).tolist() == [[0x76543210]]
    assert unpack_awq(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]
    assert unpack_gptq_cols(torch.tensor([[0x76543210]], dtype=torch.int32)).tolist() == [list(range(8))]
    assert unpack_gptq_rows(torch.tensor([[0x76543210]], dtype=torch.int32)).flatten().tolist() == list(range(8))
    # A high nibble of 15 makes the word negative as an int32: still 15.
    assert unpack_awq(torch.tensor([[-1]], dtype=torch.int32)).tolist() == [[15] * 8]


def _random_int4(n: int, k: int, group: int, seed: int, act_order: bool = False):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    zero = torch.randint(0, 16, (n, k // group), generator=gen).float()
    perm = torch.randperm(k, generator=gen) if act_order else None
    return pack_int4(codes, scale, zero, group, perm), codes, scale, zero, perm


def _int4_oracle(codes, scale, zero, group, perm) -> torch.Tensor:
    stored = (codes.double() - zero.double().repeat_interleave(group, 1)) * scale.double().repeat_interleave(group, 1)
    if perm is None:
        return stored
    weight = torch.empty_like(stored)
    weight[:, perm] = stored  # stored column j is input perm[j]
    return weight


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 35])
def test_int4_linear_equals_dequantized_product(kernel_build: str, group: int, rows: int, monkeypatch) -> None:
    # Up to 32 rows the kernel, 35 the torch path; n = 37: channel pairs plus one.
    monkeypatch.setattr(quant, "Q8_MAX_ROWS_F32", 32)
    monkeypatch.setattr(quant, "Q8_MAX_ROWS_BF16", 32)
    for act_order in (False, True):
        w, codes, scale, zero, perm = _random_int4(37, 256, group, rows + group, act_order)
        weight = _int4_oracle(codes, scale, zero, group, perm)
        assert torch.allclose(w.dequantize().double(), weight, atol=1e-6)
        gen = torch.Generator().manual_seed(rows)
        x, bias = torch.randn(rows, 256, generator=gen), torch.randn(37, generator=gen)
        for b in (None, bias):
            out = int4_linear(x, w, b)
            expected = x.double() @ weight.T + (0 if b is None else b.double())
            assert out.dtype == torch.float32 and out.shape == (rows, 37)
            torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
        out = int4_linear(x.to(torch.bfloat16).reshape(1, rows, 256), w, None)
        expected = x.to(torch.bfloat16).double() @ (weight if rows <= 32 else w.dequantize(torch.bfloat16).double()).T
        assert out.dtype == torch.bfloat16 and out.shape == (1, rows, 37)
        assert bool(((out[0].double() - expected).abs() <= expected.abs() * 2.0 ** -8 + 1e-2).all())


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_int8_activations_exact_integer_sums(kernel_build: str, int8_isa: str, group: int, monkeypatch) -> None:
    """ENGINE_INT4_INT8_ACTIVATIONS: the kernel (AMX-INT8 from 8 rows where the group is a multiple of 64: blocks of
    16 rows and of 4 x 16 channels, a short group of blocks, channels past the last block; VNNI's tiles of 1 row x
    4 blocks of 16 channels, 2 x 2 and up to 4 x 1; AVX2's 2 x 1; the portable loop; n = 37 leaves 11 channels of
    a padded block) and the torch path (35 rows) equal the float64 of sum_g s_g * xs_g * (q_x .
    codes)_g + b_g * (sum of x over g), the activations quantized per row and group as quantize_activations does,
    up to float32 summation order; act-order weights see their permuted inputs."""
    monkeypatch.setattr(quant, "Q8_MAX_ROWS_F32", 32)
    monkeypatch.setenv("ENGINE_INT4_INT8_ACTIVATIONS", "1")
    _int4_int8_cases(group)


def _int4_int8_cases(group: int) -> None:
    # k = 320: 40 steps of 8 inputs, AMX's unpacking 16 steps at a time leaves 8 (groups of 32 and 64 only)
    cases = [(37, 1, 256), (37, 2, 256), (37, 3, 256), (37, 16, 256), (100, 20, 256), (64, 4, 256), (37, 35, 256),
             (64, 8, 256), (150, 6, 256)]
    for n, rows, k in cases + ([(37, 1, 320), (37, 9, 320)] if 320 % group == 0 else []):
        for act_order in (False, True):
            w, codes, scale, zero, perm = _random_int4(n, k, group, rows + group, act_order)
            assert w.int8_activations
            gen = torch.Generator().manual_seed(rows)
            x, bias = torch.randn(rows, k, generator=gen), torch.randn(n, generator=gen)
            stored = x if perm is None else x[:, perm]
            values, xs = quant.quantize_activations(stored.reshape(-1, group))
            values, xs = values.double().view(rows, -1, group), xs.double().view(rows, -1)
            c = codes.double().view(n, -1, group)
            integer = torch.einsum("mgd,ngd->mng", values, c)  # exact
            s, b = scale.double(), -zero.double() * scale.double()
            xsum = stored.double().view(rows, -1, group).sum(-1)
            terms = integer * s[None] * xs[:, None] + b[None] * xsum[:, None]
            expected = terms.sum(-1) + bias.double()
            # float32 sums of the group's x err by ~eps * sum |x|, not * |sum x|: the bound takes the former.
            xabs = stored.double().abs().view(rows, -1, group).sum(-1)
            magnitude = ((integer * s[None] * xs[:, None]).abs() + b.abs()[None] * xabs[:, None]).sum(-1)
            magnitude += bias.double().abs()
            out = int4_linear(x, w, bias)
            assert out.dtype == torch.float32 and out.shape == (rows, n)
            err = (out.double() - expected).abs()
            assert bool((err <= magnitude * 1e-5).all()), (n, rows, act_order, float((err / magnitude).max()))


def test_int4_layouts_hold_the_same_weight() -> None:
    """The int8 activations' layout (rows in padded blocks of 16) and the float activations' one give back the same
    codes, scales and offsets; off the CPU a weight takes the float activations' layout (the Triton GEMM's)."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (37, 96), generator=gen)
    scale, zero = torch.rand(37, 3, generator=gen), torch.randint(0, 16, (37, 3), generator=gen).float()
    lanes = pack_int4(codes, scale, zero, 32, int8_activations=True)
    rows = pack_int4(codes, scale, zero, 32, int8_activations=False)
    assert tuple(lanes.packed.shape) == (3, 12, 64) and tuple(lanes.scale.shape) == (3, 3, 16)
    assert tuple(rows.packed.shape) == (37, 48) and (lanes.n, lanes.k) == (rows.n, rows.k) == (37, 96)
    for w in (lanes, rows):
        assert torch.equal(w.codes(), codes.to(torch.uint8))
        assert torch.equal(w.scales(), scale) and torch.equal(w.offsets(), -zero * scale)
    assert bool((lanes.scale.transpose(1, 2).reshape(48, 3)[37:] == 0).all())  # the padding rows: zero
    moved = lanes.to("meta")
    assert not moved.int8_activations and tuple(moved.packed.shape) == (37, 48) and moved.packed.is_meta


def test_int4_kernel_runs_for_decode_batches() -> None:
    from engine.kernels import library

    if library.linear() is None:
        pytest.skip("no kernel library on this machine")
    w = _random_int4(16, 64, 32, 0)[0]
    calls = []
    real = library.linear()

    class Spy:
        def linear_q4(self, *args: int) -> None:
            calls.append(args[1])
            real.linear_q4(*args)

    import unittest.mock as mock

    with mock.patch.object(library, "linear", lambda: Spy()):
        int4_linear(torch.randn(3, 64), w, None)
        int4_linear(torch.randn(quant.Q8_MAX_ROWS_F32 + 1, 64), w, None)  # a long float32 prefill: torch
    assert calls == [3]


def test_pack_int4_refuses_bad_shapes() -> None:
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_int4(codes, torch.ones(4, 4), torch.zeros(4, 4), 16)
    with pytest.raises(ValueError, match=r"scales must be \[4, 2\]"):
        pack_int4(codes, torch.ones(4, 3), torch.zeros(4, 2), 32)
    with pytest.raises(ValueError, match="0..15"):
        pack_int4(codes + 16, torch.ones(4, 2), torch.zeros(4, 2), 32)


# ------------------------------------------------------------------------------ config and flags
def _awq_config(**over):
    return {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                    "version": "gemm", **over}}


def test_flag_and_checkpoint_method() -> None:
    assert resolve_quantization({}, None) is None
    assert resolve_quantization({}, "fp8") is None  # online
    q = resolve_quantization(_awq_config(), None)
    assert q is not None and (q.method, q.weights, q.group_size) == ("awq", "int4", 128)
    assert resolve_quantization(_awq_config(), "awq") == q
    assert resolve_quantization(_awq_config(), "awq_marlin") == q  # SGLang's GPU kernel name for the format
    for flag in ("gptq", "fp8", "w8a8_int8", "compressed-tensors"):
        with pytest.raises(ValueError, match=r"model config \(awq\) does not match .* argument \(" + flag):
            resolve_quantization(_awq_config(), flag)
    with pytest.raises(ValueError, match="no quantization_config"):
        resolve_quantization({}, "gptq")
    from engine.server_args import QUANTIZATION_METHODS as FLAG_CHOICES

    assert FLAG_CHOICES == QUANTIZATION_METHODS


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes', which is not supported"),
    (_awq_config(bits=8)["quantization_config"], "awq with 8 bits"),
    (_awq_config(group_size=48)["quantization_config"], "group_size 48"),
    (_awq_config(version="gemv")["quantization_config"], "awq version 'gemv'"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "gptq with 3 bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": "yes"}, "lm_head must be true or false"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {}},
     "format 'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16}}}},
     "group_size 16"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}}},
     "static activation scales for 8-bit weights, activations 8-bit 'int'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}}},
     "static activation scales for 4-bit weights"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 128}}}},
     "weight strategy 'group'"),
])
def test_unsupported_checkpoints_refused(config, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_quantization({"quantization_config": config}, None)


# ----------------------------------------------------------------------------------- whole models
def _run(runner) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill logits (the torch path) and STEPS greedy decode steps (the kernels) of PROMPTS."""
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    out, tokens = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, PROMPTS)]))
    logits = [out.next_token_logits.float().clone()]
    outputs = [[int(t)] for t in tokens]
    lens = [len(p) for p in PROMPTS]
    for _ in range(STEPS):
        out, tokens = driver.run(driver.decode_batch(rows, [o[-1] for o in outputs], lens))
        logits.append(out.next_token_logits.float().clone())
        lens = [n + 1 for n in lens]
        for o, t in zip(outputs, tokens):
            o.append(int(t))
    return torch.cat(logits), outputs


def _along(runner, prompts: list[list[int]], steps: int, chosen: list[list[int]] | None):
    """Next-token logits of the prompts and of `steps` decode steps fed `chosen` (or the runner's own
    greedy tokens when None): two models compared at the same contexts."""
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in prompts]
    out, _ = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, prompts)]))
    logits = [out.next_token_logits.float().clone()]
    chosen = [[int(t)] for t in out.next_token_logits.argmax(-1)] if chosen is None else chosen
    own = len(chosen[0]) == 1
    lens = [len(p) for p in prompts]
    for step in range(steps):
        out, _ = driver.run(driver.decode_batch(rows, [c[step] for c in chosen], lens))
        lens = [n + 1 for n in lens]
        logits.append(out.next_token_logits.float().clone())
        if own:
            for c, t in zip(chosen, out.next_token_logits.argmax(-1).tolist()):
                c.append(int(t))
    return torch.cat(logits), chosen


def _kl_top1(reference_dir: str, quantized_dir: str, vocab: int) -> tuple[float, float]:
    """Mean KL(reference || quantized) of the next-token distributions and top-1 agreement, over 8 random
    prompts' prefill and 4 decode steps along the reference's greedy tokens."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, vocab, (12 + i,), generator=gen).tolist() for i in range(8)]
    reference, chosen = _along(make_runner(reference_dir), prompts, 4, None)
    other, _ = _along(make_runner(quantized_dir), prompts, 4, chosen)
    log_p, log_q = reference.log_softmax(-1), other.log_softmax(-1)
    return (float((log_p.exp() * (log_p - log_q)).sum(-1).mean()),
            float((reference.argmax(-1) == other.argmax(-1)).float().mean()))


@pytest.fixture(scope="module")
def float_llama(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("llama"))
    build_tiny_model(path, "llama")
    return path


# The fast lane keeps one AWQ and one act-order GPTQ case; the full suite runs every one.
@pytest.mark.parametrize("fmt, group, sym, desc_act", [
    ("awq", 32, False, False), pytest.param("awq", 64, False, False, marks=pytest.mark.slow),
    pytest.param("awq", -1, False, False, marks=pytest.mark.slow),
    pytest.param("gptq", 32, True, False, marks=pytest.mark.slow), ("gptq", 32, False, True),
])
def test_int4_checkpoint_equals_its_dequantized_weights(tmp_path, float_llama, fmt: str, group: int,
                                                        sym: bool, desc_act: bool) -> None:
    qpath, oracle = str(tmp_path / "q"), str(tmp_path / "oracle")
    weights = write_int4_checkpoint(float_llama, qpath, fmt, group=group, sym=sym, desc_act=desc_act)
    write_dequantized_checkpoint(float_llama, oracle, weights)
    expected_logits, expected_tokens = _run(make_runner(oracle))
    runner = make_runner(qpath)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.packed_weight
    assert isinstance(qkv, Int4Weight) and qkv.packed.dtype == torch.uint8 and (qkv.perm is not None) == desc_act
    assert runner.model.lm_head.weight.dtype == torch.float32  # not quantized
    logits, tokens = _run(runner)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert tokens == expected_tokens
    kl, top1 = _kl_top1(float_llama, qpath, 512)
    # Measured (Zen 1, 40 positions): KL 0.19-0.28, top-1 0.38-0.60 against the float32 model. This random
    # Llama (weights 1.5 / sqrt(k)) has sharp logits that magnify round-to-nearest 4-bit error (~8% of each
    # weight; int8's is 0.4%, KL 2e-3); the built-in model's figures are in test_builtin_model_awq.
    print(f"\n{fmt} group {group} sym {sym} desc_act {desc_act}: mean KL {kl:.2e}, top-1 {top1:.3f} vs float32")
    assert kl < 0.5 and top1 >= 0.3


@pytest.mark.parametrize("tied, desc_act", [(False, False), (True, True)])
def test_gptq_quantized_lm_head(tmp_path, tied: bool, desc_act: bool) -> None:
    """GPTQ's lm_head true: the head loads its 4-bit tensors (vocabulary 504: 8 padding rows at tp 1) and its
    logits are the float product with the dequantized head; a tied embedding stays the float matrix."""
    src, qpath, oracle = str(tmp_path / "src"), str(tmp_path / "q"), str(tmp_path / "oracle")
    build_tiny_model(src, "llama", vocab_size=504, tie_word_embeddings=tied)
    weights = write_int4_checkpoint(src, qpath, "gptq", group=32, desc_act=desc_act, lm_head=True)
    assert "lm_head.weight" in weights
    assert resolve_quantization(json.load(open(os.path.join(qpath, "config.json"))), None).lm_head
    write_dequantized_checkpoint(src, oracle, weights)
    runner = make_runner(qpath)
    model = runner.model
    head = model.lm_head.packed_weight
    assert isinstance(head, Int4Weight) and (head.n, head.k) == (512, 64) and (head.perm is not None) == desc_act
    dequantized = head.dequantize()
    torch.testing.assert_close(dequantized[:504], weights["lm_head.weight"], rtol=0, atol=1e-6)
    assert not dequantized[504:].any()  # the padding rows
    embed = model.model.embed_tokens.weight
    assert embed.dtype == torch.float32 and embed.shape == (512, 64)
    if tied:  # the embedding is still the checkpoint's float matrix, not the quantized head
        from safetensors.torch import load_file

        torch.testing.assert_close(embed[:504], load_file(os.path.join(src, "model.safetensors"))["model.embed_tokens.weight"])
    # The head's product, on the kernel's decode path and the torch path, against the float64 oracle.
    hidden = torch.randn(20, 64, generator=torch.Generator().manual_seed(3))
    for rows in (hidden[:1], hidden):
        got = model.logits_processor.compute_logits(rows, model.lm_head)
        expected = (rows.double() @ weights["lm_head.weight"].double().T).float()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    logits, tokens = _run(runner)
    expected_logits, expected_tokens = _run(make_runner(oracle))
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert tokens == expected_tokens


def test_quantize_lm_head_on_a_4bit_checkpoint(tmp_path, float_llama) -> None:
    """--quantize-lm-head on an AWQ checkpoint: its float head quantized per vocabulary row as w8a8_int8 does (int8
    activations); the logits equal the same checkpoint's with that head computed by quantized_linear; a GPTQ
    checkpoint whose head is 4-bit already is refused."""
    qpath = str(tmp_path / "q")
    write_int4_checkpoint(float_llama, qpath, "awq", group=32)
    plain, runner = make_runner(qpath), make_runner(qpath, quantize_lm_head=True)
    head = runner.model.lm_head.packed_weight
    assert isinstance(head, quant.QuantizedWeight) and head.qweight.dtype == torch.int8 and head.int8_activations
    assert not isinstance(plain.model.lm_head.packed_weight, quant.QuantizedWeight)
    hidden = torch.randn(3, plain.model.lm_head.weight.shape[1])
    expected = quant.quantized_linear(hidden, quant.quantize_weight(plain.model.lm_head.weight.data, "w8a8_int8"), None)
    assert torch.equal(quant.quantized_linear(hidden, head, None), expected)
    logits, tokens = _run(runner)
    assert logits.isfinite().all() and len(tokens) > 0
    gptq = str(tmp_path / "gptq")
    write_int4_checkpoint(float_llama, gptq, "gptq", group=32, lm_head=True)
    with pytest.raises(ValueError, match="its head quantized too"):
        make_runner(gptq, quantize_lm_head=True)


def test_quantized_lm_head_tensors_refused_without_the_flag(tmp_path, float_llama) -> None:
    qpath = str(tmp_path / "q")
    write_int4_checkpoint(float_llama, qpath, "gptq", group=32, lm_head=True)
    config = json.load(open(os.path.join(qpath, "config.json")))
    config["quantization_config"]["lm_head"] = False
    json.dump(config, open(os.path.join(qpath, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"lm_head\.\w+ is quantized, but lm_head is not"):
        make_runner(qpath)


def test_awq_modules_to_not_convert_stay_float(tmp_path, float_llama) -> None:
    qpath, oracle = str(tmp_path / "q"), str(tmp_path / "oracle")
    weights = write_int4_checkpoint(float_llama, qpath, "awq", group=32, skip=("mlp.down_proj",))
    write_dequantized_checkpoint(float_llama, oracle, weights)
    runner = make_runner(qpath)
    down = runner.model.model.layers[1].mlp.down_proj
    assert not isinstance(down.packed_weight, Int4Weight) and down.weight.dtype == torch.float32
    logits, tokens = _run(runner)
    expected_logits, expected_tokens = _run(make_runner(oracle))
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert tokens == expected_tokens


# FP8: llm-compressor's static preset (per-tensor input_scale tensors, loaded and not applied: quant_config.py).
@pytest.mark.parametrize("preset, strategy", [("FP8_DYNAMIC", "channel"),
                                              pytest.param("FP8_DYNAMIC", "tensor", marks=pytest.mark.slow),
                                              ("W8A8", "channel"), ("FP8", "tensor")])
def test_compressed_tensors_checkpoint_equals_its_dequantized_weights(tmp_path, preset: str, strategy: str) -> None:
    pytest.importorskip("compressed_tensors")
    from utils_quant import write_compressed_tensors_checkpoint

    src, qpath, oracle = str(tmp_path / "src"), str(tmp_path / "q"), str(tmp_path / "oracle")
    model = build_tiny_model(src, "llama")
    ignore = ("lm_head", "re:.*layers\\.1\\.mlp\\.down_proj$")
    weights = write_compressed_tensors_checkpoint(model, qpath, preset, strategy, ignore)
    assert "model.layers.1.mlp.down_proj.weight" not in weights and len(weights) == 13
    write_dequantized_checkpoint(src, oracle, weights)
    config = json.load(open(os.path.join(qpath, "config.json")))["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    runner = make_runner(qpath)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.packed_weight
    assert isinstance(qkv, quant.QuantizedWeight)
    assert qkv.qweight.dtype == (torch.float8_e4m3fn if preset.startswith("FP8") else torch.int8)
    if strategy == "tensor":  # q, k and v: one scale each, on their rows
        q_rows = runner.model.model.layers[0].self_attn.qkv_proj.q_size
        assert len(set(qkv.scale[:q_rows].tolist())) == 1 and len(set(qkv.scale.tolist())) == 3
    assert not isinstance(runner.model.model.layers[1].mlp.down_proj.packed_weight, quant.QuantizedWeight)
    logits, tokens = _run(runner)
    expected_logits, expected_tokens = _run(make_runner(oracle))
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert tokens == expected_tokens


def test_compressed_tensors_static_activation_scale_must_be_one_positive_value(tmp_path) -> None:
    pytest.importorskip("compressed_tensors")
    from safetensors.torch import load_file, save_file
    from utils_quant import write_compressed_tensors_checkpoint

    qpath = str(tmp_path / "q")
    write_compressed_tensors_checkpoint(build_tiny_model(str(tmp_path / "src"), "llama"), qpath, "FP8", "tensor")
    tensors = load_file(os.path.join(qpath, "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.input_scale"] = torch.tensor([-1.0])
    save_file(tensors, os.path.join(qpath, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="up_proj.input_scale: a static per-tensor activation scale is one positive"):
        make_runner(qpath)


@pytest.mark.slow  # the built-in model, twice
@pytest.mark.parametrize("int8_activations", [False, True])
def test_builtin_model_awq(int8_activations: bool, monkeypatch) -> None:
    """AWQ (group 128, down_proj kept float: its 688 inputs are no whole groups) on the built-in model: the
    next-token distributions against the float32 model, with float activations and with
    ENGINE_INT4_INT8_ACTIVATIONS."""
    import tempfile

    from engine.builtin_model import ensure_builtin_model

    monkeypatch.setenv("ENGINE_INT4_INT8_ACTIVATIONS", str(int(int8_activations)))
    src = ensure_builtin_model()
    with tempfile.TemporaryDirectory() as tmp:
        write_int4_checkpoint(src, tmp, "awq", group=128, skip=("down_proj",))
        kl, top1 = _kl_top1(src, tmp, 2560)
    # Measured (Zen 1, 40 positions): KL 3.3e-3, top-1 0.60 (its random prompts give near-ties: top-1 moves
    # while the KL stays small; fp8's is 2.6e-4 / 0.90). With int8 activations (Xeon, VNNI): 3.3e-3, 0.575.
    print(f"\nbuilt-in model awq group 128, int8 activations {int8_activations}: mean KL {kl:.2e}, top-1 {top1:.3f} "
          "vs float32")
    assert kl < 2e-2 and top1 >= 0.5


@pytest.mark.parametrize("preset, strategy, group", [("W4A16", "group", 32), ("W4A16_ASYM", "group", 64),
                                                     ("W4A16", "channel", None)])
def test_compressed_tensors_4bit_checkpoint_equals_its_dequantized_weights(tmp_path, preset: str, strategy: str,
                                                                           group: int | None) -> None:
    """llm-compressor's W4A16 (compressed-tensors pack-quantized), written by compressed-tensors itself."""
    pytest.importorskip("compressed_tensors")
    from utils_quant import write_compressed_tensors_checkpoint

    src, qpath, oracle = str(tmp_path / "src"), str(tmp_path / "q"), str(tmp_path / "oracle")
    weights = write_compressed_tensors_checkpoint(build_tiny_model(src, "llama"), qpath, preset, strategy,
                                                  group_size=group)
    assert json.load(open(os.path.join(qpath, "config.json")))["quantization_config"]["format"] == "pack-quantized"
    write_dequantized_checkpoint(src, oracle, weights)
    runner = make_runner(qpath)
    assert isinstance(runner.model.model.layers[0].mlp.down_proj.packed_weight, Int4Weight)
    logits, tokens = _run(runner)
    expected_logits, expected_tokens = _run(make_runner(oracle))
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
    assert tokens == expected_tokens


# ------------------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory, float_llama):
    path = str(tmp_path_factory.mktemp("awq"))
    write_int4_checkpoint(float_llama, path, "awq", group=32)
    return path


def _edit_tensors(src: str, dst: str, edit: Callable[[Dict[str, torch.Tensor]], object]) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_flag_mismatch_refused_at_start(awq_checkpoint) -> None:
    with pytest.raises(ValueError, match=r"model config \(awq\) does not match .* \(gptq\)"):
        make_runner(awq_checkpoint, quantization="gptq")
    with pytest.raises(ValueError, match=r"does not match .* \(w8a8_int8\)"):
        make_runner(awq_checkpoint, quantization="w8a8_int8")


def test_missing_or_mismatched_tensors_refused(tmp_path, awq_checkpoint) -> None:
    prefix = "model.layers.0.self_attn.k_proj."
    missing = _edit_tensors(awq_checkpoint, str(tmp_path / "missing"), lambda t: t.pop(prefix + "scales"))
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model.layers.0.self_attn.qkv_proj.scales\[k\]"):
        make_runner(missing)

    def wrong_groups(t):
        t[prefix + "scales"] = t[prefix + "scales"][:1]

    with pytest.raises(ValueError, match=r"weight model.layers.0.self_attn.k_proj.scales: .*shape mismatch"):
        make_runner(_edit_tensors(awq_checkpoint, str(tmp_path / "groups"), wrong_groups))

    def float_qweight(t):
        t[prefix + "qweight"] = t[prefix + "qweight"].float()

    with pytest.raises(ValueError, match=r"k_proj.qweight is float32; this int32 tensor"):
        make_runner(_edit_tensors(awq_checkpoint, str(tmp_path / "dtype"), float_qweight))


def test_group_size_that_does_not_divide_refused(tmp_path, float_llama) -> None:
    path = str(tmp_path / "q")
    write_int4_checkpoint(float_llama, path, "awq", group=32)
    config = json.load(open(os.path.join(path, "config.json")))
    config["quantization_config"]["group_size"] = 96  # 64 inputs per q/k/v row
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match="not whole groups of 96"):
        make_runner(path)


def test_lora_refused_with_a_prequantized_checkpoint(awq_checkpoint) -> None:
    with pytest.raises(ValueError, match="LoRA adapters are not supported yet with a awq-quantized checkpoint"):
        make_runner(awq_checkpoint, enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj"])


def test_weight_updates_refused(awq_checkpoint) -> None:
    runner = make_runner(awq_checkpoint)
    ok, message = runner.weight_updater.update_from_disk(awq_checkpoint)
    assert not ok and "not supported yet with --quantization" in message


@pytest.mark.parametrize("kind", ["awq", "online-fp8"])
def test_released_and_resumed_weights_keep_generating_the_same(tmp_path, float_llama, awq_checkpoint, kind: str) -> None:
    """release_memory_occupation("weights") then resume: a quantized layer's weights are its packed ones,
    which must come back, not be dropped as a stale packed copy."""
    runner = make_runner(awq_checkpoint) if kind == "awq" else make_runner(float_llama, quantization="fp8")
    before = _run(runner)
    runner.memory_saver.release(["weights"])
    runner.memory_saver.resume(["weights"])
    after = _run(runner)
    torch.testing.assert_close(after[0], before[0], rtol=0, atol=0)
    assert after[1] == before[1]


def test_compressed_tensors_zero_points_of_a_symmetric_scheme(tmp_path) -> None:
    """Some writers store all-zero weight_zero_point tensors for symmetric schemes: dropped; non-zero
    ones contradict the scheme: refused naming the tensor."""
    pytest.importorskip("compressed_tensors")
    from utils_quant import write_compressed_tensors_checkpoint

    src, qpath = str(tmp_path / "src"), str(tmp_path / "q")
    write_compressed_tensors_checkpoint(build_tiny_model(src, "llama"), qpath, "W8A8")
    reference = _run(make_runner(qpath))
    name = "model.layers.0.mlp.up_proj.weight_zero_point"

    def zeros(t):
        t[name] = torch.zeros(128, 1, dtype=torch.int8)

    logits, tokens = _run(make_runner(_edit_tensors(qpath, str(tmp_path / "zeros"), zeros)))
    assert torch.equal(logits, reference[0]) and tokens == reference[1]

    def ones(t):
        t[name] = torch.ones(128, 1, dtype=torch.int8)

    with pytest.raises(ValueError, match=f"{name} has non-zero zero points"):
        make_runner(_edit_tensors(qpath, str(tmp_path / "ones"), ones))
