"""What one verify step carries from launch to result processing, and what proposes its drafts
(the scheduler's Speculator, speculator.py, runs both)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Protocol, Tuple

import torch

from engine.speculative.sampling import VerifySampling
from engine.speculative.tree import DraftTree, TreeShape
from engine.speculative.verify import VerifyOutcome

if TYPE_CHECKING:
    from engine.layers.logits_processor import LogitsProcessorOutput
    from engine.model_executor.forward_batch_info import ModelWorkerBatch
    from engine.scheduler.schedule_batch import ScheduleBatch


@dataclass
class VerifyStep:
    """One verify step, from launch to result processing."""

    worker_batch: ModelWorkerBatch
    # Per request: the drafts verified; a drafter on the forward thread fills them before the verify.
    drafts: List[List[int]]
    # Per request: the KV slots its drafts have (the drafts' number once drafted).
    draft_lens: List[int]
    # Per request: its prompt and its output (the Req's own lists, read on the forward thread while
    # the scheduling thread waits for the step): the committed tokens a drafter may have to catch up on.
    tokens: List[Tuple[List[int], List[int]]] = field(default_factory=list)
    # Whether the drafter proposes on the forward thread (Drafter.draft) before the verify forward.
    draft_on_forward_thread: bool = False
    # Per request: the distributions its sampled drafts were drawn from ([k, vocab]; None: point masses).
    draft_probs: Optional[List[Optional[torch.Tensor]]] = None
    # The target's final hidden state at every position of the verify forward (a drafter that
    # needs_target_hidden reads them), [tokens, hidden].
    target_hidden: Optional[torch.Tensor] = None
    outcome: Optional[VerifyOutcome] = None
    # What the step samples beyond the batch's plain parameters (penalties, logit_bias, grammar masks,
    # logprobs: speculative/sampling.py); None when nothing.
    sampling: Optional[VerifySampling] = None
    # The emitted tokens' logprobs, one row per token of the requests that asked, request after
    # request; per request the row of its first token (-1: not asked).
    logprobs: Optional[LogitsProcessorOutput] = None
    logprob_rows: List[int] = field(default_factory=list)
    draft_seconds: float = 0.0  # forward-thread time the drafter spent on this step
    # Tree drafts (--speculative-eagle-topk > 1): the shape; per request its tree (None: no drafts),
    # and after the acceptance its accepted nodes, whose K/V the step moved to chain order (each
    # request's verify rows start + 1 .. start + len(path)).
    tree_shape: Optional[TreeShape] = None
    trees: Optional[List[Optional[DraftTree]]] = None
    paths: Optional[List[List[int]]] = None
    # Of which: bringing a draft model's K/V up to the committed tokens (positions decoded plainly),
    # a one-off per token that the speculation switch does not count as the verify step's cost.
    catch_up_seconds: float = 0.0


class Drafter(Protocol):
    """Where a verify step's drafts come from (ngram.NgramDrafter, draft_model.DraftModelDrafter)."""

    def propose(self, batch: ScheduleBatch, budgets: List[int]) -> Optional[List[List[int]]]:
        """Scheduling thread: each request's drafts now, at most budgets[i] each; None when they are
        drafted on the forward thread instead (`draft`), exactly budgets[i] each."""

    def draft(self, step: VerifyStep) -> None:
        """Forward thread, before the verify forward: fill step.drafts (and step.draft_probs)."""

    def after_verify(self, step: VerifyStep) -> None:
        """Forward thread, after the acceptance: bring the drafter's state to the accepted tokens."""

    # Whether the target's forwards must return their hidden states (EAGLE's features).
    needs_target_hidden: bool

    def forward_plain(self, worker_batch: ModelWorkerBatch, run_target: Callable[[ModelWorkerBatch], Any]) -> Any:
        """Forward thread: a plain forward of the target (prefill, mixed chunk, plain decode step),
        run by the drafter through `run_target` together with whatever keeps it in step with the
        K/V that forward writes; returns run_target's result."""


class TreeDrafter(Protocol):
    """A drafter that grows trees (--speculative-eagle-topk > 1: eagle.EagleDrafter,
    draft_model.DraftModelDrafter), beside its Drafter methods (plain forwards, chain steps)."""

    def draft_tree(self, step: VerifyStep, shape: TreeShape) -> List[Optional[DraftTree]]:
        """Forward thread, before the verify forward: each request's tree (None where it drafts
        nothing), its scratch K/V written after its last token's slot (the step's slots)."""

    def after_verify_tree(self, step: VerifyStep) -> None:
        """Forward thread, after the acceptance and the move of the accepted path (step.paths):
        bring the drafter's state to the accepted tokens, as after a chain step."""
