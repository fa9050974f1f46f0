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

from engine.layers.layernorm import RMSNorm
from engine.layers.moe.expert_distribution import ExpertDistributionRecorder
from engine.layers.moe.layer import QWEN_EXPERT_NAMES, FusedMoE, expert_params_mapping
from engine.model_loader.weight_utils import ShardId
from engine.models.llama import STACKED_PARAMS, LlamaAttention, LlamaForCausalLM, LlamaMLP

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch

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


class SparseMoeBlock(nn.Module):
    def __init__(self, config: "ModelConfig", spec: MoeSpec, layer_id: int,
                 recorder: Optional[ExpertDistributionRecorder]) -> None:
        super().__init__()
        # The router is small and replicated: every rank routes every token the same way.
        self.gate = nn.Linear(config.hidden_size, spec.num_experts, bias=False)
        self.experts = FusedMoE(spec.num_experts, spec.top_k, config.hidden_size, spec.moe_intermediate_size,
                                spec.renormalize, layer_id=layer_id, recorder=recorder)
        self.shared_expert: Optional[LlamaMLP] = None
        self.shared_expert_gate: Optional[nn.Linear] = None
        if spec.shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config.hidden_size, spec.shared_expert_intermediate_size, config.hidden_act)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # built together
            shared = self.shared_expert(hidden_states)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return out


class MoeDecoderLayer(nn.Module):
    """LlamaDecoderLayer's structure with the sparse block (or, on a dense layer, a Llama MLP)."""

    def __init__(self, config: "ModelConfig", layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 spec: MoeSpec, recorder: Optional[ExpertDistributionRecorder]) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, o_bias, qk_norm)
        self.mlp: Union[SparseMoeBlock, LlamaMLP] = (
            SparseMoeBlock(config, spec, layer_id, recorder) if spec.is_sparse(layer_id)
            else LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch",
                residual: Optional[torch.Tensor], last_rows_only: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
        """As LlamaDecoderLayer.forward (the residual stream carried beside, last_rows_only pruning)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch, last_rows_only)
        if last_rows_only:
            residual = residual.index_select(0, forward_batch.last_positions())
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


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
            return MoeDecoderLayer(config, layer_id, qkv_bias, o_bias, qk_norm, spec, recorder)

        # The checkpoint's per-expert tensors (and Mixtral's block name) route to the stacked weights.
        experts = [(f"{self.block_name}.{ckpt}", f"mlp.{ours}", shard)
                   for ckpt, ours, shard in expert_params_mapping(spec.num_experts, self.expert_names)]
        renamed: List[Tuple[str, str, ShardId]] = (
            [(f"{self.block_name}.gate", "mlp.gate", None)] if self.block_name != "mlp" else [])
        self.stacked_params = [*experts, *renamed, *STACKED_PARAMS]
        return make_layer
