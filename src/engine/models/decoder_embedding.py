"""Decoder embedding models saved without an LM head (MistralModel as e5-mistral, LlamaModel,
Qwen2Model, Qwen3Model): the Llama decoder stack, then the Pooler (last token by default).

Their checkpoints name the stack's weights without the `model.` prefix that the *ForCausalLM
checkpoints use (`layers.0...`, `embed_tokens.weight`); both spellings load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Tuple

import torch
from torch import nn

from engine.layers.pooler import EmbeddingPoolerOutput, Pooler
from engine.models.llama import STACKED_PARAMS, LlamaModel
from engine.model_loader.weight_utils import load_weights_into

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch


class LlamaEmbeddingModel(nn.Module):
    # The same switches as LlamaForCausalLM's subclasses; None means "ask config.attention_bias".
    qkv_bias: Optional[bool] = None
    o_bias: Optional[bool] = None
    qk_norm: bool = False

    def __init__(self, config: "ModelConfig") -> None:
        super().__init__()
        if config.pooling is None:
            raise ValueError(f"{type(self).__name__} is an embedding model: its ModelConfig must carry a pooling config")
        self.config = config
        qkv_bias = config.attention_bias if self.qkv_bias is None else self.qkv_bias
        o_bias = config.attention_bias if self.o_bias is None else self.o_bias
        self.model = LlamaModel(config, qkv_bias, o_bias, self.qk_norm)
        self.pooler = Pooler(config.pooling.pooling_type, config.pooling.normalize)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: "ForwardBatch",
                get_embedding: bool = True) -> EmbeddingPoolerOutput:
        if not get_embedding:
            raise ValueError(f"{type(self).__name__} has no LM head: it only computes embeddings")
        return self.pooler(self.model(input_ids, positions, forward_batch), forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        skip = ["rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached", "lm_head."]
        load_weights_into(self, _with_model_prefix(weights), STACKED_PARAMS, skip_substrings=skip)


class Qwen2EmbeddingModel(LlamaEmbeddingModel):
    qkv_bias = True
    o_bias = False


class Qwen3EmbeddingModel(LlamaEmbeddingModel):
    qk_norm = True


def _with_model_prefix(weights: Iterable[Tuple[str, torch.Tensor]]) -> Iterator[Tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        yield (name if name.startswith(("model.", "lm_head.")) else f"model.{name}"), tensor
