"""The fp8 KV cache's per-layer scales as checkpoints carry them (SGLang's kv-scale remapping).

Quantized checkpoints (llm-compressor / compressed-tensors, ModelOpt, ...) store one scalar per
attention layer for K and one for V, under `model.layers.<i>.self_attn.k_scale` / `.v_scale` (some
with `.attn.` before the name, some as `k_proj.output_scale` / `v_proj.output_scale`); older ones one
`kv_scale` for both. The pool stores k / k_scale in fp8 and reads k_scale * stored. Without any of
these names every scale is 1.0, as in SGLang (which warns in that case too).
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
from typing import Dict, Iterable, List, Optional, Tuple

logger = logging.getLogger(__name__)

_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?(k_scale|v_scale|kv_scale)$")
_PROJ_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(k_proj|v_proj)\.output_scale$")


def kv_scale_target(name: str) -> Optional[Tuple[int, str]]:
    """(layer, "k" | "v" | "kv") for a checkpoint tensor holding a KV cache scale, else None."""
    m = _NAME.search(name)
    if m is not None:
        return int(m.group(1)), {"k_scale": "k", "v_scale": "v", "kv_scale": "kv"}[m.group(2)]
    m = _PROJ_NAME.search(name)
    if m is not None:
        return int(m.group(1)), m.group(2)[0]
    return None


def collect_kv_scales(named_values: Iterable[Tuple[str, float]], num_layers: int
                      ) -> Tuple[List[float], List[float], int]:
    """(k_scales, v_scales, how many values were found) from (checkpoint name, scalar) pairs; layers the
    checkpoint names no scale for keep 1.0. A scale that is not finite and > 0, or of a layer the model
    does not have, is a ValueError (a checkpoint that does not belong to this model)."""
    k = [1.0] * num_layers
    v = [1.0] * num_layers
    found = 0
    for name, value in named_values:
        target = kv_scale_target(name)
        if target is None:
            continue
        layer, which = target
        if not 0 <= layer < num_layers:
            raise ValueError(f"checkpoint KV scale {name}: layer {layer}, the model has {num_layers} layers")
        if not (math.isfinite(value) and value > 0.0):
            raise ValueError(f"checkpoint KV scale {name} = {value}: a scale must be finite and > 0")
        if which in ("k", "kv"):
            k[layer] = value
        if which in ("v", "kv"):
            v[layer] = value
        found += 1
    return k, v, found


def _checkpoint_files(model_path: str) -> List[str]:
    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: Dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(model_path, name) for name in sorted(set(weight_map.values()))]
    return sorted(glob.glob(os.path.join(model_path, "*.safetensors")))


def read_kv_scales(model_path: str, num_layers: int) -> Tuple[List[float], List[float]]:
    """The per-layer (k_scales, v_scales) of the checkpoint at `model_path` (only the scale tensors are
    read); 1.0 where it has none, with a warning when it has none at all."""
    from safetensors import safe_open

    pairs: List[Tuple[str, float]] = []
    for path in _checkpoint_files(model_path):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if kv_scale_target(name) is None:
                    continue
                tensor = f.get_tensor(name)
                if tensor.numel() != 1:
                    raise ValueError(f"checkpoint KV scale {name} has shape {tuple(tensor.shape)}; one value per "
                                     "layer is supported (per-tensor k_scale / v_scale)")
                pairs.append((name, float(tensor.float().item())))
    k, v, found = collect_kv_scales(pairs, num_layers)
    if not found:
        logger.warning("fp8 KV cache: the checkpoint has no k_scale / v_scale; every layer uses scale 1.0 "
                       "(K/V values beyond the fp8 range are clamped)")
    else:
        logger.info("fp8 KV cache: %d KV scales loaded from the checkpoint", found)
    return k, v
