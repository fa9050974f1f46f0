"""Block-wise fp8 checkpoints (DeepSeek-V3 / R1's `quant_method: fp8` with `weight_block_size`).

Each quantized linear stores `<module>.weight` in float8 e4m3 [out, in] and `<module>.weight_scale_inv`
float32 [ceil(out / block_n), ceil(in / block_k)]: weight block (i, j) times scale_inv[i, j] is the real
weight (a last block along either dimension may be ragged). The MoE router, the embeddings, the LM head and
the norms stay in bf16, as do the modules the config lists in ignored_layers / modules_to_not_convert.

We dequantize at load: `dequantized_weights` wraps the checkpoint iterator, pairs each fp8 weight with its
scale (they may arrive in either order, from different shards), and yields the float weight in the model
dtype under the weight's name. Every model path then loads it as a bf16 checkpoint: dense and fused
linears, the MLA latent projections and kv_b_proj (read as views by the absorbed attention), and the
experts (native CPU and Triton alike). The cost is memory: the weights take the model dtype's bytes (2 per
weight in bf16, twice the fp8 checkpoint) instead of fp8's one, and a bf16 model rounds each dequantized
weight once to bf16. A block-scaled fp8 kernel (the scale read per 128 x 128 block, in registers) would keep
the fp8 bytes; the dequantized path is the reference it would be tested against.

`check_block_alignment` refuses, before any weight is read, the layouts SGLang refuses: a tensor-parallel
shard or a fused boundary (gate | up, the experts' w13) that cuts a block. Dequantizing the whole tensor
would not mind, but a block kernel would, and a checkpoint that starts here must start on SGLang too.
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, Iterator, List, Sequence, Tuple

import torch
from torch import nn

from engine.distributed.parallel_state import get_expert_layout, get_tp_size
from engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.mla_linear import LatentExpansion
from engine.layers.moe.layer import FusedMoE
from engine.layers.prequantized import FusesCheckpointLinears, checkpoint_names
from engine.layers.quant_config import CheckpointQuantization
from engine.model_loader.weight_utils import ShardId

SCALE_SUFFIX = "weight_scale_inv"
FP8_DTYPE = torch.float8_e4m3fn


def block_grid(shape: Sequence[int], block: Tuple[int, int]) -> Tuple[int, int]:
    """The scale grid of a [out, in] weight: [ceil(out / block_n), ceil(in / block_k)]."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int],
                         dtype: torch.dtype = torch.float32, name: str = "weight") -> torch.Tensor:
    """weight [n, k] e4m3 with scale_inv [ceil(n / bn), ceil(k / bk)] -> the [n, k] weight in `dtype`
    (each block's product computed in float32, then one rounding to dtype)."""
    if weight.dim() != 2:
        raise ValueError(f"{name}: a block-quantized weight is 2-D, got shape {tuple(weight.shape)}")
    grid = block_grid(weight.shape, block)
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"{name}: {SCALE_SUFFIX} has shape {tuple(scale_inv.shape)}, but a weight of shape "
                         f"{tuple(weight.shape)} in blocks of {list(block)} needs {list(grid)}")
    n, k = weight.shape
    scales = scale_inv.float().repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]
    return (weight.float() * scales).to(dtype)


def dequantized_weights(weights: Iterable[Tuple[str, torch.Tensor]], quant: CheckpointQuantization,
                        dtype: torch.dtype) -> Iterator[Tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every fp8 weight and its scale_inv replaced by the float weight."""
    pending_weights: Dict[str, torch.Tensor] = {}  # module -> fp8 weight waiting for its scale
    pending_scales: Dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if suffix == "input_scale":
            raise ValueError(f"checkpoint tensor {name}: static activation scales, but the config's "
                             "activation_scheme is dynamic")
        if suffix == SCALE_SUFFIX:
            if module in pending_weights:
                yield f"{module}.weight", _dequantize(module, pending_weights.pop(module), tensor, quant, dtype)
            else:
                pending_scales[module] = tensor
            continue
        if suffix == "weight" and tensor.dtype == FP8_DTYPE:
            if module in pending_scales:
                yield name, _dequantize(module, tensor, pending_scales.pop(module), quant, dtype)
            else:
                pending_weights[module] = tensor
            continue
        if suffix == "weight" and tensor.dtype.is_floating_point and tensor.element_size() == 1:
            raise ValueError(f"checkpoint tensor {name} is {str(tensor.dtype).replace('torch.', '')}; the "
                             "config's fmt is e4m3 (float8_e4m3fn)")
        yield name, tensor
    if pending_weights:
        raise ValueError(f"fp8 weights without their {SCALE_SUFFIX}: {', '.join(sorted(pending_weights)[:5])}")
    if pending_scales:
        raise ValueError(f"{SCALE_SUFFIX} tensors without an fp8 weight: {', '.join(sorted(pending_scales)[:5])}")


def _dequantize(module: str, weight: torch.Tensor, scale_inv: torch.Tensor, quant: CheckpointQuantization,
                dtype: torch.dtype) -> torch.Tensor:
    if quant.ignores(module):
        raise ValueError(f"{module} is stored in fp8 but the config lists it in ignored_layers / "
                         "modules_to_not_convert")
    return dequantize_block_fp8(weight, scale_inv, quant.block, dtype, name=f"{module}.weight")


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
