"""Mistral: the Llama architecture under another name.

Sliding-window attention is not implemented: ModelConfig limits the context length of a model with
a window to that window, so attention over the whole sequence is exact.
"""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
