"""The mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE): Llama's attention and norms, with
a sparse block (router, FusedMoE experts, optionally a gated shared expert) in place of the MLP on
the layers the config makes sparse.

The models differ in their config names and a few switches (MoeSpec): Mixtral routes with
renormalised top-k weights on every layer; Qwen2-MoE adds a shared expert scaled by a sigmoid gate and
renormalises only with norm_topk_prob; Qwen3-MoE has q/k norms and no shared expert. Qwen's
decoder_sparse_step / mlp_only_layers leave some layers dense (a Llama MLP of intermediate_size).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from engine.layers.moe.expert_distribution import ExpertDistributionRecorder
from engine.layers.moe.layer import QWEN_EXPERT_NAMES, expert_params_mapping
from engine.layers.moe.sparse_block import SparseMoeBlock
from engine.model_loader.weight_utils import ShardId
from engine.models.llama import STACKED_PARAMS, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig

# Bounds on what a config may ask (a bad config.json fails at load with a clear message).
MAX_EXPERTS = 1024


@dataclass(frozen=True)
class MoeSpec:
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    renormalize: bool
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: Tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts <= MAX_EXPERTS:
            raise ValueError(f"the config's expert count {self.num_experts} must be in [1, {MAX_EXPERTS}]")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {self.num_experts}]")
        if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
            raise ValueError("the experts' intermediate size and decoder_sparse_step must be >= 1")

    def is_sparse(self, layer_id: int) -> bool:
        """Whether the layer's MLP is the sparse block (Qwen's rule; every layer for Mixtral)."""
        return layer_id not in self.mlp_only_layers and (layer_id + 1) % self.decoder_sparse_step == 0

    @classmethod
    def from_mixtral(cls, raw: Dict[str, Any]) -> "MoeSpec":
        return cls(num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
                   moe_intermediate_size=int(raw["intermediate_size"]), renormalize=True)

    @classmethod
    def from_qwen(cls, raw: Dict[str, Any]) -> "MoeSpec":
        # Qwen's checkpoints say num_experts; transformers v5 writes the same field as num_local_experts.
        num_experts = raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]
        return cls(num_experts=int(num_experts), top_k=int(raw["num_experts_per_tok"]),
                   moe_intermediate_size=int(raw["moe_intermediate_size"]),
                   renormalize=bool(raw.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
                   decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
                   mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()))


class MoeForCausalLM(LlamaForCausalLM):
    """The causal LM of a mixture-of-experts family; subclasses say how to read the config and what
    the checkpoint calls the sparse block and its experts' projections."""

    block_name = "mlp"  # the checkpoint's name of a layer's sparse block (Mixtral: block_sparse_moe)
    expert_names: Sequence[Tuple[str, str, str]] = QWEN_EXPERT_NAMES

    @staticmethod
    def moe_spec(config: "ModelConfig") -> MoeSpec:
        return MoeSpec.from_qwen(config.raw_config)

    def expert_layout(self, ep_size: int) -> Dict[str, int]:
        """The experts as /get_server_info reports them (the TP split is parallel_state.ExpertLayout)."""
        sparse = sum(self.moe.is_sparse(i) for i in range(self.config.num_hidden_layers))
        return {"num_experts": self.moe.num_experts, "num_experts_per_tok": self.moe.top_k, "ep_size": ep_size,
                "num_local_experts": self.moe.num_experts // ep_size, "num_moe_layers": sparse,
                "moe_intermediate_size": self.moe.moe_intermediate_size,
                "shared_expert_intermediate_size": self.moe.shared_expert_intermediate_size}

    def layer_factory(self, config: "ModelConfig", qkv_bias: bool, o_bias: bool,
                      qk_norm: bool) -> Optional[Callable[[int], nn.Module]]:
        spec = self.moe_spec(config)
        self.moe = spec
        self.expert_recorder = ExpertDistributionRecorder(config.num_hidden_layers, spec.num_experts)
        recorder = self.expert_recorder

        def make_layer(layer_id: int) -> nn.Module:
            mlp: Union[SparseMoeBlock, LlamaMLP]
            if spec.is_sparse(layer_id):
                shared = (LlamaMLP(config.hidden_size, spec.shared_expert_intermediate_size, config.hidden_act)
                          if spec.shared_expert_intermediate_size else None)
                mlp = SparseMoeBlock(config.hidden_size, spec.num_experts, spec.top_k, spec.moe_intermediate_size,
                                     spec.renormalize, layer_id, recorder, shared)
            else:
                mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
            return LlamaDecoderLayer(config, layer_id, qkv_bias, o_bias, qk_norm, mlp)

        # The checkpoint's per-expert tensors (and Mixtral's block name) route to the stacked weights.
        experts = [(f"{self.block_name}.{ckpt}", f"mlp.{ours}", shard)
                   for ckpt, ours, shard in expert_params_mapping(spec.num_experts, self.expert_names)]
        renamed: List[Tuple[str, str, ShardId]] = (
            [(f"{self.block_name}.gate", "mlp.gate", None)] if self.block_name != "mlp" else [])
        self.stacked_params = [*experts, *renamed, *STACKED_PARAMS]
        return make_layer
