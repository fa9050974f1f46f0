"""Which quantization a model runs with: --quantization and the checkpoint's `quantization_config`.

A pre-quantized checkpoint says what it is in config.json's `quantization_config`; as SGLang, its method
is used when --quantization is unset, and a flag naming another method is refused (the awq_marlin /
gptq_marlin names, SGLang's GPU kernels for the same formats, count as awq / gptq). Accepted formats:

- compressed-tensors (what llm-compressor writes) with one scheme targeting the linears: 8-bit weights,
  float (e4m3, our fp8 weight path) or int (our w8a8_int8 path), symmetric, per output channel or per
  tensor; or 4-bit int weights (pack-quantized, W4A16), per group or channel, symmetric or not, with
  act-order (weight_g_idx); activations dynamic per token (or none: weight-only). 8-bit schemes with static
  per-tensor activation scales (llm-compressor's FP8 and static INT8 presets) load too: their `input_scale`
  tensors are checked (one positive finite value each) and not applied, as SGLang's CPU kernels (int8 with
  per-token activation scales of their own, fp8 weight-only against bf16 activations) do not apply them. Its
  `ignore` list (names, or "re:" regular expressions) keeps those modules in the model dtype.
- fp8 with weight_block_size (DeepSeek-V3 / R1's format): float8 e4m3 weights, each [block_n, block_k] block
  scaled by its `weight_scale_inv`, activations dynamic; dequantized at load (layers/block_fp8.py). Its
  `ignored_layers` / `modules_to_not_convert` name modules stored in the model dtype.
- awq (AutoAWQ's GEMM layout) and gptq (AutoGPTQ / GPTQModel, checkpoint format gptq or gptq_v2): 4 bits,
  group size a multiple of 32 or -1 (one group per row), zero points as the checkpoint has them; GPTQ's
  desc_act (act-order) included. AWQ's `modules_to_not_convert` is honoured. GPTQ's `lm_head: true` (as
  SGLang's `lm_head_quantized`): the LM head's qweight / qzeros / scales / g_idx load as a 4-bit head, cut
  by vocabulary rows across TP ranks like the float one; a tied embedding stays float.

Anything else (other bit widths, static activation scales of 4-bit schemes, group-wise 8-bit, packed
compressed-tensors formats, a quantized LM head outside GPTQ's lm_head, a KV-cache scheme, fp8 without
weight_block_size) is refused before any weight is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Tuple


from engine.layers.quantization import ONLINE_METHODS

# The checkpoint formats we load, by the name their config.json gives (SGLang's names for --quantization).
CHECKPOINT_METHODS: Tuple[str, ...] = ("compressed-tensors", "awq", "gptq", "fp8")
# SGLang's GPU kernels for the same formats: as flags they mean the format.
ALIASES: Dict[str, str] = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
# fp8 is both: online on a float checkpoint, the block-wise format on an fp8 one. "mxfp4": gpt-oss's
# expert format, dequantized by its model while loading (not a linear method).
QUANTIZATION_METHODS: Tuple[str, ...] = tuple(dict.fromkeys(ONLINE_METHODS + CHECKPOINT_METHODS + tuple(ALIASES)
                                                            + ("mxfp4",)))
INT4_MIN_GROUP = 32  # the packed layout's block (layers/int4.py)


@dataclass(frozen=True)
class Int4Names:
    """A 4-bit format's tensor names (the last part) for codes, zero points, scales and act-order."""

    codes: str
    zeros: str
    scales: str
    g_idx: str


AWQ_GPTQ_NAMES = Int4Names("qweight", "qzeros", "scales", "g_idx")
COMPRESSED_TENSORS_NAMES = Int4Names("weight_packed", "weight_zero_point", "weight_scale", "weight_g_idx")


@dataclass(frozen=True)
class CheckpointQuantization:
    """What a pre-quantized checkpoint holds, read from its quantization_config."""

    method: str  # one of CHECKPOINT_METHODS
    weights: str  # "fp8", "w8a8_int8" (8-bit, compressed-tensors), "int4" (awq, gptq) or "block_fp8" (fp8)
    per_tensor: bool = False  # 8-bit: one scale per tensor (per fused shard) instead of per output channel
    group_size: int = -1  # int4: inputs per group; -1: the whole row
    desc_act: bool = False  # gptq: inputs assigned to groups by g_idx (act-order)
    zero_offset: int = 0  # gptq format "gptq" stores zero - 1
    ignore: Tuple[str, ...] = ()  # compressed-tensors' ignore entries / awq's modules_to_not_convert
    symmetric: bool = False  # int4 compressed-tensors: no zero-point tensors (the zero is 8)
    block: Tuple[int, int] = (0, 0)  # block_fp8: weight_block_size [block_n (outputs), block_k (inputs)]
    lm_head: bool = False  # gptq's lm_head: the LM head is quantized too (its tensors under lm_head.*)
    # 8-bit compressed-tensors with static per-tensor activation scales (`input_scale`): read, checked and not
    # applied, as SGLang's CPU kernels do (int8: per-token scales of their own; fp8: bf16 activations).
    static_inputs: bool = False

    @property
    def int4_names(self) -> Int4Names:
        return COMPRESSED_TENSORS_NAMES if self.method == "compressed-tensors" else AWQ_GPTQ_NAMES

    @property
    def suffixes(self) -> Tuple[str, ...]:
        """The tensor names a quantized linear has in the checkpoint."""
        if self.method == "compressed-tensors" and self.weights == "int4":
            return ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
        if self.method == "compressed-tensors":
            return ("weight", "weight_scale", "input_scale") if self.static_inputs else ("weight", "weight_scale")
        if self.method == "fp8":
            return ("weight", "weight_scale_inv")
        if self.method == "awq":
            return ("qweight", "qzeros", "scales")
        return ("qweight", "qzeros", "scales", "g_idx")

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint keeps this module (its checkpoint name) unquantized."""
        if self.method in ("awq", "fp8"):  # AutoAWQ, SGLang's Fp8Config: a substring of the module name
            return any(entry in module for entry in self.ignore)
        for entry in self.ignore:
            if entry.startswith("re:"):
                if re.fullmatch(entry[3:], module) or re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False


def resolve_quantization(raw_config: Mapping[str, object], flag: Optional[str]) -> Optional[CheckpointQuantization]:
    """The checkpoint's quantization (None for a bf16/fp16/fp32 one), checked against --quantization;
    ValueError with what to change for anything we cannot serve."""
    config = raw_config.get("quantization_config")
    if config is None:
        if flag is not None and flag not in ONLINE_METHODS:
            raise ValueError(f"--quantization {flag} loads a pre-quantized checkpoint, but this checkpoint's "
                             f"config.json has no quantization_config; for its bf16/fp16/fp32 weights use "
                             f"--quantization {' or '.join(ONLINE_METHODS)} (or none)")
        return None
    if not isinstance(config, dict):
        raise ValueError("config.json's quantization_config must be an object")
    found = str(config.get("quant_method", "")).lower()
    if found == "mxfp4":
        # gpt-oss's MXFP4 experts: its model dequantizes them while loading (models/gpt_oss.py).
        architectures = raw_config.get("architectures")
        if not isinstance(architectures, list) or "GptOssForCausalLM" not in architectures:
            raise ValueError("quant_method 'mxfp4' is supported for gpt-oss (GptOssForCausalLM) checkpoints only")
        if flag is not None and flag != "mxfp4":
            raise ValueError(f"Quantization method specified in the model config (mxfp4) does not match the "
                             f"quantization method specified in the `quantization` argument ({flag}); leave "
                             "--quantization unset or pass mxfp4")
        return None
    if flag == "mxfp4":
        raise ValueError(f"--quantization mxfp4 loads gpt-oss's MXFP4 checkpoints; this checkpoint's "
                         f"quantization_config says {found!r}")
    if found not in CHECKPOINT_METHODS:
        raise ValueError(f"the checkpoint is quantized with quant_method {found!r}, which is not supported; "
                         f"supported pre-quantized formats: {', '.join(CHECKPOINT_METHODS)}")
    if flag is not None and ALIASES.get(flag, flag) != found:
        raise ValueError(f"Quantization method specified in the model config ({found}) does not match the "
                         f"quantization method specified in the `quantization` argument ({flag}); leave "
                         f"--quantization unset or pass {found}")
    if found == "compressed-tensors":
        return _compressed_tensors(config)
    if found == "fp8":
        return _block_fp8(config)
    return _int4(found, config)


def _refuse(what: str) -> ValueError:
    return ValueError(f"unsupported pre-quantized checkpoint: {what}")


def _compressed_tensors(config: Dict[str, object]) -> CheckpointQuantization:
    fmt = config.get("format")
    if fmt not in (None, "float-quantized", "int-quantized", "naive-quantized", "pack-quantized"):
        raise _refuse(f"compressed-tensors format {fmt!r} (supported: float-quantized, int-quantized, "
                      "naive-quantized: 8-bit weights; pack-quantized: 4-bit)")
    if config.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors kv_cache_scheme (KV-cache scales in the checkpoint)")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise _refuse("compressed-tensors needs exactly one entry in config_groups (one scheme for every linear), "
                      f"got {len(groups) if isinstance(groups, dict) else groups!r}")
    (scheme,) = groups.values()
    if not isinstance(scheme, dict):
        raise _refuse("a compressed-tensors config group must be an object")
    targets = scheme.get("targets")
    if not isinstance(targets, list) or "Linear" not in targets:
        raise _refuse(f"compressed-tensors targets {targets!r} (supported: [\"Linear\"])")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise _refuse("a compressed-tensors scheme without weight quantization")
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    inputs = scheme.get("input_activations")
    if inputs is not None and not isinstance(inputs, dict):
        raise _refuse("compressed-tensors input_activations must be an object")
    static_inputs = inputs is not None and not inputs.get("dynamic")
    if inputs is not None and static_inputs and (bits != 8 or inputs.get("num_bits") != 8
                                                 or inputs.get("type") != kind or inputs.get("strategy") != "tensor"):
        raise _refuse(f"compressed-tensors static activation scales for {bits}-bit weights, activations "
                      f"{inputs.get('num_bits')}-bit {inputs.get('type')!r} per {inputs.get('strategy')!r} "
                      "(supported: per-tensor scales of 8-bit activations of the weights' type)")
    if scheme.get("output_activations") is not None:
        raise _refuse("compressed-tensors output activation quantization")
    ignore = config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(e, str) for e in ignore):
        raise _refuse("compressed-tensors ignore must be a list of module names")
    if fmt == "pack-quantized" or bits == 4:
        return _compressed_tensors_int4(weights, tuple(ignore))
    if bits != 8 or kind not in ("float", "int"):
        raise _refuse(f"compressed-tensors weights of {bits} bits, type {kind!r} (supported: 8-bit float or int)")
    if strategy not in ("channel", "tensor"):
        raise _refuse(f"compressed-tensors weight strategy {strategy!r} (supported: channel, tensor)")
    if weights.get("symmetric") is False or weights.get("dynamic"):
        raise _refuse("compressed-tensors asymmetric or dynamic weight quantization (supported: symmetric, static)")
    return CheckpointQuantization("compressed-tensors", "fp8" if kind == "float" else "w8a8_int8",
                                  per_tensor=strategy == "tensor", ignore=tuple(ignore), static_inputs=static_inputs)


def _compressed_tensors_int4(weights: Dict[str, object], ignore: Tuple[str, ...]) -> CheckpointQuantization:
    """pack-quantized (what llm-compressor's W4A16 schemes write): int32 words of 8 codes along the inputs."""
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if bits != 4 or kind != "int":
        raise _refuse(f"compressed-tensors pack-quantized weights of {bits} bits, type {kind!r} (supported: 4-bit int)")
    if strategy == "channel":
        group = -1
    elif strategy == "group":
        group_size = weights.get("group_size")
        if not isinstance(group_size, int) or group_size <= 0 or group_size % INT4_MIN_GROUP != 0:
            raise _refuse(f"compressed-tensors group_size {group_size!r} (supported: a multiple of {INT4_MIN_GROUP})")
        group = group_size
    else:
        raise _refuse(f"compressed-tensors 4-bit strategy {strategy!r} (supported: group, channel)")
    if weights.get("dynamic"):
        raise _refuse("compressed-tensors dynamic weight quantization")
    actorder = weights.get("actorder")
    if actorder not in (None, False, True, "group", "weight"):
        raise _refuse(f"compressed-tensors actorder {actorder!r} (supported: group, weight)")
    # "weight" reorders while quantizing but keeps groups contiguous; "group" writes weight_g_idx.
    return CheckpointQuantization("compressed-tensors", "int4", group_size=group, desc_act=actorder in (True, "group"),
                                  ignore=ignore, symmetric=weights.get("symmetric") is not False)


def _int4(method: str, config: Dict[str, object]) -> CheckpointQuantization:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise _refuse(f"{method} with {bits} bits (supported: 4)")
    group = config.get("group_size", config.get("q_group_size"))
    if not isinstance(group, int) or not (group == -1 or (group > 0 and group % INT4_MIN_GROUP == 0)):
        raise _refuse(f"{method} group_size {group!r} (supported: a multiple of {INT4_MIN_GROUP}, or -1)")
    if method == "awq":
        if str(config.get("version", "gemm")).lower() != "gemm":
            raise _refuse(f"awq version {config.get('version')!r} (supported: gemm)")
        if config.get("zero_point", True) is not True:
            raise _refuse("awq without zero points (zero_point false)")
        skip = config.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(e, str) for e in skip):
            raise _refuse("awq modules_to_not_convert must be a list of names")
        return CheckpointQuantization("awq", "int4", group_size=group, ignore=tuple(skip))
    lm_head = config.get("lm_head", False)
    if not isinstance(lm_head, bool):
        raise _refuse(f"gptq lm_head must be true or false, got {lm_head!r}")
    if config.get("dynamic"):
        raise _refuse("gptq per-module overrides (dynamic)")
    if config.get("is_marlin_format"):
        raise _refuse("gptq in marlin format (is_marlin_format)")
    fmt = str(config.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {fmt!r} (supported: gptq, gptq_v2)")
    return CheckpointQuantization("gptq", "int4", group_size=group, desc_act=bool(config.get("desc_act", False)),
                                  zero_offset=1 if fmt == "gptq" else 0, lm_head=lm_head)


def _block_fp8(config: Dict[str, object]) -> CheckpointQuantization:
    """quant_method fp8 with weight_block_size (DeepSeek-V3's): per-block weight scales, dynamic activations."""
    block = config.get("weight_block_size")
    if block is None:
        raise _refuse("fp8 without weight_block_size (per-tensor fp8 scales); supported: block-wise fp8, "
                      "e.g. weight_block_size [128, 128] (DeepSeek-V3 / R1)")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise _refuse(f"fp8 weight_block_size must be 2 positive integers [block_n, block_k], got {block!r}")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(f"fp8 activation_scheme {scheme!r} with weight_block_size (block-wise fp8 needs dynamic "
                      "activations, as SGLang)")
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"fp8 fmt {fmt!r} (supported: e4m3)")
    ignore: List[str] = []
    for key in ("ignored_layers", "modules_to_not_convert"):
        entries = config.get(key) or []
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise _refuse(f"fp8 {key} must be a list of module names")
        ignore.extend(entries)
    return CheckpointQuantization("fp8", "block_fp8", block=(block[0], block[1]), ignore=tuple(ignore))
