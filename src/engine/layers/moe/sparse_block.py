"""The sparse block of a mixture-of-experts decoder layer (Mixtral, Qwen2-MoE, Qwen3-MoE): the router,
the FusedMoE experts and, where the model has one, a shared expert scaled by a sigmoid gate. It takes a
Llama decoder layer's MLP place (models/sparse_moe.py builds it; kernels/decoder_layers.py chains it)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from engine.layers.mla_linear import ReplicatedLinear
from engine.layers.moe.expert_distribution import ExpertDistributionRecorder
from engine.layers.moe.layer import FusedMoE


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int, renormalize: bool,
                 layer_id: int, recorder: Optional[ExpertDistributionRecorder],
                 shared_expert: Optional[nn.Module] = None) -> None:
        """shared_expert: the model's always-on expert (Qwen2-MoE: a Llama MLP), gated per token."""
        super().__init__()
        # The router is small and replicated: every rank routes every token the same way.
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False, quantizable=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, moe_intermediate_size, renormalize,
                                layer_id=layer_id, recorder=recorder)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (ReplicatedLinear(hidden_size, 1, bias=False, quantizable=False)
                                   if shared_expert is not None else None)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            assert self.shared_expert_gate is not None  # built together
            shared = self.shared_expert(hidden_states)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * shared
        return out
