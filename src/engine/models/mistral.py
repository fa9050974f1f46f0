"""Mistral: the Llama architecture under another name; its `sliding_window` windows every layer
(ModelConfig.layer_windows, RadixAttention.sliding_window_size)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
