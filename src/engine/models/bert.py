"""BERT-style encoder (BertModel, Contriever) for embeddings: all-MiniLM, bge, e5, gte, ...

Word + absolute position + token type embeddings and a LayerNorm, then post-norm layers
(self-attention, dense + residual + LayerNorm, GELU MLP + residual + LayerNorm), then the Pooler.
Attention is bidirectional over each request's own tokens (AttentionType.ENCODER_ONLY): the
attention backend reads this forward's K/V directly, so nothing is written to the KV pool and no
prefix is ever shared. Every input is one segment, so its token type is 0 throughout (as a
sentence-transformers model encodes a single text).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import get_tp_size
from engine.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.pooler import EmbeddingPoolerOutput, Pooler
from engine.layers.radix_attention import AttentionType, RadixAttention
from engine.layers.vocab_parallel_embedding import VocabParallelEmbedding
from engine.model_loader.weight_utils import load_weights_into

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

# checkpoint name piece -> (our fused parameter name piece, shard id)
STACKED_PARAMS = (
    ("query", "qkv_proj", "q"),
    ("key", "qkv_proj", "k"),
    ("value", "qkv_proj", "v"),
)

_ACTIVATIONS: dict = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r} for a BERT model; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class BertEmbedding(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        raw = config.raw_config
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"only absolute position embeddings are supported, got "
                             f"{raw.get('position_embedding_type')!r}")
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # Small tables: replicated on every TP rank.
        self.position_embeddings = nn.Embedding(int(raw.get("max_position_embeddings", 512)), config.hidden_size)
        self.token_type_embeddings = nn.Embedding(int(raw.get("type_vocab_size", 2)), config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=float(raw.get("layer_norm_eps", 1e-12)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        # Single-segment inputs: token type 0 everywhere.
        embeddings = embeddings + self.token_type_embeddings.weight[0]
        return self.LayerNorm(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_attention_heads, bias=True)
        self.q_size = self.qkv_proj.q_size
        self.kv_size = self.qkv_proj.kv_size
        self.attn = RadixAttention(self.qkv_proj.num_heads, self.head_dim, self.head_dim**-0.5,
                                   self.qkv_proj.num_kv_heads, layer_id, attn_type=AttentionType.ENCODER_ONLY)

    def forward(self, hidden_states: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # The K/V live only for this forward: nothing is stored in the pool.
        return self.attn(q, k, v, forward_batch, save_kv_cache=False)


class BertOutput(nn.Module):
    """dense, then LayerNorm of (dense output + the residual); used after attention and the MLP."""

    def __init__(self, input_size: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden_states) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int, eps: float) -> None:
        super().__init__()
        self.self_attn = BertSelfAttention(config, layer_id)
        self.output = BertOutput(config.hidden_size, config.hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        return self.output(self.self_attn(hidden_states, forward_batch), hidden_states)


class BertIntermediate(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act_fn = get_act_fn(config.hidden_act)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(hidden_states))


class BertLayer(nn.Module):
    def __init__(self, config: "ModelConfig", layer_id: int) -> None:
        super().__init__()
        eps = float(config.raw_config.get("layer_norm_eps", 1e-12))
        self.attention = BertAttention(config, layer_id, eps)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config.intermediate_size, config.hidden_size, eps)

    def forward(self, hidden_states: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        attn_output = self.attention(hidden_states, forward_batch)
        return self.output(self.intermediate(attn_output), attn_output)


class BertEncoder(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor, forward_batch: "ForwardBatch") -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states, forward_batch)
        return hidden_states


class BertModel(nn.Module):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        if config.pooling is None:
            raise ValueError("BertModel is an embedding model: its ModelConfig must carry a pooling config")
        if config.num_attention_heads % get_tp_size() != 0:
            raise ValueError(f"{config.num_attention_heads} attention heads cannot be split over "
                             f"tp_size {get_tp_size()}")
        self.config = config
        self.embeddings = BertEmbedding(config)
        self.encoder = BertEncoder(config)
        self.pooler = Pooler(config.pooling.pooling_type, config.pooling.normalize)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                get_embedding: bool = True) -> EmbeddingPoolerOutput:
        if not get_embedding:
            raise ValueError("BertModel only computes embeddings")
        hidden_states = self.embeddings(input_ids, positions)
        hidden_states = self.encoder(hidden_states, forward_batch)
        return self.pooler(hidden_states, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        load_weights_into(self, _rename(weights), STACKED_PARAMS,
                          # BERT's own pooler (dense + tanh over CLS), an MLM/NSP head and the
                          # position_ids buffer are not part of a sentence embedding.
                          skip_substrings=("pooler.", "cls.", "position_ids"))


def _rename(weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("bert."):  # saved from a BertFor... wrapper
            name = name[len("bert."):]
        # Older checkpoints name LayerNorm parameters gamma/beta.
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        yield name.replace(".attention.self.", ".attention.self_attn."), tensor
