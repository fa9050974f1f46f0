"""gpt-oss checkpoints with MXFP4 experts (the published format: `quant_method` "mxfp4", `*_blocks`
e2m1 codes and `*_scales` e8m0 exponents per 32 inputs): kept packed on the CPU and run by the MXFP4
kernel (4.25 bits per expert weight), or dequantized while loading where the kernel is missing
(models/gpt_oss.py). Oracle: transformers loading the same checkpoint with its own MXFP4
dequantization (Mxfp4Config(dequantize=True)), token for token past the sliding window, both ways; the
dequantization equals transformers' element for element; malformed checkpoints are refused by name."""

from __future__ import annotations

import json
import os
from typing import Dict

import pytest
import torch

from sched_utils import Harness
from utils_models import TINY_SWA, build_tiny_model, hf_greedy

from engine.layers.mxfp4 import BITS_PER_WEIGHT, FP4_E2M1_VALUES, dequantize_mxfp4, mxfp4_kernel_available

N_NEW = 20


def _quantize(weight: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Our layout [E, in, out] -> MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32] (the
    format's spec: per 32 inputs a power-of-two scale putting the largest magnitude at most 6, each value
    the nearest e2m1 code, two codes per byte, the low nibble first)."""
    rows = weight.transpose(1, 2).float()
    e, out, cols = rows.shape
    groups = rows.reshape(e, out, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=1e-30)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    lut = torch.tensor(FP4_E2M1_VALUES)
    codes = (groups / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1).sub(lut).abs().argmin(-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {"blocks": blocks.contiguous(), "scales": (exponent + 127).to(torch.uint8).contiguous()}


def _write_mxfp4(path: str) -> None:
    """Replace the checkpoint's expert projections by their MXFP4 form and say so in config.json."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        for part, tensor in _quantize(weights.pop(name)).items():
            weights[f"{name}_{part}"] = tensor
    save_file(weights, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def mxfp4_model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    build_tiny_model(path, "gpt_oss", seed=4, **TINY_SWA["gpt_oss"])
    _write_mxfp4(path)
    return path


def _transformers_model(path: str):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                quantization_config=Mxfp4Config(dequantize=True)).eval()


def test_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 135, (3, 64, 4), dtype=torch.uint8, generator=gen)
    ours = dequantize_mxfp4(blocks, scales)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == theirs.shape == (3, 128, 64)
    assert torch.equal(ours, theirs)


def _experts(worker):
    return [layer.mlp.experts for layer in worker.model_runner.model.model.decoder_layers]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "dequantized"])
def test_greedy_equals_transformers_on_the_mxfp4_checkpoint(mxfp4_model, packed, monkeypatch):
    import engine.models.gpt_oss as gpt_oss
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    if packed and not mxfp4_kernel_available():
        pytest.skip("no native kernel library here (no C compiler)")
    if not packed:  # as on a GPU, or a CPU without the library: dequantized while loading
        monkeypatch.setattr(gpt_oss, "mxfp4_kernel_available", lambda: False)
    hf = _transformers_model(mxfp4_model)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (40, 90)]  # past the window of 16
    expected = [hf_greedy(hf, p, N_NEW) for p in prompts]
    for flag in (None, "mxfp4"):  # detected from config.json, or named as SGLang users do
        args = ServerArgs(model_path=mxfp4_model, device="cpu", max_total_tokens=2048, quantization=flag)
        worker = TpModelWorker(args)
        for experts in _experts(worker):
            assert experts.mxfp4 == packed
            num_weights = 3 * experts.num_local * experts.inter * experts.w2_weight_bias.shape[1]  # gate, up, down
            bits = 32.0 if not packed else BITS_PER_WEIGHT  # float32 dequantized; 4 + 8 / 32 packed
            assert experts.expert_bytes() * 8 == bits * num_weights
            if packed:
                assert {experts.w13_blocks.dtype, experts.w2_scales.dtype} == {torch.uint8}
                assert not hasattr(experts, "w13_weight")
        h = Harness(worker=worker, max_total_tokens=2048)
        rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
        h.run_until_idle()
        assert [h.outputs[r].output_ids for r in rids] == expected, flag


def test_packed_experts_equal_the_dequantized_ones(mxfp4_model, monkeypatch):
    """One layer's experts, packed and dequantized, on the same rows: the products differ only by float32
    summation order."""
    import engine.models.gpt_oss as gpt_oss

    from utils_models import make_runner

    if not mxfp4_kernel_available():
        pytest.skip("no native kernel library here (no C compiler)")
    packed = make_runner(mxfp4_model).model.model.decoder_layers[1].mlp.experts
    monkeypatch.setattr(gpt_oss, "mxfp4_kernel_available", lambda: False)
    dense = make_runner(mxfp4_model).model.model.decoder_layers[1].mlp.experts
    assert packed.mxfp4 and not dense.mxfp4
    # Which path each takes: the MXFP4 kernel's linears, the fused MoE's native path.
    calls = {"mxfp4_linear": 0, "fused_moe_native": 0}

    def counted(name):
        inner = getattr(gpt_oss, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return inner(*args, **kwargs)

        return call

    for name in calls:
        monkeypatch.setattr(gpt_oss, name, counted(name))
    gen = torch.Generator().manual_seed(9)
    for tokens in (1, 16, 70):
        x = torch.randn(tokens, dense.w13_weight.shape[2], generator=gen)
        ids = torch.stack([torch.randperm(dense.num_local, generator=gen)[:2] for _ in range(tokens)])
        weights = torch.softmax(torch.randn(tokens, 2, generator=gen), dim=-1)
        ours, ref = packed(x, ids, weights), dense(x, ids, weights)
        assert (ours - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())
    assert calls["fused_moe_native"] == 3 and calls["mxfp4_linear"] > 0


def test_malformed_and_mismatched_checkpoints_are_refused(tmp_path, mxfp4_model):
    from safetensors.torch import load_file, save_file

    from utils_models import make_runner

    # Blocks without their scales.
    broken = tmp_path / "unpaired"
    broken.mkdir()
    for name in os.listdir(mxfp4_model):
        data = open(os.path.join(mxfp4_model, name), "rb").read()
        (broken / name).write_bytes(data)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="down_proj: MXFP4 blocks without their scales"):
        make_runner(str(broken))
    # Scales of the wrong shape.
    weights["model.layers.0.mlp.experts.down_proj_scales"] = torch.zeros(4, 64, 3, dtype=torch.uint8)
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="do not match"):
        make_runner(str(broken))
    # mxfp4 on another architecture, and --quantization naming another method.
    llama = str(tmp_path / "llama")
    build_tiny_model(llama, seed=1)
    with open(os.path.join(llama, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4"}
    with open(os.path.join(llama, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="gpt-oss"):
        make_runner(llama)
    with pytest.raises(ValueError, match="does not match"):
        make_runner(mxfp4_model, quantization="fp8")
