"""The experts' forward in torch, grouped by expert (the CPU path, and the reference of the Triton one).

Every (token, slot) pair of the top-k is sorted by expert id; each expert that received tokens runs
once on the rows gathered for it: gate_up matmul, SiLU-and-mul, down matmul, and the rows scaled by
their routing weight are added back to their tokens. Work is proportional to the tokens routed, not
to tokens x experts, and an expert no token chose costs nothing.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.layers.activation import SiluAndMul
from engine.layers.cpu_matmul import dense_linear

_silu_and_mul = SiluAndMul()


# One expert's linear: (its rows [R, in], the expert's index) -> [R, out].
ExpertLinear = Callable[[torch.Tensor, int], torch.Tensor]


def fused_moe_native(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]).

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]; topk_ids [T, k] are
    indices into this rank's E experts, -1 for a slot whose expert lives on another rank (skipped).
    The sum is accumulated in float32 and returned in the input dtype.
    """
    return fused_moe_grouped(hidden_states, int(w13.shape[0]), int(w2.shape[1]),
                             lambda x, e: dense_linear(x, w13[e]), lambda x, e: dense_linear(x, w2[e]),
                             topk_weights, topk_ids)


def fused_moe_grouped(hidden_states: torch.Tensor, num_experts: int, hidden_out: int, gate_up: ExpertLinear,
                      down: ExpertLinear, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe_native over any per-expert linears (block-wise fp8 experts: layers/block_fp8_linear.py)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden_out, dtype=torch.float32, device=hidden_states.device)
    if num_tokens == 0:
        return out.to(hidden_states.dtype)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // top_k
    weight_of = topk_weights.reshape(-1)[order].to(torch.float32).unsqueeze(1)
    counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()  # [0]: the slots elsewhere
    start = counts[0]
    for expert, count in enumerate(counts[1:]):
        if count == 0:
            continue
        rows = token_of[start:start + count]
        x = hidden_states.index_select(0, rows)
        y = down(_silu_and_mul(gate_up(x, expert)), expert)
        out.index_add_(0, rows, y.to(torch.float32) * weight_of[start:start + count])
        start += count
    return out.to(hidden_states.dtype)
