"""Llama decoder (also the base of Mistral, Qwen2 and Qwen3), written for the paged KV pool.

A forward takes the flat token batch `input_ids [T]`, `positions [T]` and the ForwardBatch that
tells RadixAttention where each token's K/V live. Subclasses only flip a few switches: bias on
the QKV projection (Qwen2) and per-head RMSNorm of q and k before rotary (Qwen3).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from engine.distributed.parallel_state import get_tp_size
from engine.layers.activation import SiluAndMul
from engine.layers.layernorm import RMSNorm
from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.moe.sparse_block import SparseMoeBlock
from engine.layers.pooler import EmbeddingPoolerOutput, Pooler
from engine.layers.radix_attention import RadixAttention
from engine.layers.rotary_embedding import get_rope
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_loader.weight_utils import ShardId, load_weights_into
from engine.kernels.decoder_layers import DecoderLayersCache

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# checkpoint name piece -> (our fused parameter name piece, shard id)
STACKED_PARAMS = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only silu is supported")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x, self.act_fn))


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: "ModelConfig",
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
    ) -> None:
        super().__init__()
        tp_size = get_tp_size()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=qkv_bias
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias)
        assert self.num_heads == config.num_attention_heads // tp_size
        self.rotary_emb = get_rope(
            self.head_dim, self.head_dim, config.context_len, config.rope_theta, config.rope_scaling
        )
        self.q_norm: Optional[RMSNorm] = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm: Optional[RMSNorm] = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        # Mistral (and Qwen2 with use_sliding_window) window some or all layers.
        window = config.layer_windows[layer_id] if config.layer_windows else -1
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id,
                                   sliding_window_size=window)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: "ForwardBatch",
                last_rows_only: bool = False) -> torch.Tensor:
        """last_rows_only: of an extend batch, the output at each request's last row alone (every row's
        K/V is stored)."""
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            assert self.k_norm is not None  # qk_norm builds both
            # Qwen3: RMSNorm over each head's vector, before rotary.
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.q_size)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
        q, k = self.rotary_emb(positions, q, k, inplace=True)  # q, k are slices of qkv, ours to change
        return self.o_proj(self.attn(q, k, v, forward_batch, last_rows_only=last_rows_only))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 mlp: Optional[Union[LlamaMLP, SparseMoeBlock]] = None) -> None:
        """mlp: the layer's MLP where it is not the config's Llama MLP (a mixture-of-experts layer's sparse
        block: models/sparse_moe.py)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias, o_bias, qk_norm)
        if mlp is None:
            mlp_bias = bool(config.raw_config.get("mlp_bias", False))
            mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=mlp_bias)
        self.mlp: Union[LlamaMLP, SparseMoeBlock] = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: "ForwardBatch",
        residual: Optional[torch.Tensor],
        last_rows_only: bool = False,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """last_rows_only: of an extend batch, only each request's last row of the output is wanted (the
        last layer, LogitsProcessor.last_rows_suffice); every row's K/V is still stored, the rest of the
        layer, attention included, runs on those rows alone."""
        # The residual stream is carried separately so each norm can fuse the add.
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


class LlamaModel(nn.Module):
    def __init__(self, config: "ModelConfig", qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 make_layer: Optional[Callable[[int], nn.Module]] = None) -> None:
        """make_layer: builds layer i where it is not the config's LlamaDecoderLayer (the MoE models' layers)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        decoder_layers: List[nn.Module]
        if make_layer is None:
            decoder_layers = [LlamaDecoderLayer(config, i, qkv_bias, o_bias, qk_norm)
                              for i in range(config.num_hidden_layers)]
        else:
            decoder_layers = [make_layer(i) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(decoder_layers)
        self.decoder_layers = decoder_layers  # the same modules as a list (ModuleList's items are untyped)
        # The native decode chain knows LlamaDecoderLayers only (with a Llama MLP or a sparse MoE block: what
        # DecoderLayersCache reads), and no sliding windows: windowed layers attend through the backend's
        # windowed path.
        llama_layers = [layer for layer in decoder_layers if isinstance(layer, LlamaDecoderLayer)]
        self.chain_layers: Optional[List[LlamaDecoderLayer]] = (
            llama_layers if len(llama_layers) == len(decoder_layers) and not config.is_hybrid_swa else None)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.native_decode = DecoderLayersCache()
        # EAGLE3 (set_aux_layers_to_capture): the layers whose input a forward that captures hidden
        # states also returns, sorted; len(layers) names the last layer's output (before the norm).
        self.aux_layer_ids: Tuple[int, ...] = ()

    def set_aux_layers_to_capture(self, layer_ids: Sequence[int]) -> None:
        """Capture the inputs of these layers (SGLang's layers_to_capture: the output of layer i - 1)."""
        n = len(self.decoder_layers)
        if not layer_ids or any(not 0 <= i <= n for i in layer_ids):
            raise ValueError(f"EAGLE3 auxiliary layers {list(layer_ids)}: each must be within 0..{n} "
                             f"(the target has {n} layers)")
        self.aux_layer_ids = tuple(sorted(layer_ids))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                last_rows_only: bool = False) -> torch.Tensor:
        """last_rows_only: of an extend batch, return each request's last row only."""
        return self.forward_with_aux(input_ids, positions, forward_batch, last_rows_only)[0]

    def forward_with_aux(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                         last_rows_only: bool = False) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """forward, and the auxiliary hidden states concatenated ([tokens, len(aux_layer_ids) * hidden])
        where aux layers are set and the batch captures hidden states (None otherwise)."""
        capture = self.aux_layer_ids if forward_batch.capture_hidden_states else ()
        hidden_states = self.embed_tokens(input_ids)
        # The native chain runs every layer in one call: no layer's input to capture.
        native = (None if self.chain_layers is None or capture
                  else self.native_decode.forward(self.chain_layers, hidden_states, positions, forward_batch))
        if native is not None:  # a CPU bf16 decode step: every layer in one native call, the same bits
            hidden_states, residual_stream = native
            hidden_states, _ = self.norm(hidden_states, residual_stream)
            return hidden_states, None  # a decode batch: every row is a last row
        residual = None
        aux: List[torch.Tensor] = []
        last = len(self.decoder_layers) - 1
        for i, layer in enumerate(self.decoder_layers):
            if i in capture:  # a layer's input is the residual stream: the add its input norm would fuse
                aux.extend([hidden_states if residual is None else hidden_states + residual] * capture.count(i))
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual,
                                            last_rows_only and i == last)
        if len(self.decoder_layers) in capture:
            aux.extend([hidden_states if residual is None else hidden_states + residual]
                       * capture.count(len(self.decoder_layers)))
        aux_states = torch.cat(aux, dim=-1) if aux else None
        if residual is None:  # no layers
            if last_rows_only:
                hidden_states = hidden_states.index_select(0, forward_batch.last_positions())
            return self.norm(hidden_states), aux_states
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states, aux_states


class LlamaForCausalLM(nn.Module):
    # Switches that the Qwen subclasses change; None means "ask config.attention_bias".
    qkv_bias: Optional[bool] = None
    o_bias: Optional[bool] = None
    qk_norm: bool = False

    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.config = config
        qkv_bias = config.attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = config.attention_bias if self.o_bias is None else self.o_bias
        self.model = LlamaModel(config, qkv_bias, o_bias, self.qk_norm,
                                self.layer_factory(config, qkv_bias, o_bias, self.qk_norm))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config)
        # Served as an embedding model (--is-embedding): last-token pooling, as SGLang does.
        self.pooler = Pooler(config.pooling.pooling_type, config.pooling.normalize) if config.pooling else None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
        get_embedding: bool = False,
    ) -> Union[LogitsProcessorOutput, EmbeddingPoolerOutput]:
        if get_embedding:
            if self.pooler is None:
                raise ValueError("this model was not loaded as an embedding model (--is-embedding)")
            return self.pooler(self.model(input_ids, positions, forward_batch), forward_batch)
        # Of an extend, only the rows the logits need go through the last layer past its K/V (a prefill of
        # N tokens skips N - 1 of them: about a tenth of an 8-layer model's prefill FLOPs).
        last_rows_only = self.logits_processor.last_rows_suffice(forward_batch)
        hidden_states, aux = self.model.forward_with_aux(input_ids, positions, forward_batch, last_rows_only)
        output = self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch,
                                       pruned=last_rows_only)
        output.aux_hidden_states = aux
        return output

    def layer_factory(self, config: "ModelConfig", qkv_bias: bool, o_bias: bool,
                      qk_norm: bool) -> Optional[Callable[[int], nn.Module]]:
        """What builds each decoder layer: None for Llama's own (the MoE models return theirs)."""
        return None

    # How checkpoint names map onto our fused parameters (weight updates route names with it).
    stacked_params: Sequence[Tuple[str, str, ShardId]] = STACKED_PARAMS

    def weight_skip_substrings(self) -> List[str]:
        skip = ["rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached"]
        if self.config.tie_word_embeddings:
            # The head is the embedding; a checkpoint may still carry a copy of it.
            skip.append("lm_head.weight")
        return skip

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool = True) -> None:
        load_weights_into(self, weights, self.stacked_params, skip_substrings=self.weight_skip_substrings(),
                          require_all=require_all)
