"""Block-wise fp8 checkpoints (DeepSeek-V3 / R1's `quant_method: fp8` with `weight_block_size`).

Each quantized linear stores `<module>.weight` in float8 e4m3 [out, in] and `<module>.weight_scale_inv`
float32 [ceil(out / block_n), ceil(in / block_k)]: weight block (i, j) times scale_inv[i, j] is the real
weight (a last block along either dimension may be ragged). The MoE router, the embeddings, the LM head and
the norms stay in bf16, as do the modules the config lists in ignored_layers / modules_to_not_convert.

Three steps around the model's own `load_weights` (as layers/prequantized.py):

1. `prepare`: refuses, before any weight is read, the layouts SGLang refuses (`check_block_alignment`: a
   tensor-parallel shard or a fused boundary, gate | up or the experts' w13, that cuts a block). On the CPU,
   every column-, row-parallel and replicated linear gets an fp8 `weight` and a `weight_scale_inv`
   parameter, loaded by the layer's own loader (a column-parallel layer's scale rows are widened to one per
   weight row while loading, so the layer cuts its shard and fused parts as it cuts the weight); the
   experts' stacks w13 / w2 become fp8, with stacked block scales cut here by expert, role and TP slice.
2. `checkpoint_tensors` wraps the checkpoint iterator: pairs each fp8 weight with its scale (either order,
   any shard), checks the scale's shape against the block grid, and passes both on for a layer of step 1;
   any other fp8 weight (kv_b_proj, which the absorbed attention reads as per-head views; every weight on
   a GPU) is dequantized there to the model dtype and loads as a bf16 checkpoint's would.
3. `finish`: each fp8 layer's parameters become its BlockFp8Weight (layers/block_fp8_linear.py: the CPU
   kernel reads one byte per weight), each expert's its pair of them (FusedMoE.use_packed_experts); the
   parameters are released.

Memory: the linears of step 1 keep fp8's byte per weight (plus a float32 per 128 x 128 block); dequantized
weights take the model dtype's bytes (2 in bf16), and in a bf16 model each is rounded once to bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Sequence, Set, Tuple, Union

import torch
from torch import nn

from engine.distributed.parallel_state import get_expert_layout, get_tp_size
from engine.layers.block_fp8_linear import SCALE_SUFFIX, BlockFp8Weight, block_grid, dequantize_block_fp8
from engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.mla_linear import LatentExpansion, ReplicatedLinear
from engine.layers.moe.layer import FusedMoE
from engine.layers.prequantized import FusesCheckpointLinears, checkpoint_names
from engine.layers.quant_config import CheckpointQuantization
from engine.model_loader.weight_utils import ShardId, WeightLoader, set_weight_loader

__all__ = ["block_grid", "dequantize_block_fp8", "prepare", "checkpoint_tensors", "finish", "check_block_alignment"]

FP8_DTYPE = torch.float8_e4m3fn
Fp8Linear = Union[ColumnParallelLinear, RowParallelLinear, ReplicatedLinear]


@dataclass
class Fp8Plan:
    """The linears that keep their fp8 weights, by our module name and by the checkpoint's names."""

    quant: CheckpointQuantization
    modules: Dict[str, Fp8Linear] = field(default_factory=dict)
    experts: Dict[str, FusedMoE] = field(default_factory=dict)
    checkpoint_modules: Set[str] = field(default_factory=set)


def prepare(model: nn.Module, quant: CheckpointQuantization, keep_fp8: bool) -> Fp8Plan:
    """Step 1 above; with keep_fp8 false (a GPU) every weight is dequantized at load instead."""
    check_block_alignment(model, quant)
    plan = Fp8Plan(quant)
    if not keep_fp8:
        return plan
    stacked = model.stacked_params if isinstance(model, FusesCheckpointLinears) else ()
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE):
            names = _expert_checkpoint_names(name, stacked)
            if names and not any(quant.ignores(n) for n in names):
                _add_expert_params(module, quant.block)
                plan.experts[name] = module
                plan.checkpoint_modules.update(names)
            continue
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)):
            continue
        if isinstance(module, ReplicatedLinear) and not module.quantizable:
            continue
        names = checkpoint_names(name, stacked)
        if any(quant.ignores(n) for n in names):
            continue  # loads as stored (any quantized part dequantized by checkpoint_tensors)
        _add_fp8_params(module, quant.block)
        plan.modules[name] = module
        plan.checkpoint_modules.update(names)
    return plan


def _add_fp8_params(module: Fp8Linear, block: Tuple[int, int]) -> None:
    block_n, block_k = block
    if isinstance(module, ReplicatedLinear):
        n, k = module.output_size, module.input_size
    elif isinstance(module, RowParallelLinear):
        n, k = module.output_size, module.input_size_per_partition
    else:
        n, k = module.output_size_per_partition, module.input_size
    weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE), requires_grad=False)
    module.weight = weight
    rows, cols = block_grid((n, k), block)
    if isinstance(module, ReplicatedLinear):  # the default loader copies the whole tensor
        module.register_parameter(SCALE_SUFFIX, nn.Parameter(torch.empty(rows, cols), requires_grad=False))
        return
    set_weight_loader(weight, module.weight_loader)
    if isinstance(module, RowParallelLinear):
        row_layer = module

        def load_row_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            # The rank's input columns are whole blocks (check_block_alignment): so are its scale columns.
            piece = loaded.narrow(1, row_layer.tp_rank * cols, cols) if row_layer.tp_size > 1 else loaded
            if piece.shape != param.shape:
                raise ValueError(f"{SCALE_SUFFIX}: shape mismatch, parameter {tuple(param.shape)} vs checkpoint "
                                 f"{tuple(loaded.shape)}")
            param.data.copy_(piece)

        scale = nn.Parameter(torch.empty(rows, cols), requires_grad=False)
        set_weight_loader(scale, load_row_scale)
    else:
        column_layer = module

        def load_column_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            # One scale row per weight row: the layer's loader then cuts shards and fused parts as the weight's.
            widened = loaded.repeat_interleave(block_n, dim=0)
            if shard_id is None:
                column_layer.weight_loader(param, widened)
            else:
                column_layer.weight_loader(param, widened, shard_id)

        scale = nn.Parameter(torch.empty(n, cols), requires_grad=False)
        set_weight_loader(scale, load_column_scale)
    module.register_parameter(SCALE_SUFFIX, scale)


def _expert_checkpoint_names(name: str, stacked: Sequence[Tuple[str, str, ShardId]]) -> List[str]:
    """The checkpoint modules of the experts at `name` (model.layers.1.mlp.experts): the stacked entries
    whose fused name (mlp.experts.w13) ends where `name` ends, e.g. model.layers.1.mlp.experts.0.gate_proj."""
    names: List[str] = []
    for ckpt, fused, _ in stacked:
        owner = fused.rpartition(".")[0]
        if owner and (name == owner or name.endswith("." + owner)):
            names.append(name[:len(name) - len(owner)] + ckpt)
    return names


def _add_expert_params(module: FusedMoE, block: Tuple[int, int]) -> None:
    """fp8 stacks in place of w13 / w2 (loaded by the layer's own loader) and their block scales, loaded here:
    an expert's gate and up scale rows (whole blocks: check_block_alignment) go to their halves of w13's,
    down's scale columns are cut by the rank's intermediate slice."""
    block_n, block_k = block
    experts, size, hidden = module.num_local_experts, module.intermediate_per_rank, int(module.w2.weight.shape[1])
    for stacked, rows, cols in ((module.w13, 2 * size, hidden), (module.w2, hidden, size)):
        weight = nn.Parameter(torch.empty(experts, rows, cols, dtype=FP8_DTYPE), requires_grad=False)
        stacked.weight = weight
        set_weight_loader(weight, module.weight_loader)
        grid = block_grid((rows, cols), block)
        scale = nn.Parameter(torch.empty(experts, *grid), requires_grad=False)
        set_weight_loader(scale, _expert_scale_loader(module, block_n, block_k))
        stacked.register_parameter(SCALE_SUFFIX, scale)


def _expert_scale_loader(module: FusedMoE, block_n: int, block_k: int) -> WeightLoader:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if not isinstance(shard_id, str) or ":" not in shard_id:
            raise ValueError(f"an expert scale needs a shard id 'N:gate|up|down', got {shard_id!r}")
        local, role = module.local_expert(shard_id)
        if local < 0:
            return  # another EP rank's expert
        size = module.intermediate_per_rank
        if role == "down":
            # Split by the rank's intermediate slice: whole blocks (check_block_alignment); whole, a ragged last one.
            cols = math.ceil(size / block_k)
            split = get_expert_layout().moe_tp_size > 1
            source = loaded.narrow(1, module.moe_tp_rank * cols, cols) if split else loaded
            target = param.data[local]
        else:
            rows = size // block_n
            source = loaded.narrow(0, module.moe_tp_rank * rows, rows)
            target = param.data[local].narrow(0, 0 if role == "gate" else rows, rows)
        if target.shape != source.shape:
            raise ValueError(f"expert {shard_id} {SCALE_SUFFIX}: shape mismatch, parameter {tuple(target.shape)} vs "
                             f"checkpoint {tuple(loaded.shape)}")
        target.copy_(source)

    return load


def checkpoint_tensors(weights: Iterable[Tuple[str, torch.Tensor]], plan: Fp8Plan,
                       dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """Step 2 above: the checkpoint's tensors, fp8 ones paired with their scales."""
    pending_weights: Dict[str, torch.Tensor] = {}  # module -> fp8 weight waiting for its scale
    pending_scales: Dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if suffix == "input_scale":
            raise ValueError(f"checkpoint tensor {name}: static activation scales, but the config's "
                             "activation_scheme is dynamic")
        if suffix == SCALE_SUFFIX:
            if module in pending_weights:
                yield from _paired(module, pending_weights.pop(module), tensor, plan, dtype)
            else:
                pending_scales[module] = tensor
            continue
        if suffix == "weight" and tensor.dtype == FP8_DTYPE:
            if module in pending_scales:
                yield from _paired(module, tensor, pending_scales.pop(module), plan, dtype)
            else:
                pending_weights[module] = tensor
            continue
        if suffix == "weight" and tensor.dtype.is_floating_point and tensor.element_size() == 1:
            raise ValueError(f"checkpoint tensor {name} is {str(tensor.dtype).replace('torch.', '')}; the "
                             "config's fmt is e4m3 (float8_e4m3fn)")
        if suffix == "weight" and module in plan.checkpoint_modules:
            raise ValueError(f"checkpoint tensor {name} is {str(tensor.dtype).replace('torch.', '')}, not fp8, but "
                             "the config does not list it in ignored_layers / modules_to_not_convert")
        yield name, tensor
    if pending_weights:
        raise ValueError(f"fp8 weights without their {SCALE_SUFFIX}: {', '.join(sorted(pending_weights)[:5])}")
    if pending_scales:
        raise ValueError(f"{SCALE_SUFFIX} tensors without an fp8 weight: {', '.join(sorted(pending_scales)[:5])}")


def _paired(module: str, weight: torch.Tensor, scale_inv: torch.Tensor, plan: Fp8Plan,
            dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    quant = plan.quant
    if quant.ignores(module):
        raise ValueError(f"{module} is stored in fp8 but the config lists it in ignored_layers / "
                         "modules_to_not_convert")
    if module not in plan.checkpoint_modules:
        yield f"{module}.weight", dequantize_block_fp8(weight, scale_inv, quant.block, dtype, name=f"{module}.weight")
        return
    grid = block_grid(weight.shape, quant.block) if weight.dim() == 2 else None
    if grid is None or tuple(scale_inv.shape) != grid:
        raise ValueError(f"{module}.weight: {SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, but a weight of "
                         f"shape {tuple(weight.shape)} in blocks of {list(quant.block)} needs {list(grid or ())}")
    yield f"{module}.weight", weight
    yield f"{module}.{SCALE_SUFFIX}", scale_inv.float()


def finish(plan: Fp8Plan, dtype: torch.dtype) -> None:
    """Step 3 above: each fp8 layer's parameters become its packed BlockFp8Weight."""
    block_n = plan.quant.block[0]
    for experts in plan.experts.values():
        per_expert: List[List[BlockFp8Weight]] = []
        for stacked in (experts.w13, experts.w2):
            weight, scale = stacked.weight.data, getattr(stacked, SCALE_SUFFIX).data.float()
            per_expert.append([BlockFp8Weight(weight[e], scale[e].contiguous(), plan.quant.block)
                               for e in range(int(weight.shape[0]))])
            delattr(stacked, SCALE_SUFFIX)
        experts.use_packed_experts(per_expert[0], per_expert[1], dtype)
    for module in plan.modules.values():
        scale = getattr(module, SCALE_SUFFIX).data
        if not isinstance(module, (ReplicatedLinear, RowParallelLinear)):
            scale = scale[::block_n]  # back to one row per block (a shard starts on a block: aligned)
        module.packed_weight = BlockFp8Weight(module.weight.data.contiguous(), scale.float().contiguous(),
                                              plan.quant.block)
        delattr(module, SCALE_SUFFIX)
        # As after --quantization: an empty float weight where the layer kept one (nothing reads it).
        module.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


# --------------------------------------------------------------------------------------- alignment
def check_block_alignment(model: nn.Module, quant: CheckpointQuantization) -> None:
    """Refuse (ValueError naming the layer and the way out) a layout whose shards or fused parts cut a block."""
    block_n, block_k = quant.block
    stacked: Sequence[Tuple[str, str, ShardId]] = (
        model.stacked_params if isinstance(model, FusesCheckpointLinears) else ())
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            if all(quant.ignores(n) for n in checkpoint_names(name, stacked)):
                continue  # kept in the model dtype: no blocks
            problems = _linear_problems(module, block_n, block_k)
        elif isinstance(module, LatentExpansion):  # kv_b_proj: split by heads, like a column-parallel linear
            rows = int(module.weight.shape[0])
            problems = ([f"its {rows} rows per rank are not whole blocks of {block_n}"]
                        if get_tp_size() > 1 and rows % block_n else [])
        elif isinstance(module, FusedMoE):
            problems = _moe_problems(module, block_n, block_k)
        else:
            continue
        if problems:
            raise ValueError(f"block-wise fp8 (weight_block_size [{block_n}, {block_k}]): {name}: "
                             f"{'; '.join(problems)}; a shard or a fused part must hold whole blocks (use another "
                             "--tp-size, or --ep-size to keep experts whole)")


def _linear_problems(module: nn.Module, block_n: int, block_k: int) -> List[str]:
    problems: List[str] = []
    if isinstance(module, RowParallelLinear):
        if module.tp_size > 1 and module.input_size_per_partition % block_k:
            problems.append(f"its {module.input_size_per_partition} input columns per rank are not whole blocks "
                            f"of {block_k}")
        return problems
    assert isinstance(module, ColumnParallelLinear)
    parts: List[int] = []
    if isinstance(module, MergedColumnParallelLinear):
        parts = [size // module.tp_size for size in module.output_sizes]
    elif isinstance(module, QKVParallelLinear):
        parts = [module.q_size, module.kv_size, module.kv_size]
    elif module.tp_size > 1:
        parts = [module.output_size_per_partition]
    for size in parts:
        if size % block_n:
            problems.append(f"an output part of {size} rows per rank is not whole blocks of {block_n}")
    return problems


def _moe_problems(module: FusedMoE, block_n: int, block_k: int) -> List[str]:
    size = module.intermediate_per_rank
    problems: List[str] = []
    if size % block_n:  # w13 joins gate and up: the boundary must fall between blocks
        problems.append(f"the experts' gate and up parts of {size} rows per rank are not whole blocks of {block_n}")
    if get_expert_layout().moe_tp_size > 1 and size % block_k:
        problems.append(f"the experts' down projection's {size} input columns per rank are not whole blocks "
                        f"of {block_k}")
    return problems
