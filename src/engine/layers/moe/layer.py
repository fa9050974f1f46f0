"""FusedMoE: a mixture-of-experts layer's experts, stacked, and their routed forward.

The experts' weights are stacked as w13 [E_local, 2 I_local, H] (each expert's gate rows, then its up
rows) and w2 [E_local, H, I_local], loaded from the checkpoint's per-expert tensors (Mixtral's
experts.N.w1/w3/w2, Qwen's experts.N.gate_proj/up_proj/down_proj). Over a TP group of T ranks with
--ep-size P (parallel_state.ExpertLayout): a rank holds E / P experts, each with I / (T / P) of its
intermediate dimension. Every rank runs all tokens through the experts it holds, so each rank's
output is a partial sum (over its experts, over its intermediate slice) and one all-reduce over the
TP group completes it: SGLang's non-DeepEP expert parallelism.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from engine.distributed.parallel_state import (
    get_expert_layout,
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_reduce,
)
from engine.kernels import library
from engine.kernels import linear as linear_kernels
from engine.layers.moe.expert_distribution import ExpertDistributionRecorder
from engine.layers.block_fp8_linear import BlockFp8Weight, block_fp8_linear
from engine.layers.quantization import QuantizedWeight, quantize_weight, quantized_linear
from engine.layers.moe.fused_moe_native import fused_moe_grouped, fused_moe_native
from engine.layers.moe.router import select_experts
from engine.model_loader.weight_utils import ShardId, set_weight_loader

# A checkpoint's name for each projection of one expert -> (our stacked weight, its role).
MIXTRAL_EXPERT_NAMES = (("w1", "w13", "gate"), ("w3", "w13", "up"), ("w2", "w2", "down"))
QWEN_EXPERT_NAMES = (("gate_proj", "w13", "gate"), ("up_proj", "w13", "up"), ("down_proj", "w2", "down"))



PackedExpert = Union[BlockFp8Weight, QuantizedWeight]


def packed_expert_linear(x: torch.Tensor, weight: PackedExpert) -> torch.Tensor:
    """One packed expert projection of rows x (no bias)."""
    if isinstance(weight, BlockFp8Weight):
        return block_fp8_linear(x, weight, None)
    return quantized_linear(x, weight, None)

def expert_params_mapping(num_experts: int, names: Sequence[Tuple[str, str, str]] = MIXTRAL_EXPERT_NAMES,
                          ) -> List[Tuple[str, str, ShardId]]:
    """load_weights_into's stacked-parameter entries for every expert: `experts.N.w1` -> `experts.w13`
    with shard id "N:gate" (the expert's number and the role of the tensor in the stacked weight)."""
    return [(f"experts.{e}.{ckpt}", f"experts.{ours}", f"{e}:{role}")
            for e in range(num_experts) for ckpt, ours, role in names]


class StackedExpertWeight(nn.Module):
    """One stacked weight of the local experts, as `weight` of a child module, so that a checkpoint
    name `...experts.N.w1.weight` routes to `...experts.w13.weight`."""

    def __init__(self, num_experts: int, rows: int, cols: int) -> None:
        super().__init__()
        # Values come from the weight loader; empty keeps model construction fast.
        self.weight = nn.Parameter(torch.empty(num_experts, rows, cols), requires_grad=False)


class FusedMoE(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, layer_id: int = 0, reduce_results: bool = True,
                 recorder: Optional[ExpertDistributionRecorder] = None) -> None:
        super().__init__()
        layout = get_expert_layout()
        if num_experts % layout.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split over --ep-size {layout.ep_size}")
        if intermediate_size % layout.moe_tp_size:
            raise ValueError(f"the experts' intermediate size {intermediate_size} is not divisible by "
                             f"--tp-size / --ep-size = {layout.moe_tp_size}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.layer_id = layer_id
        self.reduce_results = reduce_results
        self.recorder = recorder  # the model's, shared by its layers
        self.num_local_experts = num_experts // layout.ep_size
        self.expert_start = layout.ep_rank * self.num_local_experts
        self.moe_tp_rank = layout.moe_tp_rank
        self.intermediate_per_rank = intermediate_size // layout.moe_tp_size
        self.w13 = StackedExpertWeight(self.num_local_experts, 2 * self.intermediate_per_rank, hidden_size)
        self.w2 = StackedExpertWeight(self.num_local_experts, hidden_size, self.intermediate_per_rank)
        set_weight_loader(self.w13.weight, self.weight_loader)
        set_weight_loader(self.w2.weight, self.weight_loader)
        # Packed experts on the CPU: each local expert's gate_up and down as block-wise fp8 weights
        # (layers/block_fp8.py) or as --quantization's per-channel ones (quantize_experts).
        self.packed_experts: Optional[Tuple[List[PackedExpert], List[PackedExpert]]] = None
        # The experts as csrc/moe.c reads them (pack_native): the bf16 stacks packed into panels (a copy that
        # loading weights drops, weight_utils.clear_packed_weights, and packing redoes) or --quantization's
        # int8 / fp8 experts by address.
        self.packed_weight: Optional[linear_kernels.NativeExperts] = None

    def pack_native(self) -> int:
        """The experts for the native kernel (layers/linear.py prepack_linear_weights calls it with the linears):
        the number of bf16 weights packed (two an expert; 0 for quantized experts, taken as they are). None are
        on a GPU, without the kernel library, or for experts it has no format for (block-wise fp8, weight-only
        int8)."""
        self.packed_weight = None
        w13, w2 = self.w13.weight, self.w2.weight
        if self.packed_experts is None:
            if (w13.numel() and linear_kernels.linear_bf16_usable(w13[0])
                    and linear_kernels.linear_bf16_usable(w2[0])):
                self.packed_weight = linear_kernels.NativeExperts.bf16_panels(w13.data, w2.data)
                return 2 * self.num_local_experts
            return 0
        gate_up, down = self.packed_experts
        quantized = [w for w in (*gate_up, *down) if isinstance(w, QuantizedWeight)]
        if (len(quantized) == 2 * self.num_local_experts and library.linear() is not None
                and all(w.qweight.is_cpu and w.qweight.is_contiguous() and w.scale.dtype == torch.float32
                        and w.scale.is_contiguous() and (w.int8_activations or w.is_fp8) for w in quantized)):
            # One method made them all (quantize_experts): the first one's format is every expert's.
            fmt = linear_kernels.CHAIN_FP8 if quantized[0].is_fp8 else linear_kernels.CHAIN_W8A8
            half = self.num_local_experts
            self.packed_weight = linear_kernels.NativeExperts.quantized(
                fmt, [(w.qweight, w.scale) for w in quantized[:half]], [(w.qweight, w.scale) for w in quantized[half:]])
        return 0

    def use_packed_experts(self, w13: Sequence[PackedExpert], w2: Sequence[PackedExpert], dtype: torch.dtype) -> None:
        """Run the experts from these weights (one per local expert); the float stacks are released."""
        if len(w13) != self.num_local_experts or len(w2) != self.num_local_experts:
            raise ValueError(f"expected {self.num_local_experts} packed experts, got {len(w13)} and {len(w2)}")
        self.packed_experts = (list(w13), list(w2))
        self.packed_weight = None
        for stacked in (self.w13, self.w2):
            stacked.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def quantize_experts(self, method: str) -> bool:
        """--quantization on the CPU: each local expert's gate_up and down quantized per output channel, as
        the linears are (SGLang's fp8 / w8a8_int8 MoE methods quantize the experts too). False where the
        experts stay in the model dtype: on a GPU (the Triton fused-MoE kernel reads the float stacks) or
        already packed."""
        w13, w2 = self.w13.weight, self.w2.weight
        if self.packed_experts is not None or w13.device.type != "cpu" or w13.numel() == 0:
            return False
        self.use_packed_experts([quantize_weight(w13.data[e], method) for e in range(self.num_local_experts)],
                                [quantize_weight(w2.data[e], method) for e in range(self.num_local_experts)], w13.dtype)
        return True

    def local_expert(self, shard_id: str) -> Tuple[int, str]:
        """("N:role") -> (this rank's index of expert N, -1 where another EP rank holds it; the role)."""
        expert_text, role = shard_id.split(":", 1)
        local = int(expert_text) - self.expert_start
        return (local if 0 <= local < self.num_local_experts else -1), role

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
        """Copy this rank's piece of one expert's tensor ("N:gate" / "N:up" / "N:down"); an expert held
        by another EP rank is skipped."""
        if not isinstance(shard_id, str) or ":" not in shard_id:
            raise ValueError(f"FusedMoE needs an expert shard id 'N:gate|up|down', got {shard_id!r}")
        expert_text, role = shard_id.split(":", 1)
        local = int(expert_text) - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        size = self.intermediate_per_rank
        if role == "down":
            source = loaded_weight.narrow(1, self.moe_tp_rank * size, size)
            target = param.data[local]
        elif role in ("gate", "up"):
            source = loaded_weight.narrow(0, self.moe_tp_rank * size, size)
            target = param.data[local].narrow(0, 0 if role == "gate" else size, size)
        else:
            raise ValueError(f"unknown expert projection {role!r}")
        if target.shape != source.shape:
            raise ValueError(f"expert {expert_text} {role}: shape mismatch, parameter {tuple(target.shape)} vs "
                             f"checkpoint {tuple(source.shape)}")
        target.copy_(source)

    def checkpoint_piece(self, stacked: torch.Tensor, shard_id: str) -> Tuple[torch.Tensor, int, int]:
        """This rank's part of one expert's checkpoint tensor ("N:gate|up|down") out of a stacked weight:
        (the part, the dimension along which the ranks' parts join, a key unique to the part); an empty
        part where another EP rank holds the expert (get_weights_by_name reassembles the parts)."""
        expert_text, role = shard_id.split(":", 1)
        local = int(expert_text) - self.expert_start
        dim = 1 if role == "down" else 0
        if not 0 <= local < self.num_local_experts:
            shape = (stacked.shape[1], 0) if role == "down" else (0, stacked.shape[2])
            return stacked.new_empty(shape), dim, -1 - get_tp_rank()
        matrix = stacked[local]
        if role != "down":
            size = self.intermediate_per_rank
            matrix = matrix.narrow(0, 0 if role == "gate" else size, size)
        return matrix, dim, self.moe_tp_rank

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's indices, -1 for experts another EP rank holds."""
        if self.num_local_experts == self.num_experts:
            return topk_ids
        local = topk_ids - self.expert_start
        return torch.where((local >= 0) & (local < self.num_local_experts), local, torch.full_like(local, -1))

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor,
                topk: Optional[Tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """The experts' output for hidden_states [T, H] given the router's logits [T, E] (or the
        already selected (weights, ids)), all-reduced over the TP group."""
        weights, ids = topk if topk is not None else select_experts(router_logits, self.top_k, self.renormalize)
        if self.recorder is not None:
            self.recorder.record(self.layer_id, ids)
        local_ids = self.local_ids(ids)
        w13, w2 = self.w13.weight, self.w2.weight
        native = self.packed_weight
        if native is not None and linear_kernels.moe_experts_usable(hidden_states):
            out = linear_kernels.moe_experts(hidden_states, weights, local_ids, native)
        elif self.packed_experts is not None:
            gate_up, down = self.packed_experts
            out = fused_moe_grouped(hidden_states, self.num_local_experts, down[0].n,
                                    lambda x, e: packed_expert_linear(x, gate_up[e]),
                                    lambda x, e: packed_expert_linear(x, down[e]), weights, local_ids)
        elif hidden_states.is_cuda:
            from engine.layers.moe.fused_moe_triton import fused_moe_triton

            out = fused_moe_triton(hidden_states, w13, w2, weights, local_ids)
        else:
            out = fused_moe_native(hidden_states, w13, w2, weights, local_ids)
        if self.reduce_results and get_tp_size() > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
