"""Pre-quantized checkpoints written by the tests (and benchmarks/bench_quant.py) to each format's spec.

AWQ and GPTQ tooling needs a GPU, so a float checkpoint's projections are quantized here by
round-to-nearest per group and packed as the formats lay them out:

- AWQ (AutoAWQ, version gemm): qweight int32 [in, out / 8] and qzeros int32 [groups, out / 8], each word
  holding 8 consecutive outputs with output AWQ_PACK_ORDER[i] in nibble i; scales fp16 [groups, out];
  W = (q - zero) * scale.
- GPTQ (AutoGPTQ, checkpoint_format gptq): qweight int32 [in / 8, out], each word 8 consecutive inputs in
  nibble order; qzeros int32 [groups, out / 8], 8 consecutive outputs in nibble order, holding zero - 1;
  scales fp16 [groups, out]; g_idx int32 [in], each input's group (act-order: groups formed over a
  permutation of the inputs).

Each writer also returns the weights the checkpoint stands for (float32, dequantized here from the
codes it wrote), the oracle the engine's loading must reproduce. This packing is written from the
spec on its own, independent of engine/layers/prequantized.py's unpacking.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Dict, Optional, Tuple

import torch

AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rtn_int4(w: torch.Tensor, group: int, sym: bool, min_zero: int = 0,
             order: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of w [out, in] in groups of `group` inputs (taken in `order`,
    act-order, when given). Returns codes [out, in] (input order), scales fp16 and zeros [out, groups],
    and g_idx [in]."""
    out_f, in_f = w.shape
    order = torch.arange(in_f) if order is None else order
    g_idx = torch.empty(in_f, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_f) // group).to(torch.int32)
    groups = in_f // group
    wg = w.float()[:, order].reshape(out_f, groups, group)
    if sym:
        amax = wg.abs().amax(dim=2).clamp(min=1e-8)
        scale = (2 * amax / 15).half()
        zero = torch.full((out_f, groups), 8.0)
    else:
        lo, hi = wg.amin(dim=2).clamp(max=0), wg.amax(dim=2).clamp(min=0)
        scale = ((hi - lo).clamp(min=1e-8) / 15).half()
        zero = (-lo / scale.float()).round().clamp(min_zero, 15)
    q = (wg / scale.float()[:, :, None] + zero[:, :, None]).round().clamp(0, 15)
    codes = torch.empty(out_f, in_f, dtype=torch.int32)
    codes[:, order] = q.reshape(out_f, in_f).to(torch.int32)
    return codes, scale, zero.to(torch.int32), g_idx


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    g = g_idx.long()
    return (codes.float() - zero.float()[:, g]) * scale.float()[:, g]


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 words, value i in bits 4i..4i+3."""
    word = torch.zeros(nibbles.shape[:-1], dtype=torch.int64)
    for i in range(8):
        word |= (nibbles[..., i].to(torch.int64) & 0xF) << (4 * i)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, out] -> [rows, out / 8], AutoAWQ's order inside each word."""
    rows, cols = values.shape
    return _words(values.reshape(rows, cols // 8, 8)[:, :, AWQ_PACK_ORDER])


def gptq_pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[in, out] -> [in / 8, out]: 8 consecutive inputs per word, in order."""
    rows, cols = values.shape
    return _words(values.reshape(rows // 8, 8, cols).permute(0, 2, 1))


def gptq_pack_cols(values: torch.Tensor) -> torch.Tensor:
    """[groups, out] -> [groups, out / 8]: 8 consecutive outputs per word, in order."""
    rows, cols = values.shape
    return _words(values.reshape(rows, cols // 8, 8))


def write_int4_checkpoint(src: str, dst: str, fmt: str, group: int = 32, sym: bool = False, desc_act: bool = False,
                          seed: int = 0, skip: Tuple[str, ...] = (), lm_head: bool = False) -> Dict[str, torch.Tensor]:
    """Quantize the float checkpoint in `src` into an AWQ (fmt "awq") or GPTQ ("gptq") one in `dst`; the
    dequantized weight of each quantized projection by its `.weight` name. `group` -1: one group per row.
    Modules whose names contain an entry of `skip` stay float (AWQ's modules_to_not_convert). `lm_head`
    (GPTQ): the LM head is quantized too (quantization_config lm_head true); a checkpoint with tied
    embeddings gets lm_head.* from the embedding matrix, which stays float itself."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    gen = torch.Generator().manual_seed(seed)
    dequantized: Dict[str, torch.Tensor] = {}
    # Act-order comes from the input's statistics: projections of the same input (q/k/v, gate/up) share it.
    orders: Dict[str, torch.Tensor] = {}
    for file in sorted(os.listdir(src)):
        if not file.endswith(".safetensors"):
            continue
        tensors = load_file(os.path.join(src, file))
        if lm_head and "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]  # tied: the head is this matrix
        out: Dict[str, torch.Tensor] = {}
        for key, w in tensors.items():
            module = key[: -len(".weight")]
            quantized = module.rsplit(".", 1)[-1] in PROJECTIONS or (lm_head and module == "lm_head")
            if not (key.endswith(".weight") and quantized) or any(s in module for s in skip):
                out[key] = w
                continue
            in_f = w.shape[1]
            g = in_f if group == -1 else group
            parent, _, proj = module.rpartition(".")
            source = parent + (f".{proj}" if proj in ("o_proj", "down_proj") else ".input")
            order = orders.setdefault(source, torch.randperm(in_f, generator=gen)) if desc_act else None
            codes, scale, zero, g_idx = rtn_int4(w, g, sym, min_zero=1 if fmt == "gptq" else 0, order=order)
            dequantized[key] = dequantize(codes, scale, zero, g_idx)
            if fmt == "awq":
                out[module + ".qweight"] = awq_pack(codes.t())
                out[module + ".qzeros"] = awq_pack(zero.t())
            else:
                out[module + ".qweight"] = gptq_pack_rows(codes.t())
                out[module + ".qzeros"] = gptq_pack_cols(zero.t() - 1)
                out[module + ".g_idx"] = g_idx
            out[module + ".scales"] = scale.t().contiguous()
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst, file), metadata={"format": "pt"})
    config = json.load(open(os.path.join(dst, "config.json")))
    if fmt == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm", "modules_to_not_convert": list(skip) or None}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
                                         "sym": sym, "lm_head": lm_head, "checkpoint_format": "gptq"}
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return dequantized


def write_dequantized_checkpoint(src: str, dst: str, weights: Dict[str, torch.Tensor]) -> str:
    """A float32 copy of the (unquantized) checkpoint `src` in `dst`, with `weights` replaced: the oracle.
    A weight `src` lacks (the quantized head of a tied checkpoint) is added, and the embeddings untied."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), dst)
    extra = dict(weights)
    for file in sorted(os.listdir(src)):
        if file.endswith(".safetensors"):
            tensors = {k: extra.pop(k, v).float().contiguous() for k, v in load_file(os.path.join(src, file)).items()}
            save_file(tensors, os.path.join(dst, file), metadata={"format": "pt"})
    if extra:
        save_file({k: v.float().contiguous() for k, v in extra.items()}, os.path.join(dst, "extra.safetensors"),
                  metadata={"format": "pt"})
    config = json.load(open(os.path.join(dst, "config.json")))
    if "lm_head.weight" in extra:
        config["tie_word_embeddings"] = False
    config.pop("quantization_config", None)
    json.dump(config, open(os.path.join(dst, "config.json"), "w"))
    return dst


def write_compressed_tensors_checkpoint(model: torch.nn.Module, dst: str, preset: str, strategy: str = "channel",
                                        ignore: Tuple[str, ...] = ("lm_head",),
                                        group_size: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """What llm-compressor writes for a transformers `model` (quantized in place): compressed-tensors'
    own scheme, compressor and config writer, with min/max scales (and zero points) per channel, tensor
    or group set here (the observer's job in llm-compressor), and a static scheme's activation scale. `preset` is
    compressed-tensors' scheme name (FP8_DYNAMIC, FP8 (static activation scales), W8A8, W4A16, W4A16_ASYM); `group_size` with strategy "group". Returns the dequantized
    weight of each quantized linear by its `.weight` name, unpacked by compressed-tensors itself."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStrategy, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    scheme = preset_name_to_scheme(preset, ["Linear"])
    assert scheme.weights is not None
    scheme.weights.strategy = QuantizationStrategy(strategy)
    scheme.weights.group_size = group_size
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=list(ignore)))
    for module in model.modules():
        scale = getattr(module, "weight_scale", None)
        if scale is None:
            continue
        w = module.weight.data.float()
        if strategy == "group":
            w = w.reshape(w.shape[0], -1, group_size)
            lo, hi = w.amin(dim=2), w.amax(dim=2)
        elif strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1, 1), w.amax().reshape(1, 1)
        s, zp = calculate_qparams(lo, hi, module.quantization_scheme.weights)
        scale.data.copy_(s.reshape(scale.shape))
        zero = getattr(module, "weight_zero_point", None)
        if zero is not None:
            zero.data.copy_(zp.reshape(zero.shape))
        input_scale = getattr(module, "input_scale", None)  # a static scheme's (FP8): a calibration's value
        if input_scale is not None:
            input_scale.data.fill_(0.05)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    out: Dict[str, torch.Tensor] = {}
    for key, scale_t in tensors.items():
        if not key.endswith(".weight_scale"):
            continue
        module = key[: -len(".weight_scale")]
        s_f = scale_t.float()
        if module + ".weight_packed" in tensors:  # 4-bit, per group (or channel: one group)
            shape = torch.Size(tensors[module + ".weight_shape"].tolist())
            q = unpack_from_int32(tensors[module + ".weight_packed"], 4, shape).float()
            zp = tensors.get(module + ".weight_zero_point")
            z = torch.zeros_like(s_f) if zp is None else unpack_from_int32(zp, 4, s_f.shape, packed_dim=0).float()
            per = shape[1] // s_f.shape[1]
            out[module + ".weight"] = (q - z.repeat_interleave(per, 1)) * s_f.repeat_interleave(per, 1)
        else:
            w8 = tensors[module + ".weight"].float()
            out[module + ".weight"] = w8 * (s_f.reshape(-1, 1) if s_f.numel() > 1 else s_f.reshape(()))
    return out
