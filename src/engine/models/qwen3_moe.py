"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm), routed experts without a shared expert."""

from __future__ import annotations

from engine.models.sparse_moe import MoeForCausalLM


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True
