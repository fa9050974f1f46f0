"""The running set: the decode batch and what keeps it inside the KV pool.

Its one owner holds the running batch, `new_token_ratio` (how much of each running request's
remaining output the prefill builder reserves KV for: lowered step by step while decode fits,
raised by a retraction) and the retraction hook of a PD decode server. Each decode step it drops
finished requests and, when the next step does not fit, retracts requests (their KV freed; the
caller queues them again) or aborts the ones that can never fit.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional, Sequence, Tuple

from engine.scheduler.kv_manager import KVManager
from engine.scheduler.req import FINISH_ABORT, Req
from engine.scheduler.schedule_batch import ScheduleBatch

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600


class RunningSet:
    def __init__(self, kv: KVManager, schedule_conservativeness: float) -> None:
        self.kv = kv
        self._batch = kv.new_batch([])
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._new_token_ratio = self.init_new_token_ratio
        # PD decode: keeps a copy of a request's committed KV before retraction frees it.
        self._retraction_backup: Optional[Callable[[Req], None]] = None

    @property
    def batch(self) -> ScheduleBatch:
        return self._batch

    @property
    def reqs(self) -> Sequence[Req]:
        return self._batch.reqs

    @property
    def new_token_ratio(self) -> float:
        return self._new_token_ratio

    @property
    def is_full(self) -> bool:
        return self._batch.batch_is_full

    def set_full(self, full: bool) -> None:
        """The prefill builder's verdict: no request slot or no KV left for another prefill."""
        self._batch.batch_is_full = full

    def set_retraction_backup(self, backup: Callable[[Req], None]) -> None:
        self._retraction_backup = backup

    def is_empty(self) -> bool:
        return self._batch.is_empty()

    def size(self) -> int:
        return self._batch.batch_size()

    def merge(self, batch: ScheduleBatch) -> None:
        """Requests (freshly prefilled, or a PD decode server's transferred ones) join the batch."""
        if self._batch.is_empty():
            self._batch = batch
        else:
            self._batch.merge_batch(batch)
        self._batch.batch_is_full = False

    def clear(self) -> None:
        self._batch = self.kv.new_batch([])

    def reset_ratio(self) -> None:
        self._new_token_ratio = self.init_new_token_ratio

    def update(self) -> Tuple[List[Req], List[Req]]:
        """Prepare the next decode step: drop finished requests; when the step does not fit the
        pool, retract (returned first, to queue again) or abort (returned second, to answer)."""
        batch = self._batch
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return [], []
        retracted: List[Req] = []
        aborted: List[Req] = []
        if not batch.check_decode_mem():
            old_ratio = self._new_token_ratio
            retracted, self._new_token_ratio, aborted = batch.retract_decode(self._retraction_backup)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, #aborted_reqs: %d, "
                "#new_token_ratio: %.4f -> %.4f", len(retracted), len(aborted), old_ratio, self._new_token_ratio)
        else:
            self._new_token_ratio = max(self._new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if not batch.is_empty():
            batch.prepare_for_decode()
        return retracted, aborted

    def take_for_mixing(self) -> Optional[ScheduleBatch]:
        """--enable-mixed-chunk: the decode batch, prepared for its next step, leaves the set to ride
        along with a prefill (it comes back merged with it); None when its step does not fit."""
        running = self._batch
        running.filter_batch()
        if running.is_empty() or not running.check_decode_mem():
            return None
        running.prepare_for_decode()
        self.clear()
        return running

    def preempt(self, victims: List[Req]) -> None:
        """Priority preemption (the prefill builder's PrefillAdder): release `victims` and drop
        them from the batch; the caller queues them again."""
        self._batch.preempt(victims)

    def preempt_all(self) -> List[Req]:
        """pause_generation(retract): every unfinished request leaves with its output kept, its KV
        freed (a PD decode server keeps a copy first); returned to be queued again."""
        victims = [r for r in self._batch.reqs if not r.finished()]
        if victims:
            self._batch.preempt(victims, self._retraction_backup)
        self.clear()
        return victims

    def mark_to_abort(self, match: Callable[[Req], bool], exclude: Optional[Req] = None) -> None:
        """Running requests matching an abort finish at their next result (never mid-forward)."""
        for req in self._batch.reqs:
            if match(req) and not req.finished() and req is not exclude:
                req.to_finish = FINISH_ABORT()
