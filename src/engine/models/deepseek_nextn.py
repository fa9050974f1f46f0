"""DeepSeek-V3's multi-token prediction (MTP) layer as a speculative draft: SGLang's NEXTN
(DeepseekV3ForCausalLMNextN), drafted by the EAGLE machinery (speculative/eagle.py).

The layer predicts the token after next from the target's feature at position i (its final hidden
state, after the final norm: what SGLang and vLLM feed, and what the checkpoints' own modeling code
hands the MTP module) and the embedding of token i + 1:
    h = eh_proj([enorm(embed(t_{i+1})); hnorm(f_i)])
    h = one DeepSeek decoder layer (MLA attention with its own latent K/V, DeepSeek's experts)
    f_{i+1} = shared_head.norm(h)         logits = lm_head(f_{i+1})
and the next drafting step feeds f_{i+1} as the feature (speculative/eagle.py). The checkpoint keeps the
layer after the target's last one, as model.layers.{num_hidden_layers}.* (enorm, hnorm, eh_proj,
shared_head.norm, the decoder layer's weights, and copies of the embedding and head, which are not
read: the target's are shared). configs/mla_config.nextn_draft_config makes the draft's config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from engine.configs.mla_config import mla_dims_of
from engine.layers.layernorm import RMSNorm
from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.moe.layer import QWEN_EXPERT_NAMES, expert_params_mapping
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_loader.weight_utils import ShardId, load_weights_into
from engine.models.deepseek_v2 import DeepseekDecoderLayer, DeepseekRouting, DeepseekV2ForCausalLM, deepseek_moe_spec
from engine.models.llama import STACKED_PARAMS

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch

# The MTP layer's own modules (the rest of model.layers.{N}.* is its decoder layer).
_OWN_WEIGHTS = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
# Copies of the target's embedding and head inside the MTP layer: the target's are used.
_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")


class SharedHead(nn.Module):
    """The checkpoint's shared_head: its norm (the head itself is the target's lm_head)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class DeepseekV3ForCausalLMNextN(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        raw = config.raw_config
        dims = mla_dims_of(raw)
        if dims is None:
            raise ValueError("the MTP draft needs the target's MLA dimensions (kv_lora_rank ...) in config.json")
        self.layer_index = int(raw["nextn_layer_index"])  # where the checkpoint keeps it
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        spec = deepseek_moe_spec(raw)
        routing = DeepseekRouting.from_config(raw, True, spec)
        self.decoder = DeepseekDecoderLayer(config, dims, 0, bool(raw.get("rope_interleave", True)), spec, routing,
                                            None)
        self.shared_head = SharedHead(hidden, eps)
        self.logits_processor = LogitsProcessor(config)
        self.stacked_params: List[Tuple[str, str, ShardId]] = [
            *[(f"mlp.{ckpt}", f"mlp.{ours}", shard)
              for ckpt, ours, shard in expert_params_mapping(spec.num_experts, QWEN_EXPERT_NAMES)],
            *STACKED_PARAMS]
        # The target's, set before the first forward (share_embed_and_head).
        self.embed_tokens: Optional[VocabParallelEmbedding] = None
        self.lm_head: Optional[ParallelLMHead] = None

    def share_embed_and_head(self, target: DeepseekV2ForCausalLM) -> None:
        self.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                get_embedding: bool = False) -> LogitsProcessorOutput:
        assert self.embed_tokens is not None and self.lm_head is not None, "share_embed_and_head first"
        features = forward_batch.spec_hidden_states
        assert features is not None, "an MTP forward needs the target's features (spec_hidden_states)"
        embeds = self.embed_tokens(input_ids)
        hidden_states = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(features.to(embeds.dtype))), dim=-1))
        hidden_states, residual = self.decoder(positions, hidden_states, forward_batch, None)
        hidden_states, _ = self.shared_head.norm(hidden_states, residual)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool = True) -> None:
        found = [0]
        try:
            load_weights_into(self, self._mtp_weights(weights, found), self.stacked_params,
                              skip_substrings=["rotary_emb.inv_freq"], require_all=require_all)
        except ValueError as e:
            if found[0]:
                raise
            raise ValueError(
                f"the checkpoint has no MTP weights (model.layers.{self.layer_index}.*): its config says "
                f"num_nextn_predict_layers {self.config.raw_config.get('num_nextn_predict_layers')}, but the layer "
                "was not saved (transformers drops it); --speculative-algorithm NEXTN needs a checkpoint that "
                "keeps it, as DeepSeek's releases do") from e

    def _mtp_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], found: List[int]
                     ) -> Iterator[Tuple[str, torch.Tensor]]:
        """The MTP layer's weights under this module's names; the target's layers are not read."""
        prefix = f"model.layers.{self.layer_index}."
        for name, tensor in weights:
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            if rest.startswith(_SHARED_COPIES):
                continue
            found[0] += 1
            yield (rest if rest.startswith(_OWN_WEIGHTS) else f"decoder.{rest}"), tensor
