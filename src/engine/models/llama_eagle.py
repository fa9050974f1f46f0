"""EAGLE's draft head for Llama targets (architecture LlamaForCausalLMEagle, EAGLE-1/2 checkpoints).

The head predicts the target's next feature from the token and the target's feature before it:
at position i it reads concat(embed(t_{i+1}), f_i), where f_i is the target's final (normed) hidden
state at position i, projects it with `fc` [hidden, 2 * hidden] and runs one Llama decoder layer
(layer 0 has no input norm: EAGLE feeds the projection straight in) with its own K/V; its output,
without a final norm, is its guess of f_{i+1}, and the target's lm_head over it gives the draft of
t_{i+2}. The next draft step feeds that guess as the feature. The embedding and lm_head are the
target's (share_embed_and_head): an EAGLE checkpoint holds fc, the layer and at most copies of them.
The per-token features come in `ForwardBatch.spec_hidden_states` (speculative/eagle.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, List, Optional, Tuple

import torch
from torch import nn

from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_loader.weight_utils import load_weights_into
from engine.models.llama import STACKED_PARAMS, LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch


class LlamaForCausalLMEagle(nn.Module):
    stacked_params = STACKED_PARAMS

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(config.raw_config.get("bias", True)))
        layers = [LlamaDecoderLayer(config, i, config.attention_bias, config.attention_bias, qk_norm=False)
                  for i in range(config.num_hidden_layers)]
        layers[0].input_layernorm = nn.Identity()  # type: ignore[assignment]  # EAGLE's first layer: no input norm
        self.layers = nn.ModuleList(layers)
        self.decoder_layers = layers  # the same modules, typed
        self.logits_processor = LogitsProcessor(config)
        # The target's, set before the first forward (they are not part of the checkpoint).
        self.embed_tokens: Optional[VocabParallelEmbedding] = None
        self.lm_head: Optional[ParallelLMHead] = None

    def share_embed_and_head(self, target: LlamaForCausalLM) -> None:
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                get_embedding: bool = False) -> LogitsProcessorOutput:
        assert self.embed_tokens is not None and self.lm_head is not None, "share_embed_and_head first"
        features = forward_batch.spec_hidden_states
        assert features is not None, "an EAGLE forward needs the target's features (spec_hidden_states)"
        embeds = self.embed_tokens(input_ids)
        hidden_states = self.fc(torch.cat((embeds, features.to(embeds.dtype)), dim=-1))
        residual: Optional[torch.Tensor] = None
        for layer in self.decoder_layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        assert residual is not None  # at least one layer
        return self.logits_processor(input_ids, hidden_states + residual, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool = True) -> None:
        # Copies of the target's embedding / head in the checkpoint are not used (shared instead);
        # some EAGLE checkpoints name the layer under "model.".
        weights = ((name.removeprefix("model."), tensor) for name, tensor in weights)
        load_weights_into(self, weights, STACKED_PARAMS, skip_substrings=self.weight_skip_substrings(),
                          require_all=require_all)

    def weight_skip_substrings(self) -> List[str]:
        return ["embed_tokens", "lm_head", "rotary_emb.inv_freq"]
