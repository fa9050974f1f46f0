"""gpt-oss (GptOssForCausalLM): sliding-window and full layers alternating (`layer_types`), attention
with biases and a learned sink logit per head (RadixAttention's sinks: the softmax's denominator only),
and a mixture-of-experts MLP of its own kind: a biased router whose top-k logits are softmaxed, experts
with biases whose gate and up halves are interleaved in one projection (even columns gate, odd ones up)
and a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate).

The experts run as a torch loop over the experts the batch routed to (like transformers). Under tensor
parallelism they follow --ep-size as FusedMoE does (distributed/parallel_state.py ExpertLayout): each
block of tp_size / ep_size ranks holds E / ep_size experts, each with its intermediate dimension split over
the block's ranks (whole gate/up pairs: the interleaved columns 2i, 2i + 1 stay together); the down bias is
added by the block's first rank; the ranks' partial outputs are summed by one all-reduce. The attention's
sinks are split with its heads.

The published checkpoints hold the experts in MXFP4 (`quantization_config.quant_method` "mxfp4"): per
expert projection a `*_blocks` tensor [E, rows, cols / 32, 16] of 4-bit e2m1 codes (two per byte, the
low nibble first) and a `*_scales` tensor [E, rows, cols / 32] of e8m0 exponents (2^(s - 127)) for each
block of 32. They are dequantized here while loading, into the model's dtype (the experts then take
four times their MXFP4 bytes in bf16); every other weight of such a checkpoint is bf16 already.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_expert_layout, get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.pooler import EmbeddingPoolerOutput
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import get_rope
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_loader.weight_utils import ShardId, WeightLoader, load_weights_into, set_weight_loader
from engine.models.llama import STACKED_PARAMS

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch

MAX_EXPERTS = 1024


class GptOssExperts(nn.Module):
    """This rank's stacked experts in the checkpoint's layout: gate_up_proj [E, H, 2I] (gate at even
    columns), down_proj [E, I, H], each with a bias (E and I this rank's parts; see the module doc)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__()
        layout = get_expert_layout()
        if num_experts % layout.ep_size or intermediate % layout.moe_tp_size:
            raise ValueError(f"gpt-oss: {num_experts} experts of intermediate size {intermediate} cannot be split "
                             f"over --ep-size {layout.ep_size} and --tp-size / --ep-size {layout.moe_tp_size}")
        self.num_experts = num_experts
        self.num_local = num_experts // layout.ep_size
        self.expert_start = layout.ep_rank * self.num_local
        self.inter = intermediate // layout.moe_tp_size
        self.inter_start = layout.moe_tp_rank * self.inter
        self.adds_down_bias = layout.moe_tp_rank == 0
        self.alpha = alpha
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, hidden, 2 * self.inter), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(self.num_local, 2 * self.inter), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(self.num_local, self.inter, hidden), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(self.num_local, hidden), requires_grad=False)
        # The checkpoint's [E, ...] tensors: this rank's experts, then its intermediate columns / rows.
        for param, dim, width in ((self.gate_up_proj, 2, 2), (self.gate_up_proj_bias, 1, 2), (self.down_proj, 1, 1),
                                  (self.down_proj_bias, None, 0)):
            set_weight_loader(param, self._loader(dim, width))

    def _loader(self, dim: Optional[int], width: int) -> WeightLoader:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            if loaded.shape[0] != self.num_experts:
                raise ValueError(f"gpt-oss experts: the checkpoint holds {loaded.shape[0]} experts, the config "
                                 f"{self.num_experts}")
            part = loaded.narrow(0, self.expert_start, self.num_local)
            if dim is not None:
                part = part.narrow(dim, width * self.inter_start, width * self.inter)
            elif not self.adds_down_bias:  # the down bias: once per expert, by its block's first rank
                part = torch.zeros_like(part)
            if part.shape != param.shape:
                raise ValueError(f"gpt-oss experts: shape mismatch, parameter {tuple(param.shape)} vs checkpoint "
                                 f"part {tuple(part.shape)}")
            param.data.copy_(part)

        return load

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids / weights [T, k] -> [T, H] (this rank's part of the sum); summed in float32."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if self.num_local != self.num_experts:  # other ranks' experts: -1, skipped
            local = expert_ids - self.expert_start
            expert_ids = torch.where((local >= 0) & (local < self.num_local), local, -1)
        for expert in torch.unique(expert_ids).tolist():
            if expert < 0:
                continue
            tokens, slot = torch.where(expert_ids == expert)
            gate_up = x[tokens] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            gate = gate_up[:, ::2].clamp(max=self.limit)
            up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
            hidden = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
            y = hidden @ self.down_proj[expert] + self.down_proj_bias[expert]
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).float())
        return out.to(x.dtype)


class GptOssMoE(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        raw = config.raw_config
        num_experts = int(raw["num_local_experts"])
        self.top_k = int(raw["num_experts_per_tok"])
        if not 1 <= num_experts <= MAX_EXPERTS or not 1 <= self.top_k <= num_experts:
            raise ValueError(f"gpt-oss: num_local_experts {num_experts} must be in 1..{MAX_EXPERTS} and "
                             f"num_experts_per_tok {self.top_k} in 1..num_local_experts")
        self.router = nn.Linear(config.hidden_size, num_experts, bias=True)
        self.router.requires_grad_(False)
        self.experts = GptOssExperts(num_experts, config.hidden_size, config.intermediate_size,
                                     float(raw.get("swiglu_alpha", 1.702)), float(raw.get("swiglu_limit", 7.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, expert_ids = torch.topk(self.router(x), self.top_k, dim=-1)
        # The softmax is over the chosen experts' logits only (renormalised by construction).
        weights = torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype)
        out = self.experts(x, expert_ids, weights)
        return tensor_model_parallel_all_reduce(out) if get_tp_size() > 1 else out


class GptOssAttention(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=True)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=True)
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, config.context_len, config.rope_theta,
                                   config.rope_scaling)
        self.attn = RadixAttention(self.qkv_proj.num_heads, self.head_dim, self.head_dim**-0.5,
                                   self.qkv_proj.num_kv_heads, layer_id,
                                   sliding_window_size=config.layer_windows[layer_id], with_sinks=True)
        assert self.attn.sinks is not None  # with_sinks
        heads, first = self.qkv_proj.num_heads, get_tp_rank() * self.qkv_proj.num_heads

        def load_sinks(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
            if loaded.shape != (heads * get_tp_size(),):
                raise ValueError(f"gpt-oss sinks: expected {heads * get_tp_size()} values, got {tuple(loaded.shape)}")
            param.data.copy_(loaded.narrow(0, first, heads))

        set_weight_loader(self.attn.sinks, load_sinks)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k, inplace=True)  # slices of the qkv output, ours to change
        return self.o_proj(self.attn(q, k, v, forward_batch))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_id)
        self.mlp = GptOssMoE(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch",
                residual: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class GptOssModel(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        layers = [GptOssDecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.decoder_layers: List[GptOssDecoderLayer] = layers
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual: Optional[torch.Tensor] = None
        for layer in self.decoder_layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        if residual is None:
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GptOssForCausalLM(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        if not config.layer_windows:
            raise ValueError("a gpt-oss config needs its layers' windows (ModelConfig.layer_windows)")
        self.config = config
        self.model = GptOssModel(config)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                get_embedding: bool = False) -> Union[LogitsProcessorOutput, EmbeddingPoolerOutput]:
        if get_embedding:
            raise ValueError("gpt-oss is served for generation only")
        hidden_states = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    stacked_params: Sequence[Tuple[str, str, ShardId]] = STACKED_PARAMS

    def weight_skip_substrings(self) -> List[str]:
        skip = ["rotary_emb.inv_freq"]
        if self.config.tie_word_embeddings:
            skip.append("lm_head.weight")
        return skip

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool = True) -> None:
        load_weights_into(self, _renamed(weights), self.stacked_params, skip_substrings=self.weight_skip_substrings(),
                          require_all=require_all)


# The 16 values of an e2m1 code (sign, 2 exponent bits, 1 mantissa bit).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, rows, cols / 32, 16] codes and [E, rows, cols / 32] exponents -> [E, cols, rows] float32 (the
    bf16 checkpoint's layout: the projection's input dimension first)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() != 4 or blocks.shape[-1] != MXFP4_BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"([E, rows, groups, {MXFP4_BLOCK // 2}] and [E, rows, groups])")
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [E, rows, groups, 32]
    values = torch.ldexp(lut[codes], scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2).transpose(1, 2).contiguous()


def _renamed(weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterable[Tuple[str, torch.Tensor]]:
    """The checkpoint's names onto ours: the sinks belong to the attention layer (self_attn.attn.sinks);
    an MXFP4 expert projection's blocks and scales (in either order) become its dequantized weight."""
    pending: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if name.endswith(("_blocks", "_scales")):
            base, _, part = name.rpartition("_")
            parts = pending.setdefault(base, {})
            parts[part] = tensor
            if len(parts) == 2:
                del pending[base]
                try:
                    yield base, dequantize_mxfp4(parts["blocks"], parts["scales"])
                except ValueError as e:
                    raise ValueError(f"gpt-oss checkpoint weight {base}: {e}") from None
            continue
        if name.endswith(".self_attn.sinks"):
            name = name[: -len("sinks")] + "attn.sinks"
        yield name, tensor
    if pending:
        base = next(iter(pending))
        raise ValueError(f"gpt-oss checkpoint weight {base}: MXFP4 {'blocks' if 'blocks' in pending[base] else 'scales'} "
                         "without their " + ("scales" if "blocks" in pending[base] else "blocks"))
