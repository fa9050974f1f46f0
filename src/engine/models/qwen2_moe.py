"""Qwen2-MoE: Qwen2's attention (q/k/v bias), routed experts plus a shared expert scaled by a sigmoid
gate, top-k weights renormalised only with norm_topk_prob."""

from __future__ import annotations

from engine.models.sparse_moe import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    qkv_bias = True
    o_bias = False
