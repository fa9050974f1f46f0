"""Reading a PEFT adapter into this rank's shards, checked against the model's projections.

`LoRATarget` describes one projection of the model that adapters may change (a fused qkv /
gate_up or a single o / down projection of one layer): its full and local sizes and how this TP
rank's piece is cut, like the base layer's weight loader does (column-parallel projections cut
B by output rows, with KV heads replicated the way the base layer replicates them; row-parallel
ones cut A by input columns and keep B whole, so the delta joins the base layer's partial sum
before its all-reduce).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.lora.lora_config import ADAPTER_WEIGHTS, FUSED_MODULES, FUSED_OF, LoRAConfig, LoRAError

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT may put ".default" before ".weight").
_WEIGHT_NAME = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
# An adapter file larger than this is refused before it is read (a rank-256 adapter of a 70B model
# is about 6 GB in bfloat16).
MAX_ADAPTER_BYTES = 16 << 30


@dataclass(frozen=True)
class SubTarget:
    """One sub-projection (q, k, v, gate, up, or the whole o / down) of a target."""

    name: str  # q_proj, ...
    full_out: int  # its output size in the checkpoint
    offset: int  # where its rows start in this rank's output
    size: int  # its rows in this rank's output
    shard_index: int  # this rank's piece of the full output is rows [shard_index*size, +size)


@dataclass(frozen=True)
class LoRATarget:
    layer_id: int
    fused: str  # qkv_proj, o_proj, gate_up_proj, down_proj
    module: Union[ColumnParallelLinear, RowParallelLinear]  # the base layer (attach_lora adds the delta)
    full_in: int
    local_in: int
    in_offset: int  # row-parallel: this rank's input columns start here (A is cut), else 0
    row_parallel: bool
    subs: Tuple[SubTarget, ...]

    @property
    def local_out(self) -> int:
        return sum(s.size for s in self.subs)


def _column_subs(fused: str, module: ColumnParallelLinear) -> Tuple[SubTarget, ...]:
    if isinstance(module, QKVParallelLinear):
        head, rank = module.head_size, module.tp_rank
        kv_index = rank // module.num_kv_head_replicas
        q, kv = module.q_size, module.kv_size
        return (SubTarget("q_proj", module.total_num_heads * head, 0, q, rank),
                SubTarget("k_proj", module.total_num_kv_heads * head, q, kv, kv_index),
                SubTarget("v_proj", module.total_num_kv_heads * head, q + kv, kv, kv_index))
    if isinstance(module, MergedColumnParallelLinear):
        tp, names = module.tp_size, FUSED_MODULES[fused]
        offsets = [sum(module.output_sizes[:i]) // tp for i in range(len(names))]
        return tuple(SubTarget(n, full, off, full // tp, module.tp_rank)
                     for n, full, off in zip(names, module.output_sizes, offsets))
    raise LoRAError(f"{fused}: unsupported layer type {type(module).__name__}")


def find_targets(model: nn.Module, enabled: List[str]) -> Dict[Tuple[int, str], LoRATarget]:
    """Every projection of the model that an enabled target module lands in, by (layer, fused name)."""
    wanted = {FUSED_OF[m] for m in enabled}
    targets: Dict[Tuple[int, str], LoRATarget] = {}
    pattern = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")
    for name, module in model.named_modules():
        match = pattern.search(name)
        if match is None or match.group(2) not in wanted:
            continue
        layer_id, fused = int(match.group(1)), match.group(2)
        if isinstance(module, RowParallelLinear):
            sub = SubTarget(fused, module.output_size, 0, module.output_size, 0)
            targets[(layer_id, fused)] = LoRATarget(
                layer_id, fused, module, module.input_size, module.input_size_per_partition,
                module.tp_rank * module.input_size_per_partition, True, (sub,))
        elif isinstance(module, ColumnParallelLinear):
            targets[(layer_id, fused)] = LoRATarget(layer_id, fused, module, module.input_size, module.input_size,
                                                    0, False, _column_subs(fused, module))
    if not targets:
        raise LoRAError("the model has no projection LoRA can target (q/k/v/o, gate/up/down of decoder layers)")
    return targets


@dataclass
class LoRAAdapter:
    """An adapter's weights as this rank serves them (host memory; the pool copies them into a slot)."""

    name: str
    uid: str  # unique per load: a reloaded name is a new adapter (and a new cache namespace)
    path: str
    config: LoRAConfig
    pinned: bool
    # (layer, fused) -> per sub-projection (A [r, local_in], B [local rows, r]) or None (not targeted)
    weights: Dict[Tuple[int, str], List[Optional[Tuple[torch.Tensor, torch.Tensor]]]]


def _read_tensors(path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise LoRAError(f"LoRA adapter {path!r}: no {ADAPTER_WEIGHTS}")
    if os.path.getsize(file) > MAX_ADAPTER_BYTES:
        raise LoRAError(f"LoRA adapter {path!r}: {ADAPTER_WEIGHTS} is larger than {MAX_ADAPTER_BYTES} bytes")
    try:
        return load_file(file, device="cpu")
    except Exception as e:  # safetensors raises its own error types for a corrupt or truncated file
        raise LoRAError(f"LoRA adapter {path!r}: {ADAPTER_WEIGHTS} cannot be read ({type(e).__name__}: {e})") from None


def read_adapter(name: str, uid: str, path: str, config: LoRAConfig, pinned: bool,
                 targets: Dict[Tuple[int, str], LoRATarget], dtype: torch.dtype) -> LoRAAdapter:
    """The adapter's tensors, checked (names, shapes, pairs, finite values) and cut to this rank."""
    pairs: Dict[Tuple[int, str], Dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        match = _WEIGHT_NAME.search(key)
        if match is None:
            raise LoRAError(f"LoRA adapter {path!r}: tensor {key[:120]!r} is not a LoRA A/B weight of an attention "
                            "or MLP projection (embeddings, lm_head and DoRA are not supported)")
        layer_id, sub, which = int(match.group(1)), match.group(2), match.group(3)
        if sub not in config.target_modules:
            raise LoRAError(f"LoRA adapter {path!r}: tensor {key!r} is for {sub}, not in its target_modules")
        pairs.setdefault((layer_id, sub), {})[which] = tensor
    weights: Dict[Tuple[int, str], List[Optional[Tuple[torch.Tensor, torch.Tensor]]]] = {}
    for (layer_id, sub), pair in pairs.items():
        target = targets.get((layer_id, FUSED_OF[sub]))
        if target is None:
            raise LoRAError(f"LoRA adapter {path!r}: layer {layer_id} {sub} is not a projection this server "
                            "serves adapters on (the model's layers and --lora-target-modules)")
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {path!r}: layer {layer_id} {sub} lacks its lora_{'B' if 'A' in pair else 'A'}")
        index = [s.name for s in target.subs].index(sub)
        entry = _shard(pair["A"], pair["B"], target, index, config.rank, f"{path!r} layer {layer_id} {sub}", dtype)
        slots = weights.setdefault((layer_id, target.fused), [None] * len(target.subs))
        slots[index] = entry
    if not weights:
        raise LoRAError(f"LoRA adapter {path!r}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return LoRAAdapter(name, uid, path, config, pinned, weights)


def _shard(a: torch.Tensor, b: torch.Tensor, target: LoRATarget, index: int, rank: int, what: str,
           dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    sub = target.subs[index]
    if tuple(a.shape) != (rank, target.full_in) or tuple(b.shape) != (sub.full_out, rank):
        raise LoRAError(f"LoRA adapter {what}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match the "
                        f"model ({rank}, {target.full_in}) / ({sub.full_out}, {rank})")
    if not a.is_floating_point() or not b.is_floating_point() or not (
            torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoRAError(f"LoRA adapter {what}: weights must be finite floating-point numbers")
    if target.row_parallel:
        a = a.narrow(1, target.in_offset, target.local_in)
    else:
        b = b.narrow(0, sub.shard_index * sub.size, sub.size)
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()
