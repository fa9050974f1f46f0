"""Qwen2: Llama with a bias on the q/k/v projections (never on o_proj)."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False
