"""gpt-oss (GptOssForCausalLM): sliding-window and full layers alternating (`layer_types`), attention
with biases and a learned sink logit per head (RadixAttention's sinks: the softmax's denominator only),
and a mixture-of-experts MLP of its own kind: a biased router whose top-k logits are softmaxed, experts
with biases whose gate and up halves are interleaved in one projection (even columns gate, odd ones up)
and a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate).

The experts run as a torch loop over the experts the batch routed to (like transformers), on one TP
rank: their weights, and the sinks, are not split across ranks yet, so --tp-size > 1 is refused.

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

from engine.distributed.parallel_state import get_tp_size
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import QKVParallelLinear, RowParallelLinear
from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.pooler import EmbeddingPoolerOutput
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import get_rope
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_loader.weight_utils import ShardId, load_weights_into
from engine.models.llama import STACKED_PARAMS

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch

MAX_EXPERTS = 1024


class GptOssExperts(nn.Module):
    """Stacked experts in the checkpoint's layout: gate_up_proj [E, H, 2I] (gate at even columns),
    down_proj [E, I, H], each with a bias."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.alpha = alpha
        self.limit = limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate, hidden), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], expert_ids / weights [T, k] -> [T, H]; summed in float32."""
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for expert in torch.unique(expert_ids).tolist():
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
        return self.experts(x, expert_ids, weights)


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
        if get_tp_size() > 1:
            raise ValueError("gpt-oss runs on one TP rank for now (its experts and sinks are not split): "
                             "use --tp-size 1 (or --dp-size for replicas)")
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
