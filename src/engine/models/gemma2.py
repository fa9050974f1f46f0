"""Gemma 2 (Gemma2ForCausalLM), and the decoder Gemma 3's text model (gemma3.py) shares.

What sets the Gemma decoders apart from Llama: local (sliding-window) and global layers alternate
(ModelConfig.layer_windows); every sub-block is wrapped in two norms (pre and post) before its residual
add; RMSNorm scales by (1 + weight); the embedding is multiplied by sqrt(hidden_size); attention is
scaled by query_pre_attn_scalar ** -0.5 (not head_dim), its scores soft-capped
(`attn_logit_softcapping`, Gemma 2), and so are the final logits (`final_logit_softcapping`); the MLP
is gated by gelu's tanh approximation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
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

# A layer's rotary embedding: (base, rope_scaling or None).
RopeParams = Tuple[float, Optional[Dict[str, Any]]]

_GELU_TANH_NAMES = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new", "gelu_fast")


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in float32 as Hugging Face's Gemma norms (the checkpoints store
    weight - 1: a zero weight is the identity scale)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


def _float_field(config: "ModelConfig", name: str) -> float:
    """An optional float of config.json, 0.0 where it is absent or null (soft-caps: none)."""
    value = config.raw_config.get(name)
    return float(value) if value else 0.0


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str) -> None:
        super().__init__()
        if activation not in _GELU_TANH_NAMES:
            raise ValueError(f"unsupported Gemma hidden_activation {activation!r}; supported: {_GELU_TANH_NAMES}")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int, rope: RopeParams, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        window = config.layer_windows[layer_id]
        self.rotary_emb = get_rope(self.head_dim, self.head_dim, config.context_len, rope[0], rope[1])
        self.q_norm: Optional[GemmaRMSNorm] = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm: Optional[GemmaRMSNorm] = GemmaRMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        scalar = config.raw_config.get("query_pre_attn_scalar") or config.head_dim
        self.attn = RadixAttention(self.qkv_proj.num_heads, self.head_dim, float(scalar) ** -0.5,
                                   self.qkv_proj.num_kv_heads, layer_id, sliding_window_size=window,
                                   logit_cap=_float_field(config, "attn_logit_softcapping"))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch",
                last_rows_only: bool = False) -> torch.Tensor:
        """last_rows_only: as LlamaAttention.forward (each request's last row of an extend alone)."""
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q.contiguous(), k.contiguous(), inplace=True)
        return self.o_proj(self.attn(q, k, v, forward_batch, last_rows_only=last_rows_only))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int, rope: RopeParams, qk_norm: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, layer_id, rope, qk_norm)
        activation = str(config.raw_config.get("hidden_activation") or config.raw_config.get("hidden_act")
                         or "gelu_pytorch_tanh")
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size, activation)
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch",
                last_rows_only: bool = False) -> torch.Tensor:
        """last_rows_only: as LlamaDecoderLayer.forward (the last layer of an extend whose other rows
        feed nothing: every row's K/V stored, the rest on each request's last row)."""
        attn = self.self_attn(positions, self.input_layernorm(hidden_states), forward_batch, last_rows_only)
        if last_rows_only:
            hidden_states = hidden_states.index_select(0, forward_batch.last_positions())
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class GemmaModel(nn.Module):
    def __init__(self, config: "ModelConfig", ropes: Sequence[RopeParams], qk_norm: bool) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        layers = [GemmaDecoderLayer(config, i, ropes[i], qk_norm) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.decoder_layers: List[GemmaDecoderLayer] = layers
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                last_rows_only: bool = False) -> torch.Tensor:
        """last_rows_only: of an extend batch, return each request's last row only."""
        hidden_states = self.embed_tokens(input_ids)
        # The scale is rounded to the model's dtype first, as Hugging Face does.
        hidden_states = hidden_states * torch.tensor(self.hidden_size**0.5, dtype=hidden_states.dtype)
        last = len(self.decoder_layers) - 1
        for i, layer in enumerate(self.decoder_layers):
            hidden_states = layer(positions, hidden_states, forward_batch, last_rows_only and i == last)
        if last_rows_only and last < 0:  # no layers
            hidden_states = hidden_states.index_select(0, forward_batch.last_positions())
        return self.norm(hidden_states)


class Gemma2ForCausalLM(nn.Module):
    qk_norm: bool = False  # Gemma 3 normalises q and k per head

    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        if not config.layer_windows:
            raise ValueError("a Gemma config needs its layers' windows (ModelConfig.layer_windows)")
        self.config = config
        self.model = GemmaModel(config, self.layer_ropes(config), self.qk_norm)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config, logit_softcap=_float_field(config, "final_logit_softcapping"))

    def layer_ropes(self, config: "ModelConfig") -> List[RopeParams]:
        """Each layer's rotary base and scaling: the same for all of Gemma 2's layers."""
        return [(config.rope_theta, config.rope_scaling)] * config.num_hidden_layers

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                get_embedding: bool = False) -> Union[LogitsProcessorOutput, EmbeddingPoolerOutput]:
        if get_embedding:
            raise ValueError("Gemma models are served for generation only")
        last_rows_only = self.logits_processor.last_rows_suffice(forward_batch)
        hidden_states = self.model(input_ids, positions, forward_batch, last_rows_only)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch, pruned=last_rows_only)

    stacked_params: Sequence[Tuple[str, str, ShardId]] = STACKED_PARAMS

    def weight_skip_substrings(self) -> List[str]:
        skip = ["rotary_emb.inv_freq"]
        if self.config.tie_word_embeddings:
            skip.append("lm_head.weight")  # the head is the embedding
        return skip

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool = True) -> None:
        load_weights_into(self, weights, self.stacked_params, skip_substrings=self.weight_skip_substrings(),
                          require_all=require_all)
