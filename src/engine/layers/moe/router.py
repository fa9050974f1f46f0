"""Top-k routing: which experts each token goes to, and with what weight."""

from __future__ import annotations

from typing import Tuple

import torch


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] float32, expert ids [T, top_k] int32) of the softmax's top_k experts.

    The softmax runs in float32 over all experts before the top-k (Mixtral, Qwen-MoE); `renormalize`
    (Mixtral always, Qwen's norm_topk_prob) rescales the kept weights to sum to one.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
