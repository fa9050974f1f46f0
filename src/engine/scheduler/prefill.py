"""Which waiting requests join a step's prefill batch: SGLang's get_new_batch_prefill.

The chunked request's next chunk goes first, then the waiting requests in the order of the schedule
policy (SchedulePolicy), each admitted by PrefillAdder while the token budget and the request slots
last; a request whose uncached head another admitted request is computing waits one round instead
(UncachedPrefixDedup). With priority scheduling a more urgent request may preempt running ones (they
go back to the queue, their output kept); with --enable-mixed-chunk the running decode batch rides
along in the same forward.

The prefill builder owns the chunked request (the one prompt being prefilled chunk by chunk) and
its pending abort; it takes requests from the waiting queue and the running set through their
methods, and hands preempted requests back through `requeue`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Optional

from engine.scheduler.kv_manager import KVManager
from engine.scheduler.priority import PriorityPolicy
from engine.scheduler.req import FINISH_ABORT, Req
from engine.scheduler.running_set import RunningSet
from engine.scheduler.schedule_batch import ScheduleBatch
from engine.scheduler.schedule_policy import AddReqResult, PrefillAdder, SchedulePolicy, UncachedPrefixDedup
from engine.scheduler.waiting_queue import WaitingQueue

if TYPE_CHECKING:
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)


class PrefillBuilder:
    def __init__(self, args: ServerArgs, kv: KVManager, waiting: WaitingQueue, running: RunningSet,
                 priority: PriorityPolicy, max_running_requests: int, page_size: int,
                 requeue: Callable[[Req], None], on_batch: Callable[[ScheduleBatch], None]) -> None:
        self.args = args
        self.kv = kv
        self.waiting = waiting
        self.running = running
        self.priority = priority
        self.max_running_requests = max_running_requests
        self.page_size = page_size
        self.requeue = requeue  # a preempted request goes back to the waiting queue
        self.on_batch = on_batch  # stats: a prefill batch was built
        self.policy = SchedulePolicy(args.schedule_policy, kv.tree_cache, radix_enabled=not args.disable_radix_cache,
                                     seed=args.random_seed, priority=priority)
        # Keys of the last prefill batch's uncached prompt heads (UncachedPrefixDedup); None when
        # the radix cache is off (nothing is shared, so waiting would gain nothing).
        self.last_prefill_keys: Optional[set] = None if args.disable_radix_cache else set()
        chunk = args.chunked_prefill_size
        self.chunked_prefill_size: Optional[int] = chunk if chunk is not None and chunk > 0 else None
        self._chunked_req: Optional[Req] = None
        self._pending_chunked_abort = False

    # ------------------------------------------------------------------ the chunked request
    @property
    def chunked_req(self) -> Optional[Req]:
        return self._chunked_req

    def abort_chunked_if(self, match: Callable[[Req], bool]) -> None:
        """Tearing down a chunked request mid-iteration is unsafe: it happens at the next build."""
        if self._chunked_req is not None and match(self._chunked_req):
            self._pending_chunked_abort = True

    def teardown_pending_abort(self) -> Optional[Req]:
        """The chunked request whose abort was pending, finished and released (to stream), or None."""
        if not self._pending_chunked_abort:
            return None
        self._pending_chunked_abort = False
        req, self._chunked_req = self._chunked_req, None
        if req is None:
            return None
        req.finished_reason = FINISH_ABORT()
        self.kv.tree_cache.cache_finished_req(req, is_insert=False)
        return req

    def cache_chunked_progress(self) -> None:
        """Make the processed chunks tree-owned and locked; the next chunk extends them."""
        if self._chunked_req is not None:
            self.kv.tree_cache.cache_unfinished_req(self._chunked_req)

    def take_chunked_for_retract(self) -> Optional[Req]:
        """pause_generation(retract): the chunked request leaves with its KV released, to be
        prefilled again from the start."""
        req, self._chunked_req = self._chunked_req, None
        self._pending_chunked_abort = False
        if req is None or req.finished():
            return None
        self.kv.tree_cache.cache_finished_req(req, is_insert=False)
        req.reset_for_retract()
        return req

    # ------------------------------------------------------------------ building
    def _running_loras(self) -> set:
        reqs = list(self.running.reqs) + ([self._chunked_req] if self._chunked_req is not None else [])
        return {r.lora_id for r in reqs if r.lora_id is not None}

    def _num_allocatable_reqs(self) -> int:
        return min(self.max_running_requests - self.running.size(),
                   self.kv.free_request_rows() + (1 if self._chunked_req is not None else 0))

    def build(self) -> Optional[ScheduleBatch]:
        """The prefill (extend) batch of this step, or None: the chunked request's next chunk, then
        waiting requests in policy order while the token budget and the request slots last (with
        priority preemption, mixing with the running decode batch under --enable-mixed-chunk)."""
        running, waiting = self.running, self.waiting
        preemption = self.priority.preemption_enabled
        if preemption:
            # A more urgent arrival may preempt its way into a full batch (SGLang).
            running.set_full(False)
        if (running.is_full or not len(waiting)) and self._chunked_req is None:
            return None
        if self._num_allocatable_reqs() <= 0 and self._chunked_req is None and not preemption:
            running.set_full(True)
            return None

        waiting.sort(lambda reqs: self.policy.calc_priority(reqs, running.reqs))
        mixed = self.args.enable_mixed_chunk and not running.is_empty()
        adder = PrefillAdder(
            self.page_size, self.kv.tree_cache, self.kv.token_to_kv_pool_allocator, list(running.reqs),
            running.new_token_ratio, self.args.max_prefill_tokens, self.chunked_prefill_size,
            mixed_with_decode_tokens=running.size() if mixed else 0,
        )
        dedup = UncachedPrefixDedup(self.last_prefill_keys) if self.last_prefill_keys is not None else None
        # LoRA: the adapters of the running batch and of this prefill (they run together once merged)
        # stay within --max-loras-per-batch, the pool's slots (SGLang's admission rule).
        loras = self._running_loras() if self.args.enable_lora else None
        if self._chunked_req is not None:
            chunked = self._chunked_req
            chunked.init_next_round_input()
            self._chunked_req = adder.add_chunked_req(chunked)
            if dedup is not None and chunked in adder.can_run_list:
                # Its earlier chunks are in the tree, so a request of the same group matches up to
                # where this chunk starts and would compute the chunk's tokens a second time.
                dedup.admit(chunked)
        for req in waiting:
            full = len(adder.can_run_list) >= self._num_allocatable_reqs()
            if full:
                running.set_full(True)
                if not preemption:
                    break
            req.init_next_round_input(self.kv.tree_cache)
            if dedup is not None and dedup.is_duplicate(req):
                continue  # its shared head is being computed for another request: reuse it next round
            if full and not adder.preempt_to_schedule(req, self.priority, running):
                break
            if loras is not None and req.lora_id is not None and req.lora_id not in loras:
                if len(loras) >= self.args.max_loras_per_batch:
                    continue  # its adapter waits for a slot; requests of loaded adapters go on
            result = adder.add_one_req(req)
            if loras is not None and req.lora_id is not None and adder.can_run_list \
                    and adder.can_run_list[-1] is req:
                loras.add(req.lora_id)
            if dedup is not None and adder.can_run_list and adder.can_run_list[-1] is req:
                dedup.admit(req)
            if result != AddReqResult.CONTINUE:
                if result == AddReqResult.NO_TOKEN:
                    running.set_full(True)
                break

        for victim in adder.preempt_list:
            # Back to the queue with their output kept, like a retraction.
            self.requeue(victim)
        if adder.preempt_list:
            logger.info("Priority preemption: %d running request(s) preempted", len(adder.preempt_list))
        can_run = adder.can_run_list
        if dedup is not None:
            self.last_prefill_keys = dedup.admitted_keys
        if not can_run:
            return None
        waiting.remove_admitted(can_run)
        if adder.new_chunked_req is not None:
            assert self._chunked_req is None, "only one chunked request may exist"
            self._chunked_req = adder.new_chunked_req
        if self._chunked_req is not None and any(r is self._chunked_req for r in can_run):
            # Counts its chunks in flight; a round in which it got no chunk (less than a page of
            # budget left) must not count, or its last chunk would be taken for a middle one.
            self._chunked_req.is_chunked += 1

        batch = self.kv.new_batch(can_run)
        batch.prepare_for_extend()
        batch.log_input_tokens, batch.log_hit_tokens = adder.log_input_tokens, adder.log_hit_tokens
        self.on_batch(batch)

        # Mixing needs neither side to return logprobs or hidden states (their rows are per extend).
        if (mixed and not batch.return_logprob and not running.batch.return_logprob
                and not batch.return_hidden_states and not running.batch.return_hidden_states):
            decoding = running.take_for_mixing()
            if decoding is not None:
                batch.mix_with_running(decoding)
        return batch
