"""Top-k routing: which experts each token goes to, and with what weight."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from engine.kernels import ops


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int32) of the softmax's top_k experts.

    The softmax runs in float32 over all experts before the top-k (Mixtral, Qwen-MoE); `renormalize`
    (Mixtral always, Qwen's norm_topk_prob) rescales the kept weights to sum to one.
    """
    if ops.usable(router_logits) and router_logits.dim() == 2:  # the one the native decode chain calls
        return ops.moe_route(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def select_experts_grouped(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                           routed_scaling_factor: float = 1.0, num_groups: int = 1, topk_groups: int = 1,
                           correction_bias: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing: (weights [T, top_k] float32, expert ids [T, top_k] int32).

    Scores are the softmax (DeepSeek-V2) or the sigmoid (V3) of the float32 logits. The experts form
    `num_groups` equal groups; only the `topk_groups` best groups may be chosen from, a group's merit
    being its best score (softmax) or the sum of its two best biased scores (sigmoid, V3's rule). With
    a correction bias (V3's e_score_correction_bias) the choice is made on score + bias but the
    weights are the unbiased scores. `renormalize` rescales the kept weights to sum to one; then all
    are multiplied by `routed_scaling_factor` (the same as scaling the experts' sum)."""
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        raise ValueError(f"unknown expert scoring function {scoring!r} (softmax or sigmoid)")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if num_groups > 1:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_groups, num_experts // num_groups)
        merit = grouped.max(dim=-1).values if scoring == "softmax" else grouped.topk(2, dim=-1)[0].sum(dim=-1)
        kept_groups = torch.topk(merit, topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(merit, dtype=torch.bool).scatter_(1, kept_groups, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)
