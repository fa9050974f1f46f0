"""The target's feature of every KV slot, which an EAGLE-family head reads (EAGLE and NEXTN: the final
hidden state; EAGLE3: three layer inputs side by side), and what a PD transfer carries beside the KV
(disaggregation/kv_io.FeatureStore).

`TargetFeatures` owns the per-slot rows. EagleDrafter (eagle.py) keeps them beside its head. A PD
prefill server of an EAGLE pair never drafts or verifies: its `FeatureKeeper` stores what the target's
forwards capture and the transfer sends it, with no head loaded (the decode server's runs it), so the
prefill keeps the memory of the head's weights and K/V.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch

if TYPE_CHECKING:
    from engine.layers.logits_processor import LogitsProcessorOutput
    from engine.model_executor.forward_batch_info import ModelWorkerBatch
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.speculative.step import VerifyStep


def captured_features(output: LogitsProcessorOutput) -> torch.Tensor:
    """The features a target forward captured: an EAGLE3 target's auxiliary hidden states, otherwise
    its final hidden states."""
    features = output.aux_hidden_states if output.aux_hidden_states is not None else output.hidden_states
    assert features is not None  # the forward ran with capture_hidden_states
    return features


class TargetFeatures:
    def __init__(self, num_slots: int, feature_size: int, dtype: torch.dtype, device: str, feature_name: str) -> None:
        """num_slots: the target pool's slots (padding included); feature_name: what the feature is (a PD
        pair's two servers must keep the same one)."""
        self.feature_name = feature_name
        self.features = torch.zeros(num_slots, feature_size, dtype=dtype, device=device)

    def store_features(self, slots: torch.Tensor, hidden: torch.Tensor) -> None:
        self.features[slots.to(self.features.device)] = hidden.to(self.features.dtype)

    # ------------------------------------------------------------------ PD transfer (kv_io.FeatureStore)
    def feature_layout(self) -> Tuple[str, int, torch.dtype]:
        return self.feature_name, self.features.shape[1], self.features.dtype

    def gather_features(self, slots: torch.Tensor) -> torch.Tensor:
        """The transfer's IO thread (prefill): the stored features of a prompt's slots."""
        return self.features[slots.to(device=self.features.device, dtype=torch.int64)].cpu()

    def scatter_features(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Decode: features received for reserved slots (the transfer's listener thread), or restored
        with a retracted request's KV (the forward thread)."""
        self.store_features(slots, rows.to(self.features.device))


class FeatureKeeper(TargetFeatures):
    """The Drafter (step.Drafter) of an EAGLE / EAGLE3 / NEXTN PD prefill server: it keeps the target's
    features of the prompts it computes. A prefill server runs no decode step, so it is never asked to
    draft; asking is a bug, reported as one."""

    needs_target_hidden = True

    def forward_plain(self, worker_batch: ModelWorkerBatch, run_target: Callable[[ModelWorkerBatch], Any]) -> Any:
        result = run_target(dataclasses.replace(worker_batch, capture_hidden_states=True))
        self.store_features(worker_batch.out_cache_loc, captured_features(result.logits_output))
        return result

    def propose(self, batch: ScheduleBatch, budgets: List[int]) -> Optional[List[List[int]]]:
        raise RuntimeError("a PD prefill server does not decode: it has no EAGLE head to draft with")

    def draft(self, step: VerifyStep) -> None:
        raise RuntimeError("a PD prefill server does not decode: it has no EAGLE head to draft with")

    def after_verify(self, step: VerifyStep) -> None:
        raise RuntimeError("a PD prefill server does not decode: it verifies nothing")
