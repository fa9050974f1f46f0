"""The experts' forward in torch, grouped by expert (the CPU path, and the reference of the Triton one).

Every (token, slot) pair of the top-k is sorted by expert id; each expert that received tokens runs
once on the rows gathered for it: gate_up matmul (+ its bias), the activation, down matmul (+ its bias),
and the rows scaled by their routing weight are added back to their tokens. Work is proportional to the
tokens routed, not to tokens x experts, and an expert no token chose costs nothing.

The activation is SiLU-and-mul (gate rows, then up rows) unless the model brings its own: gpt-oss's
ClampedSwiGLU, whose gate and up columns are interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from engine.layers.activation import SiluAndMul
from engine.layers.cpu_matmul import dense_linear

_silu_and_mul = SiluAndMul()


# One expert's linear: (its rows [R, in], the expert's index) -> [R, out].
ExpertLinear = Callable[[torch.Tensor, int], torch.Tensor]
# The experts' activation: gate_up rows [R, 2I] -> [R, I].
Activation = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's activation: gate at the even columns of gate_up, up at the odd ones; the gate clamped
    from above and up on both sides at `limit`, then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[:, ::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def fused_moe_native(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    activation: Optional[Activation] = None,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]).

    hidden_states [T, H]; w13 [E, 2I, H] (gate rows then up rows, or as `activation` reads them), w2
    [E, H, I], any strides; w13_bias [E, 2I] and w2_bias [E, H] or None; topk_ids [T, k] are indices into
    this rank's E experts, -1 for a slot whose expert lives on another rank (skipped). The sum is
    accumulated in float32 and returned in the input dtype.
    """
    return fused_moe_grouped(hidden_states, int(w13.shape[0]), int(w2.shape[1]),
                             lambda x, e: dense_linear(x, w13[e], None if w13_bias is None else w13_bias[e]),
                             lambda x, e: dense_linear(x, w2[e], None if w2_bias is None else w2_bias[e]),
                             topk_weights, topk_ids, activation or _silu_and_mul)


def fused_moe_grouped(hidden_states: torch.Tensor, num_experts: int, hidden_out: int, gate_up: ExpertLinear,
                      down: ExpertLinear, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      activation: Activation = _silu_and_mul) -> torch.Tensor:
    """fused_moe_native over any per-expert linears (block-wise fp8 experts: layers/block_fp8_linear.py;
    gpt-oss's MXFP4 ones: layers/mxfp4.py), biases included in the linears."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(num_tokens, hidden_out, dtype=torch.float32, device=hidden_states.device)
    if num_tokens == 0:
        return out.to(hidden_states.dtype)
    if num_tokens == 1:  # one token (a one-request decode step): nothing to group, only its experts to run
        chosen = sorted(zip(topk_ids[0].tolist(), topk_weights[0].to(torch.float32).tolist()))
        for expert, weight in chosen:  # in expert order, as below: the same float32 sum
            if expert >= 0:
                out += down(activation(gate_up(hidden_states, expert)), expert).to(torch.float32) * weight
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
        y = down(activation(gate_up(x, expert)), expert)
        out.index_add_(0, rows, y.to(torch.float32) * weight_of[start:start + count])
        start += count
    return out.to(hidden_states.dtype)
