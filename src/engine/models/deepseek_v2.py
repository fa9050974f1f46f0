"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) and DeepSeek's mixture of experts.

Attention (DeepseekV2AttentionMLA) runs SGLang's absorbed path for prefill and decode alike. Each token
stores one latent c = norm(kv_a(x)) [kv_lora_rank] and one rotated rope key k_pe [qk_rope_head_dim]
(mem_cache/mla_pool.py). kv_b_proj would expand c into every head's k_nope and v; instead its two
halves are folded into the query and the output: head h's score q_nope . (W_kc[h] c) equals
(W_kc[h]^T q_nope) . c, so the query is mapped into the latent space and attends over [c, k_pe]
as one K/V head shared by all heads (MQA with K of kv_lora_rank + rope values and V = c), and the
latent-space output is mapped back through W_vc[h] before o_proj. W_kc and W_vc are views of
kv_b_proj's weight taken at each forward, so weight updates need no rebuild.

The rope of both families rotates interleaved pairs (x0, x1), (x2, x3), ... (V3 unless its config sets
rope_interleave false). Scores only ever pair q_pe with k_pe, so both are de-interleaved ([evens,
odds], the same permutation) and rotated in the half-split (NeoX) layout of layers/rotary_embedding.py.
YaRN's mscale_all_dim also scales the softmax (by mscale^2), as DeepSeek's reference does.

Mixture of experts (DeepseekMoE): the first first_k_dense_replace layers (and those off
moe_layer_freq) have a dense MLP; the others route to n_routed_experts through layers/moe's FusedMoE
and add n_shared_experts always-on experts (one MLP of n_shared_experts x moe_intermediate_size).
V2 scores with a softmax (topk_method group_limited_greedy limits the choice to the topk_group best of
n_group groups); V3 with a sigmoid, choosing on score + e_score_correction_bias within its best groups.
norm_topk_prob renormalises the kept weights, routed_scaling_factor scales them.

TP splits the heads and replicates the latents (layers/mla_linear.py); the experts split as FusedMoE does.
Limits: the torch_native attention backend (ModelRunner falls back to it); no LoRA
(configs/mla_config.check_mla_server_args). PD moves the latent pool's one plane per layer. Speculative
decoding runs with every algorithm (the latent pool takes tree masks and moves, a DeepSeek-shaped draft
gets a latent pool); V3's MTP layer is the NEXTN draft (models/deepseek_nextn.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.configs.mla_config import MLADims, mla_dims_of
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.mla_linear import LatentExpansion, ReplicatedLinear
from engine.layers.moe.expert_distribution import ExpertDistributionRecorder
from engine.layers.moe.layer import QWEN_EXPERT_NAMES, FusedMoE, expert_params_mapping
from engine.layers.moe.router import select_experts_grouped
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import get_rope
from engine.model_loader.weight_utils import ShardId
from engine.models.llama import STACKED_PARAMS, LlamaMLP
from engine.models.sparse_moe import MoeForCausalLM, MoeSpec

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch

# transformers builds the latent norms with RMSNorm's default epsilon, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def yarn_softmax_mscale(rope_scaling: Optional[Dict[str, Any]]) -> float:
    """The factor YaRN's mscale_all_dim puts on the softmax scale (squared: it applies to q and k)."""
    if not rope_scaling or rope_scaling.get("rope_type", "default") == "default":
        return 1.0
    mscale_all_dim = float(rope_scaling.get("mscale_all_dim") or 0.0)
    factor = float(rope_scaling.get("factor") or 1.0)
    if not mscale_all_dim or factor <= 1:
        return 1.0
    mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return mscale * mscale


def deinterleave(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """[T, n * rope_dim] with pairs interleaved -> the same rows as [evens, odds] per head."""
    rows = x.shape[0]
    return x.reshape(rows, -1, rope_dim // 2, 2).transpose(-1, -2).reshape(rows, -1)


class DeepseekV2AttentionMLA(nn.Module):
    def __init__(self, config: "ModelConfig", dims: MLADims, layer_id: int, interleaved_rope: bool) -> None:
        super().__init__()
        self.dims = dims
        total_heads = config.num_attention_heads
        bias = config.attention_bias
        hidden = config.hidden_size
        # Over TP ranks the heads are split (q's output, kv_b_proj's rows, o_proj's input) and the
        # latents replicated: every rank computes and stores the whole latent of every token.
        self.kv_b_proj = LatentExpansion(total_heads, dims.qk_nope_head_dim, dims.v_head_dim, dims.kv_lora_rank)
        self.num_heads = self.kv_b_proj.heads  # this rank's
        self.q_proj: Optional[ColumnParallelLinear] = None
        self.q_a_proj: Optional[ReplicatedLinear] = None
        self.q_a_layernorm: Optional[RMSNorm] = None
        self.q_b_proj: Optional[ColumnParallelLinear] = None
        if dims.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_heads * dims.qk_head_dim, bias=False)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, dims.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(dims.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(dims.q_lora_rank, total_heads * dims.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, dims.cache_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(dims.kv_lora_rank, LATENT_NORM_EPS)
        self.o_proj = RowParallelLinear(total_heads * dims.v_head_dim, hidden, bias=bias)
        self.interleaved_rope = interleaved_rope
        self.rotary_emb = get_rope(dims.qk_rope_head_dim, dims.qk_rope_head_dim, config.context_len,
                                   config.rope_theta, config.rope_scaling)
        scaling = dims.qk_head_dim ** -0.5 * yarn_softmax_mscale(config.rope_scaling)
        # One K/V head of [latent, rope key]; V is the latent alone.
        self.attn = RadixAttention(self.num_heads, dims.cache_dim, scaling, 1, layer_id,
                                   v_head_dim=dims.kv_lora_rank)

    def _query(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(hidden_states)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch",
                last_rows_only: bool = False) -> torch.Tensor:
        dims, heads = self.dims, self.num_heads
        rows = hidden_states.shape[0]
        q = self._query(hidden_states).view(rows, heads, dims.qk_head_dim)
        q_nope, q_pe = q.split([dims.qk_nope_head_dim, dims.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe = q_pe.reshape(rows, heads * dims.qk_rope_head_dim)
        k_pe = k_pe.contiguous()
        if self.interleaved_rope:
            q_pe, k_pe = deinterleave(q_pe, dims.qk_rope_head_dim), deinterleave(k_pe, dims.qk_rope_head_dim)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        w_kc, w_vc = self.kv_b_proj.halves()
        # q_nope into the latent space, per head: [heads, rows, nope] @ [heads, nope, latent].
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)
        query = torch.cat([q_latent, q_pe.view(rows, heads, dims.qk_rope_head_dim)], dim=-1)
        key = torch.cat([latent, k_pe], dim=-1)
        out = self.attn(query.reshape(rows, -1), key, latent, forward_batch, last_rows_only=last_rows_only)
        # Back out of the latent space: [heads, rows, latent] @ [heads, latent, v].
        out = torch.bmm(out.view(-1, heads, dims.kv_lora_rank).transpose(0, 1), w_vc.transpose(1, 2))
        return self.o_proj(out.transpose(0, 1).reshape(-1, heads * dims.v_head_dim))


@dataclass(frozen=True)
class DeepseekRouting:
    """How DeepSeek's gate picks experts (the rest of the MoE shape is the MoeSpec)."""

    scoring: str  # "softmax" (V2) or "sigmoid" (V3)
    num_groups: int
    topk_groups: int
    routed_scaling_factor: float
    correction_bias: bool  # V3's e_score_correction_bias

    @classmethod
    def from_config(cls, raw: Dict[str, Any], v3: bool, spec: MoeSpec) -> "DeepseekRouting":
        grouped = v3 or raw.get("topk_method") == "group_limited_greedy"
        num_groups = int(raw.get("n_group") or 1) if grouped else 1
        topk_groups = int(raw.get("topk_group") or num_groups) if grouped else 1
        scoring = str(raw.get("scoring_func") or ("sigmoid" if v3 else "softmax"))
        routing = cls(scoring, num_groups, topk_groups, float(raw.get("routed_scaling_factor") or 1.0), v3)
        per_group = spec.num_experts // max(num_groups, 1)
        if num_groups < 1 or spec.num_experts % num_groups:
            raise ValueError(f"n_group {num_groups} must divide the {spec.num_experts} routed experts")
        if not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_group {topk_groups} must be in [1, n_group = {num_groups}]")
        if spec.top_k > topk_groups * per_group:
            raise ValueError(f"num_experts_per_tok {spec.top_k} exceeds the {topk_groups * per_group} experts of "
                             f"the topk_group best groups")
        if scoring == "sigmoid" and num_groups > 1 and per_group < 2:
            raise ValueError("sigmoid routing ranks groups by their two best experts: n_group must leave >= 2 "
                             "experts per group")
        return routing


class DeepseekGate(nn.Module):
    """The router: logits in float32 (transformers keeps this weight in float32), and V3's bias."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.e_score_correction_bias: Optional[nn.Parameter] = (
            nn.Parameter(torch.zeros(num_experts), requires_grad=False) if correction_bias else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden_states.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    def __init__(self, config: "ModelConfig", spec: MoeSpec, routing: DeepseekRouting, layer_id: int,
                 recorder: Optional[ExpertDistributionRecorder]) -> None:
        super().__init__()
        self.spec, self.routing = spec, routing
        self.gate = DeepseekGate(config.hidden_size, spec.num_experts, routing.correction_bias)
        self.experts = FusedMoE(spec.num_experts, spec.top_k, config.hidden_size, spec.moe_intermediate_size,
                                spec.renormalize, layer_id=layer_id, recorder=recorder)
        self.shared_experts: Optional[LlamaMLP] = (
            LlamaMLP(config.hidden_size, spec.shared_expert_intermediate_size, config.hidden_act)
            if spec.shared_expert_intermediate_size else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.gate(hidden_states)
        routing = self.routing
        topk = select_experts_grouped(logits, self.spec.top_k, routing.scoring, self.spec.renormalize,
                                      routing.routed_scaling_factor, routing.num_groups, routing.topk_groups,
                                      self.gate.e_score_correction_bias)
        out = self.experts(hidden_states, logits, topk=topk)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: "ModelConfig", dims: MLADims, layer_id: int, interleaved_rope: bool, spec: MoeSpec,
                 routing: DeepseekRouting, recorder: Optional[ExpertDistributionRecorder]) -> None:
        super().__init__()
        self.self_attn = DeepseekV2AttentionMLA(config, dims, layer_id, interleaved_rope)
        mlp_bias = bool(config.raw_config.get("mlp_bias", False))
        self.mlp: Union[DeepseekMoE, LlamaMLP] = (
            DeepseekMoE(config, spec, routing, layer_id, recorder) if spec.is_sparse(layer_id)
            else LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=mlp_bias))
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


def deepseek_moe_spec(raw: Dict[str, Any]) -> MoeSpec:
    """The MoE shape in MoeSpec's terms (what /get_server_info reports): every layer before
    first_k_dense_replace, or off moe_layer_freq, is dense."""
    num_layers = int(raw["num_hidden_layers"])
    first_dense = int(raw.get("first_k_dense_replace") or 0)
    freq = int(raw.get("moe_layer_freq") or 1)
    dense = tuple(i for i in range(num_layers) if i < first_dense or i % freq)
    return MoeSpec(num_experts=int(raw["n_routed_experts"]), top_k=int(raw["num_experts_per_tok"]),
                   moe_intermediate_size=int(raw["moe_intermediate_size"]),
                   renormalize=bool(raw.get("norm_topk_prob", False)),
                   shared_expert_intermediate_size=int(raw.get("n_shared_experts") or 0) * int(raw["moe_intermediate_size"]),
                   mlp_only_layers=dense)


class DeepseekV2ForCausalLM(MoeForCausalLM):
    v3 = False

    @staticmethod
    def moe_spec(config: "ModelConfig") -> MoeSpec:
        return deepseek_moe_spec(config.raw_config)

    def layer_factory(self, config: "ModelConfig", qkv_bias: bool, o_bias: bool,
                      qk_norm: bool) -> Optional[Callable[[int], nn.Module]]:
        dims = mla_dims_of(config.raw_config)
        if dims is None:
            raise ValueError(f"{config.architectures} needs kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim and "
                             "v_head_dim in its config.json")
        spec = self.moe_spec(config)
        self.moe = spec
        routing = DeepseekRouting.from_config(config.raw_config, self.v3, spec)
        # DeepSeek-V2 always rotates interleaved pairs; V3's config may say otherwise.
        interleaved = bool(config.raw_config.get("rope_interleave", True)) if self.v3 else True
        self.expert_recorder = ExpertDistributionRecorder(config.num_hidden_layers, spec.num_experts)
        recorder = self.expert_recorder

        def make_layer(layer_id: int) -> nn.Module:
            return DeepseekDecoderLayer(config, dims, layer_id, interleaved, spec, routing, recorder)

        experts = [(f"mlp.{ckpt}", f"mlp.{ours}", shard)
                   for ckpt, ours, shard in expert_params_mapping(spec.num_experts, QWEN_EXPERT_NAMES)]
        stacked: List[Tuple[str, str, ShardId]] = [*experts, *STACKED_PARAMS]
        self.stacked_params = stacked
        return make_layer


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True

    def weight_skip_substrings(self) -> List[str]:
        # V3 checkpoints carry a multi-token-prediction layer past num_hidden_layers (SGLang serves it
        # as a NextN draft); plain decoding has no use for it.
        skip = super().weight_skip_substrings()
        return skip + [f"model.layers.{self.config.num_hidden_layers}."]
