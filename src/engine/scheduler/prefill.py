"""Which waiting requests join a step's prefill batch: SGLang's get_new_batch_prefill.

The chunked request's next chunk goes first, then the waiting requests in the order of the schedule
policy (SchedulePolicy), each admitted by PrefillAdder while the token budget and the request slots
last; a request whose uncached head another admitted request is computing waits one round instead
(UncachedPrefixDedup). With priority scheduling a more urgent request may preempt running ones (they
go back to the queue, their output kept); with --enable-mixed-chunk the running decode batch rides
along in the same forward. One collaborator of the Scheduler (as SchedulerControl), not a mixin.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

from engine.scheduler.schedule_batch import ScheduleBatch
from engine.scheduler.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy, UncachedPrefixDedup

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class PrefillBuilder:
    def __init__(self, scheduler: "Scheduler") -> None:
        self.s = scheduler
        args = scheduler.server_args
        self.policy = SchedulePolicy(args.schedule_policy, scheduler.tree_cache,
                                     radix_enabled=not args.disable_radix_cache,
                                     seed=args.random_seed, priority=scheduler.priority)
        # Keys of the last prefill batch's uncached prompt heads (UncachedPrefixDedup); None when
        # the radix cache is off (nothing is shared, so waiting would gain nothing).
        self.last_prefill_keys: Optional[set] = None if args.disable_radix_cache else set()
        chunk = args.chunked_prefill_size
        self.chunked_prefill_size: Optional[int] = chunk if chunk is not None and chunk > 0 else None

    def _num_allocatable_reqs(self) -> int:
        s = self.s
        running = s.running_batch.batch_size()
        return min(s.max_running_requests - running,
                   s.req_to_token_pool.available_size() + (1 if s.chunked_req is not None else 0))

    def build(self) -> Optional[ScheduleBatch]:
        """The prefill (extend) batch of this step, or None: the chunked request's next chunk, then
        waiting requests in policy order while the token budget and the request slots last (with
        priority preemption, mixing with the running decode batch under --enable-mixed-chunk)."""
        s = self.s
        preemption = s.priority.preemption_enabled
        if preemption:
            # A more urgent arrival may preempt its way into a full batch (SGLang).
            s.running_batch.batch_is_full = False
        if (s.running_batch.batch_is_full or not s.waiting_queue) and s.chunked_req is None:
            return None
        if self._num_allocatable_reqs() <= 0 and s.chunked_req is None and not preemption:
            s.running_batch.batch_is_full = True
            return None

        self.policy.calc_priority(s.waiting_queue, s.running_batch.reqs)
        mixed = s.server_args.enable_mixed_chunk and not s.running_batch.is_empty()
        adder = PrefillAdder(
            s.page_size, s.tree_cache, s.token_to_kv_pool_allocator, s.running_batch.reqs,
            s.new_token_ratio, s.server_args.max_prefill_tokens, self.chunked_prefill_size,
            mixed_with_decode_tokens=s.running_batch.batch_size() if mixed else 0,
        )
        dedup = UncachedPrefixDedup(self.last_prefill_keys) if self.last_prefill_keys is not None else None
        if s.chunked_req is not None:
            chunked = s.chunked_req
            chunked.init_next_round_input()
            s.chunked_req = adder.add_chunked_req(chunked)
            if dedup is not None and chunked in adder.can_run_list:
                # Its earlier chunks are in the tree, so a request of the same group matches up to
                # where this chunk starts and would compute the chunk's tokens a second time.
                dedup.admit(chunked)
        for req in s.waiting_queue:
            full = len(adder.can_run_list) >= self._num_allocatable_reqs()
            if full:
                s.running_batch.batch_is_full = True
                if not preemption:
                    break
            req.init_next_round_input(s.tree_cache)
            if dedup is not None and dedup.is_duplicate(req):
                continue  # its shared head is being computed for another request: reuse it next round
            if full and not adder.preempt_to_schedule(req, s.priority, s.running_batch):
                break
            result = adder.add_one_req(req)
            if dedup is not None and adder.can_run_list and adder.can_run_list[-1] is req:
                dedup.admit(req)
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    s.running_batch.batch_is_full = True
                break

        for victim in adder.preempt_list:
            # Back to the queue with their output kept, like a retraction.
            s.admission.enqueue(victim, is_retracted=True)
        if adder.preempt_list:
            logger.info("Priority preemption: %d running request(s) preempted", len(adder.preempt_list))
        can_run = adder.can_run_list
        if dedup is not None:
            self.last_prefill_keys = dedup.admitted_keys
        if not can_run:
            return None
        admitted = {id(r) for r in can_run}
        s.waiting_queue = [r for r in s.waiting_queue if id(r) not in admitted]
        if adder.new_chunked_req is not None:
            assert s.chunked_req is None, "only one chunked request may exist"
            s.chunked_req = adder.new_chunked_req
        if s.chunked_req is not None and id(s.chunked_req) in admitted:
            # Counts its chunks in flight; a round in which it got no chunk (less than a page of
            # budget left) must not count, or its last chunk would be taken for a middle one.
            s.chunked_req.is_chunked += 1

        batch = ScheduleBatch.init_new(can_run, s.req_to_token_pool, s.token_to_kv_pool_allocator,
                                       s.tree_cache, s.vocab_size, s.device)
        batch.prepare_for_extend()
        batch.log_input_tokens, batch.log_hit_tokens = adder.log_input_tokens, adder.log_hit_tokens
        s.stats.on_prefill_batch(batch)

        # Mixing needs neither side to return logprobs or hidden states (their rows are per extend).
        if (mixed and not batch.return_logprob and not s.running_batch.return_logprob
                and not batch.return_hidden_states and not s.running_batch.return_hidden_states):
            running = s.running_batch
            running.filter_batch()
            if not running.is_empty() and running.check_decode_mem():
                running.prepare_for_decode()
                batch.mix_with_running(running)
                s.running_batch = s._empty_batch()
        return batch
