"""The NGRAM drafter: the request's latest tokens, found earlier in its prompt and output, propose
the tokens that followed them there (a chain: one proposal per step, SGLang's topk 1).

The longest suffix of length min_window..max_window that occurred before wins; among its earlier
occurrences, one followed by max_drafts tokens (or the most there are), the most recent of those
(recent text is the likeliest to be copied again). Stateless:
each call searches the request's tokens with vectorised comparisons, O(len(tokens) * max_window)
element operations and no per-request index to keep in step with retraction or aborts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from engine.model_executor.forward_batch_info import ModelWorkerBatch
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.server_args import ServerArgs
    from engine.speculative.step import VerifyStep


def propose_ngram_drafts(tokens: Sequence[int], min_window: int, max_window: int, max_drafts: int) -> List[int]:
    """Up to `max_drafts` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (at least `min_window` long, at most `max_window`); [] when there is none."""
    n = len(tokens)
    if max_drafts <= 0 or n < min_window + 1:
        return []
    seq = np.asarray(tokens, dtype=np.int64)
    # Candidate ends of an earlier occurrence: positions before the last whose token is the last one.
    ends = np.flatnonzero(seq[: n - 1] == seq[n - 1])
    if ends.size == 0:
        return []
    match_len = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for k in range(1, min(max_window, n - 1)):
        # A suffix of length k + 1 also matches where the earlier position ends[i] - k exists and agrees.
        pos = ends - k
        ok = pos >= 0
        ok[ok] = seq[pos[ok]] == seq[n - 1 - k]
        alive &= ok
        if not alive.any():
            break
        match_len += alive
    if int(match_len.max()) < min_window:
        return []
    # Longest match first, then the longest continuation (up to max_drafts: in a repeating run the
    # latest occurrence is one period back and has only that much text after it), then recency.
    follow = np.minimum(n - 1 - ends, max_drafts)
    score = match_len * (max_drafts + 1) + follow
    end = int(ends[np.flatnonzero(score == score.max())[-1]])
    return seq[end + 1: end + 1 + max_drafts].tolist()


class NgramDrafter:
    """The Drafter of --speculative-algorithm NGRAM: drafts on the scheduling thread from each
    request's prompt and output; it holds no state, so it has nothing to keep in step."""

    def __init__(self, server_args: ServerArgs) -> None:
        self.min_window = server_args.speculative_ngram_min_match_window_size
        self.max_window = server_args.speculative_ngram_max_match_window_size

    def propose(self, batch: ScheduleBatch, budgets: List[int]) -> Optional[List[List[int]]]:
        return [propose_ngram_drafts(req.origin_input_ids + req.output_ids, self.min_window, self.max_window, budget)
                for req, budget in zip(batch.reqs, budgets)]

    def draft(self, step: VerifyStep) -> None:
        """Nothing to do: `propose` drafted on the scheduling thread."""

    def after_verify(self, step: VerifyStep) -> None:
        """Nothing to do: the drafter keeps no state between steps."""

    needs_target_hidden = False

    def forward_plain(self, worker_batch: ModelWorkerBatch, run_target: Callable[[ModelWorkerBatch], Any]) -> Any:
        return run_target(worker_batch)
