"""Tokens routed to each expert: what /metrics counts and SGLang's expert distribution recording
(/start_expert_distribution_record, /stop_..., /dump_...) reads.

The counts are kept on the model's device and only ever added to, so that a forward never
synchronises with the host and a captured CUDA graph keeps counting: recording is a snapshot at
start and the difference at stop. The router is replicated on every TP rank, so every rank counts
the same tokens; rank 0 reports. What counts is what runs through a layer's experts, in every forward:
prefill and decode (also the warm-up and graph-capture forwards a GPU server runs at start-up, and a
decode step the overlap scheduler runs past a request's end); the last layer of a prefill runs only
the rows the logits need (each request's last), so it counts fewer tokens than the others.
"""

from __future__ import annotations

from typing import List, Optional

import torch


class ExpertDistributionRecorder:
    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64)  # [layer, expert], since start-up
        self._start: Optional[torch.Tensor] = None  # the counts when recording started
        self._recorded: Optional[torch.Tensor] = None  # the counts between start and stop

    def record(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Count the (token, slot) pairs of one layer's top-k, by global expert id."""
        ids = topk_ids.reshape(-1).to(torch.int64)
        # scatter_add, not bincount: bincount reads the largest id back to the host (no graph capture).
        self.counts[layer_id].scatter_add_(0, ids, torch.ones_like(ids))

    def totals(self) -> List[int]:
        """Tokens routed to each expert id since start-up, summed over the layers."""
        return [int(x) for x in self.counts.sum(dim=0).tolist()]

    @property
    def recording(self) -> bool:
        return self._start is not None

    def start(self) -> None:
        self._start = self.counts.clone()
        self._recorded = None

    def stop(self) -> None:
        if self._start is not None:
            self._recorded = self.counts - self._start
            self._start = None

    def dump(self) -> List[List[int]]:
        """[layer][expert] tokens routed during the recording (up to now while it runs; all zeros when
        none ran)."""
        if self._start is not None:
            recorded = self.counts - self._start
        elif self._recorded is not None:
            recorded = self._recorded
        else:
            recorded = torch.zeros_like(self.counts)
        return [[int(x) for x in row] for row in recorded.tolist()]
