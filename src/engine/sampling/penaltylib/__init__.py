"""Penalties applied to the logits before sampling (frequency, presence, repetition,
min_new_tokens), one penalizer per file, coordinated by the orchestrator."""

from __future__ import annotations

from engine.sampling.penaltylib.base import BatchedPenalizer
from engine.sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
from engine.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
from engine.sampling.penaltylib.orchestrator import PENALIZER_TYPES, BatchedPenalizerOrchestrator
from engine.sampling.penaltylib.presence_penalty import BatchedPresencePenalizer
from engine.sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer

__all__ = [
    "BatchedPenalizer",
    "BatchedFrequencyPenalizer",
    "BatchedMinNewTokensPenalizer",
    "BatchedPenalizerOrchestrator",
    "BatchedPresencePenalizer",
    "BatchedRepetitionPenalizer",
    "PENALIZER_TYPES",
]
