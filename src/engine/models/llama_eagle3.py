"""EAGLE3's draft head for Llama targets (architecture LlamaForCausalLMEagle3).

Where an EAGLE-1/2 head reads the target's final feature, an EAGLE3 head reads three of the
target's intermediate hidden states (the "auxiliary" ones, LlamaModel.set_aux_layers_to_capture),
concatenated to [tokens, 3 * target_hidden]. At position i it:
- projects that feature with `fc` [hidden, 3 * target_hidden] (a draft step after the first feeds
  the head's own output, already [hidden], and skips fc);
- runs one decoder layer (`midlayer`) whose attention input is concat(input_norm(embed(t_{i+1})),
  hidden_norm(h)) of width 2 * hidden, with h as the residual;
- its output before the final norm is the feature of the next draft step; after `norm`, its own
  lm_head gives logits over a draft vocabulary (`draft_vocab_size` tokens, often far fewer than the
  target's). `d2t` (in the checkpoint) holds, per draft id, target id - draft id.
This module returns logits over the target's vocabulary: the draft logits scattered to their target
ids and -inf elsewhere. Argmax, temperature, top-k / top-p and the softmax then act on the draft
vocabulary exactly, and a sampled draft's distribution is already over target ids, as rejection
sampling (speculative/verify.py) needs it.
The embedding is the target's (EAGLE3 checkpoints hold no copy or an identical one). Where the head
has no lm_head of its own it predicts over the whole vocabulary (d2t identity), as SGLang loads it:
- tie_word_embeddings in its config (e.g. heads for Llama 3.2 1B): its lm_head is its embedding,
  which is the target's; a draft vocabulary smaller than the target's cannot be tied (refused);
- no draft_vocab_size: the target's lm_head.
A head with a draft vocabulary and untied embeddings needs lm_head.weight in its checkpoint (refused
clearly otherwise).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Iterator, List, Optional, Tuple

import torch
from torch import nn

from engine.layers.layernorm import RMSNorm
from engine.layers.linear import QKVParallelLinear
from engine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from engine.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from engine.model_loader.weight_utils import load_weights_into
from engine.models.llama import STACKED_PARAMS, LlamaDecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.model_executor.forward_batch_info import ForwardBatch


class Eagle3MidLayer(LlamaDecoderLayer):
    """A Llama decoder layer whose attention reads concat(normed embeddings, normed feature)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config, 0, config.attention_bias, config.attention_bias, qk_norm=False)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * config.hidden_size, attn.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward_eagle3(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                       forward_batch: ForwardBatch) -> Tuple[torch.Tensor, torch.Tensor]:
        residual = hidden
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        x = self.self_attn(positions, x, forward_batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLMEagle3(nn.Module):
    stacked_params = STACKED_PARAMS
    hot_token_ids: torch.Tensor  # a buffer (moves with the module)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        raw = config.raw_config
        hidden = config.hidden_size
        target_hidden = raw.get("target_hidden_size")
        # The width of one target hidden state (the head's own when the config does not say).
        self.target_hidden_size = int(target_hidden) if target_hidden is not None else hidden
        self.fc = nn.Linear(3 * self.target_hidden_size, hidden, bias=bool(raw.get("bias", False)))
        self.midlayer = Eagle3MidLayer(config)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        draft_vocab = raw.get("draft_vocab_size")
        self.draft_vocab_size = int(draft_vocab) if draft_vocab is not None else config.vocab_size
        if not 1 <= self.draft_vocab_size <= config.vocab_size:
            raise ValueError(f"EAGLE3 head: draft_vocab_size {self.draft_vocab_size} must be within 1.."
                             f"{config.vocab_size} (the target's vocabulary)")
        self.tied = config.tie_word_embeddings
        if self.tied and self.draft_vocab_size != config.vocab_size:
            raise ValueError(f"EAGLE3 head: tie_word_embeddings with draft_vocab_size {self.draft_vocab_size}: a "
                             f"tied lm_head is the embedding, over the target's {config.vocab_size} tokens")
        # Without draft_vocab_size (or tied) the head predicts over the target's vocabulary with the
        # target's lm_head (or embedding).
        self.own_head = draft_vocab is not None and not self.tied
        self.lm_head: Optional[ParallelLMHead] = (
            ParallelLMHead(self.draft_vocab_size, hidden) if self.own_head else None)
        # The target id of each draft id (the checkpoint's d2t + arange); identity until loaded.
        self.register_buffer("hot_token_ids", torch.arange(self.draft_vocab_size), persistent=False)
        self.logits_processor = LogitsProcessor(config)
        self.embed_tokens: Optional[VocabParallelEmbedding] = None  # the target's

    def share_embed_and_head(self, target: LlamaForCausalLM) -> None:
        """The target's embedding (and its lm_head where the head has none of its own)."""
        if self.target_hidden_size != target.config.hidden_size or self.config.hidden_size != target.config.hidden_size:
            raise ValueError(f"the EAGLE3 head's hidden size {self.config.hidden_size} (target_hidden_size "
                             f"{self.target_hidden_size}) must equal the target's {target.config.hidden_size}: "
                             "heads with their own embedding are not supported")
        self.embed_tokens = target.model.embed_tokens
        if self.tied and not target.config.tie_word_embeddings:
            head = ParallelLMHead(self.config.vocab_size, self.config.hidden_size)
            head.tie_weights(target.model.embed_tokens)  # the head's embedding, which is the target's
            self.lm_head = head
        elif not self.own_head:
            self.lm_head = target.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                get_embedding: bool = False) -> LogitsProcessorOutput:
        assert self.embed_tokens is not None and self.lm_head is not None, "share_embed_and_head first"
        features = forward_batch.spec_hidden_states
        assert features is not None, "an EAGLE3 forward needs the target's features (spec_hidden_states)"
        embeds = self.embed_tokens(input_ids)
        features = features.to(embeds.dtype)
        # The target's three hidden states go through fc; the head's own output (later draft steps) does not.
        hidden = self.fc(features) if features.shape[-1] != embeds.shape[-1] else features
        out, residual = self.midlayer.forward_eagle3(positions, embeds, hidden, forward_batch)
        normed, pre_norm = self.norm(out, residual)
        output = self.logits_processor(input_ids, normed, self.lm_head, forward_batch)
        if forward_batch.capture_hidden_states:
            output.hidden_states = pre_norm  # the next draft step's feature
        output.next_token_logits = self._to_target_vocab(output.next_token_logits)
        return output

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.own_head:
            return logits
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.hot_token_ids] = logits[:, :self.draft_vocab_size]
        return full

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool = True) -> None:
        d2t: List[torch.Tensor] = []
        names: List[str] = []

        def rest() -> Iterator[Tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.removeprefix("model.")
                names.append(name)
                if name == "d2t":
                    d2t.append(tensor)
                elif name != "t2d":  # the inverse map: not needed to draft
                    yield name, tensor

        try:
            load_weights_into(self, rest(), STACKED_PARAMS, skip_substrings=self.weight_skip_substrings(),
                              require_all=require_all)
        except ValueError as e:
            if require_all and self.own_head and "lm_head.weight" not in names:
                raise ValueError(f"EAGLE3 head: config.json sets draft_vocab_size {self.draft_vocab_size} but the "
                                 "checkpoint has no lm_head.weight; a head that predicts with the target's lm_head "
                                 "leaves draft_vocab_size out, one whose lm_head is its embedding sets "
                                 "tie_word_embeddings") from e
            raise
        if d2t:
            self._set_d2t(d2t[-1])
        elif require_all and self.own_head and self.draft_vocab_size != self.config.vocab_size:
            raise ValueError("EAGLE3 head: the checkpoint has a draft vocabulary but no d2t map")

    def _set_d2t(self, d2t: torch.Tensor) -> None:
        if d2t.shape != (self.draft_vocab_size,) or d2t.dtype.is_floating_point:
            raise ValueError(f"EAGLE3 head: d2t must be {self.draft_vocab_size} integer offsets, got "
                             f"{tuple(d2t.shape)} {d2t.dtype}")
        ids = d2t.to(torch.int64) + torch.arange(self.draft_vocab_size)
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"EAGLE3 head: d2t must map the draft ids to distinct target ids below "
                             f"{self.config.vocab_size}")
        self.hot_token_ids.copy_(ids.to(self.hot_token_ids.device))

    def weight_skip_substrings(self) -> List[str]:
        skip = ["embed_tokens", "rotary_emb.inv_freq"]
        if not self.own_head:
            skip.append("lm_head")
        return skip
