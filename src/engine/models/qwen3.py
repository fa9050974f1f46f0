"""Qwen3: Llama with per-head RMSNorm on q and k before rotary; biases follow config.attention_bias."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
