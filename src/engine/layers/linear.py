"""Tensor-parallel linear layers; at tp_size 1 each one is a plain `F.linear`.

Weights are stored as `[output, input]` like `nn.Linear`. Column-parallel layers split the output
dimension across ranks, row-parallel layers split the input dimension and all-reduce the result.
Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that cuts this
rank's piece out of the full checkpoint tensor.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, List, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from engine.kernels import linear as linear_kernels
from engine.layers.block_fp8_linear import BlockFp8Weight, block_fp8_linear
from engine.layers.cpu_matmul import dense_linear
from engine.layers.int4 import Int4Weight, int4_linear
from engine.layers.moe.layer import FusedMoE
from engine.layers.quantization import QuantizedWeight, quantize_weight, quantized_linear
from engine.model_loader.weight_utils import set_weight_loader

if TYPE_CHECKING:
    from engine.lora.layers import LoRAProjection

logger = logging.getLogger(__name__)


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tp_size {denominator}")
    return numerator // denominator


def _copy_checked(target: torch.Tensor, source: torch.Tensor, what: str) -> None:
    if target.shape != source.shape:
        raise ValueError(f"{what}: shape mismatch, parameter {tuple(target.shape)} vs checkpoint {tuple(source.shape)}")
    target.copy_(source)


# oneDNN linear with a pre-packed (reordered) weight: on the CPU it runs small-batch matmuls
# (decode) about 1.5x faster than F.linear, whose weight layout is re-packed on every call. For
# large row counts (long prefills in float32) plain F.linear is as fast, so it is used there.
PACKED_MAX_ROWS = 512

# With --quantization or a pre-quantized checkpoint the layer's weight lives only here, quantized
# (layers/quantization.py, layers/int4.py, layers/block_fp8_linear.py).
PackedWeight = Union[torch.Tensor, linear_kernels.Bf16Panels, linear_kernels.WidenedBf16, QuantizedWeight, Int4Weight,
                     BlockFp8Weight]


def prepack_linear_weights(model: nn.Module) -> int:
    """Attach a packed copy of the weight to every linear layer and LM head of a CPU model: bf16
    panels for the native kernel (engine.kernels.linear) where it runs, else oneDNN's layout; the bf16
    experts of a FusedMoE layer into the same panels (FusedMoE.pack_native, which also takes quantized experts
    by address for the native MoE kernel).

    Returns the number of packed weights (0 when neither is available). Costs one extra copy of
    the linear weights in memory. Must be redone after weights change (loading clears it).
    """
    count = 0
    onednn = torch.backends.mkldnn.is_available()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            count += module.pack_native()
            continue
        weight = getattr(module, "weight", None)
        if (not hasattr(module, "packed_weight") or weight is None
                or isinstance(module.packed_weight, (QuantizedWeight, Int4Weight, BlockFp8Weight))):
            continue
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        if linear_kernels.linear_bf16_usable(weight):
            # The linears and the LM head declare packed_weight; torch types module attributes narrowly.
            setattr(module, "packed_weight", linear_kernels.pack_linear_bf16(weight, getattr(module, "bias", None)))
            count += 1
            continue
        if linear_kernels.widened_bf16_usable(weight):
            # Without bf16 instructions torch's bf16 matmul is far from the memory bandwidth (the LM head,
            # left in the model dtype by --quantization, is the largest weight a decode step reads).
            setattr(module, "packed_weight", linear_kernels.WidenedBf16(weight.detach()))
            count += 1
            continue
        if not onednn:
            continue
        try:
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
        except (RuntimeError, AttributeError) as e:  # an old or oneDNN-less build: keep F.linear
            # Once (not per layer); the loop goes on, as the LM head may still take the widening kernel.
            logger.warning("oneDNN weight packing unavailable (%s); using F.linear", e)
            onednn = False
            continue
        count += 1
    return count


def linear_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[PackedWeight]
) -> torch.Tensor:
    """F.linear, through the packed weight when there is one and the batch suits it."""
    if isinstance(packed, QuantizedWeight):
        return quantized_linear(x, packed, bias)
    if isinstance(packed, Int4Weight):
        return int4_linear(x, packed, bias)
    if isinstance(packed, BlockFp8Weight):
        return block_fp8_linear(x, packed, bias)
    if isinstance(packed, linear_kernels.WidenedBf16):
        out = linear_kernels.linear_widened_bf16(x, packed, bias)
        if out is not None:
            return out
    elif isinstance(packed, linear_kernels.Bf16Panels):
        if x.dtype == torch.bfloat16 and x.numel() <= linear_kernels.LINEAR_BF16_MAX_ROWS * packed.k and linear_kernels.enabled():
            return linear_kernels.linear_bf16(x, packed, add_bias=bias is not None)
    elif packed is not None and x.dim() == 2 and x.shape[0] <= PACKED_MAX_ROWS and x.dtype == weight.dtype:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return dense_linear(x, weight, bias)


def _new_param(*shape: int) -> nn.Parameter:
    # Values are filled by the weight loader; empty keeps model construction fast.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W split along the output dimension."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, self.tp_size)
        self.gather_output = gather_output
        self.packed_weight: Optional[PackedWeight] = None
        # With --enable-lora: adds each row's adapter delta to the output (engine/lora/).
        self.lora: Optional[LoRAProjection] = None
        self.weight = _new_param(self.output_size_per_partition, input_size)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = _new_param(self.output_size_per_partition)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        _copy_checked(param.data, loaded_weight.narrow(0, self.tp_rank * size, size), "ColumnParallelLinear")

    def attach_lora(self, lora: LoRAProjection) -> None:
        self.lora = lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear_forward(x, self.weight, self.bias, self.packed_weight)
        if self.lora is not None:
            out = self.lora.apply(x, out)
        if self.gather_output:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate_proj + up_proj).

    Each rank holds [its slice of output 0, its slice of output 1, ...]; shard_id is the index of
    the sub-projection being loaded.
    """

    def __init__(self, input_size: int, output_sizes: List[int], bias: bool = True, gather_output: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, gather_output=gather_output)

    def silu_and_mul(self, x: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """act_fn(self(x)) for a [gate, up] projection whose act_fn is SiluAndMul: on the CPU one native
        kernel where it applies (the [tokens, 2 x intermediate] product is never stored, the result
        has the same bits), else the two calls."""
        packed = self.packed_weight
        if (isinstance(packed, linear_kernels.Bf16Panels) and len(self.output_sizes) == 2 and not self.gather_output
                and (self.lora is None or not self.lora.active(x.numel() // x.shape[-1]))  # a delta goes before silu
                and self.output_sizes[0] == self.output_sizes[1] and linear_kernels.gate_up_silu_usable(x, packed)):
            return linear_kernels.linear_bf16_silu_mul(x, packed)
        return act_fn(self(x))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs a shard_id (index of the sub-projection)")
        tp = self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // tp
        size = self.output_sizes[shard_id] // tp
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded_weight.narrow(0, self.tp_rank * size, size), f"gate_up shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection sharded by attention heads.

    With fewer KV heads than ranks every rank keeps one KV head, and groups of
    `tp_size // total_num_kv_heads` consecutive ranks share (replicate) the same head.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: Optional[int] = None,
        bias: bool = True,
    ) -> None:
        tp = get_tp_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp)
        if tp >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = _divide(tp, total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp)
            self.num_kv_head_replicas = 1
        # The (possibly replicated) total output size, so that it divides evenly across ranks.
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp * head_size
        super().__init__(hidden_size, output_size, bias=bias, gather_output=False)
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[str] = None) -> None:
        if shard_id == "q":
            offset, size, rank_index = 0, self.q_size, self.tp_rank
        elif shard_id == "k":
            offset, size, rank_index = self.q_size, self.kv_size, self.tp_rank // self.num_kv_head_replicas
        elif shard_id == "v":
            offset, size, rank_index = self.q_size + self.kv_size, self.kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKVParallelLinear shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        target = param.data.narrow(0, offset, size)
        _copy_checked(target, loaded_weight.narrow(0, rank_index * size, size), f"qkv shard {shard_id}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W split along the input dimension; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size)
        self.reduce_results = reduce_results
        self.packed_weight: Optional[PackedWeight] = None
        # With --enable-lora: adds each row's adapter delta to this rank's partial sum (engine/lora/).
        self.lora: Optional[LoRAProjection] = None
        self.weight = _new_param(output_size, self.input_size_per_partition)
        set_weight_loader(self.weight, self.weight_loader)
        if bias:
            self.bias = _new_param(output_size)
            set_weight_loader(self.bias, self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is replicated; it is added once, after the reduction
            _copy_checked(param.data, loaded_weight, "RowParallelLinear bias")
            return
        size = param.shape[1]
        _copy_checked(param.data, loaded_weight.narrow(1, self.tp_rank * size, size), "RowParallelLinear")

    def attach_lora(self, lora: LoRAProjection) -> None:
        self.lora = lora

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1 and self.lora is None:
            return linear_forward(x, self.weight, self.bias, self.packed_weight)
        out = linear_forward(x, self.weight, None, self.packed_weight)
        if self.lora is not None:
            # Before the all-reduce: with A cut by input columns, each rank's delta is a partial sum too.
            out = self.lora.apply(x, out)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        if self.bias is not None:
            out = out + self.bias
        return out


def quantize_model(model: nn.Module, method: str) -> int:
    """Quantize every column- and row-parallel linear of a loaded model in place, and on the CPU each
    expert of its FusedMoE layers (FusedMoE.quantize_experts); the number of weights done (an expert's
    gate_up and down count as two).

    Each layer's full-precision weight is released (its parameter keeps shape [0]): the quantized
    copy is the only one, so the model's weights take about half the memory of bf16's."""
    count = 0
    for module in model.modules():
        if isinstance(module, FusedMoE) and module.quantize_experts(method):
            count += 2 * module.num_local_experts
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        module.packed_weight = quantize_weight(module.weight.data, method)
        module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
        count += 1
    return count


def is_quantized(model: nn.Module) -> bool:
    """Whether this model's linears hold quantized weights (quantize_model, or a pre-quantized checkpoint)."""
    return any(isinstance(m, (ColumnParallelLinear, RowParallelLinear))
               and isinstance(m.packed_weight, (QuantizedWeight, Int4Weight, BlockFp8Weight))
               for m in model.modules())
