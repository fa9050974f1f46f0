"""Stage A of the decode server: the PreallocQueue (and the queue of retracted requests).

pop_preallocated(), every polling tick:
  1. poll the receivers (reduced across TP ranks): Failed ones are aborted (500), the others
     that found their prefill are marked waiting_for_input;
  2. in FIFO order, reserve a request row, the prompt's KV slots and a metadata row for each
     request that waits for input, and stop (break, not skip) at the first one the budget does
     not allow: a later, smaller request never overtakes a large one.
Retracted requests resume first (their KV comes back from the CPU backup, no transfer).

Requests retracted by pause_generation(mode="retract") are held instead (no KV, no backup) until
generation continues, then re-bootstrapped (SGLang's PD true retraction): they queue here like new
requests, with room for the prompt and every output token but the last, and the prefill
recomputes that KV with its current weights (a weight update usually happened meanwhile).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch

from engine.disaggregation.base import KVPoll, agreed_failures, poll_and_all_reduce, take_matching
from engine.disaggregation.conn_common import KVReceiver
from engine.disaggregation.decode import (
    AdmissionState,
    DecodeMemory,
    DecodeRequest,
    RetractedReq,
    abort_req,
    allocatable_tokens,
    fits,
)
from engine.disaggregation.metrics import DisaggMetrics
from engine.scheduler.req import FINISH_ABORT, Req

if TYPE_CHECKING:
    from engine.constrained.grammar_manager import PendingGrammar

logger = logging.getLogger(__name__)


class DecodePreallocQueue:
    def __init__(self, memory: DecodeMemory, metrics: DisaggMetrics,
                 make_receiver: Callable[[Req], KVReceiver], fence: Callable[[], Callable[[], bool]],
                 restore: Callable[[Req, torch.Tensor, Optional[Future]], None],
                 order_key: Optional[Callable[[Req], Tuple[int, float]]] = None) -> None:
        self.memory = memory
        # --enable-priority-scheduling: the queue is taken in (urgency, arrival) order, as SGLang
        # sorts it before its allocation pass; None keeps plain FIFO.
        self.order_key = order_key
        self.metrics = metrics
        self.make_receiver = make_receiver
        self.fence = fence  # -> "have the forwards launched so far finished?"
        self.restore = restore  # copies a retracted request's backup into its new slots (in order)
        self.queue: List[DecodeRequest] = []
        self.retracted_queue: List[RetractedReq] = []
        # Retracted by a pause: their KV is recomputed by the prefill once generation continues.
        self.held: List[Req] = []

    # ------------------------------------------------------------------ entry
    def capacity_error(self, req: Req) -> str | None:
        """A prompt this server can never hold (it would block the FIFO forever)."""
        need = self.memory.ceil_page(len(req.origin_input_ids)) + self.memory.num_reserved_decode_tokens
        if need > self.memory.max_total_num_tokens:
            return (f"The input ({len(req.origin_input_ids)} tokens) does not fit in this decode server's KV cache "
                    f"({self.memory.max_total_num_tokens} tokens, {self.memory.num_reserved_decode_tokens} of them "
                    "reserved per request).")
        return None

    def add(self, req: Req, grammar: Optional[PendingGrammar] = None) -> None:
        self.queue.append(DecodeRequest(req=req, kv_receiver=self.make_receiver(req), grammar=grammar))

    def add_retracted(self, req: Req) -> None:
        backup, req.kv_backup = req.kv_backup, None
        committed = len(req.origin_input_ids) + len(req.output_ids) - 1
        self.retracted_queue.append(RetractedReq(req=req, kv_backup=backup, committed_len=committed))

    # ------------------------------------------------------------------ re-bootstrap
    def hold(self, req: Req) -> None:
        """Keep a request retracted by a pause (its KV freed, not backed up) until continue.

        Not queued yet: a queued request would hold memory and count as work while the weights
        change, and it must be prefilled with the new ones.
        """
        self.held.append(req)

    def enqueue_held(self) -> None:
        """Generation continued: the held requests queue for a re-bootstrap, in their order."""
        held, self.held = self.held, []
        for req in held:
            if not req.output_ids:  # nothing emitted yet: an ordinary transfer of the prompt
                req.is_retracted = False
                self.add(req)
                continue
            # The last output token's KV is computed by the next decode step, as after a transfer.
            ids = req.origin_input_ids + req.output_ids[:-1]
            self.queue.append(DecodeRequest(req=req, kv_receiver=self.make_receiver(req), recompute_ids=ids))

    # ------------------------------------------------------------------ retracted requests
    def resume_retracted(self, state: AdmissionState) -> List[Req]:
        """Retracted requests that fit again, KV restored, for the waiting queue (FIFO, break)."""
        resumed: List[Req] = []
        while self.retracted_queue:
            rreq = self.retracted_queue[0]
            if self.memory.req_to_token_pool.available_size() <= 0:
                break
            required = self.memory.ceil_page(rreq.committed_len)
            allocatable = allocatable_tokens(self.memory, state, self.retracted_queue, len(resumed),
                                             count_retracted=False)
            if not fits(self.memory, state, rreq.req, required, allocatable):
                break
            self.retracted_queue.pop(0)
            slots = self.memory.alloc_prompt(rreq.req, rreq.committed_len)
            self.restore(rreq.req, slots, rreq.kv_backup)
            resumed.append(rreq.req)
        return resumed

    # ------------------------------------------------------------------ new requests
    def pop_preallocated(self, state: AdmissionState) -> Tuple[List[DecodeRequest], List[Req]]:
        order_key = self.order_key
        if order_key is not None:
            self.queue.sort(key=lambda d: order_key(d.req))  # stable: FIFO among equals
        failed = self._update_handshake_waiters()
        preallocated: List[DecodeRequest] = []
        memory = self.memory
        for dreq in self.queue:
            if not dreq.waiting_for_input:
                continue
            if memory.req_to_token_pool.available_size() <= 0 or memory.metadata_allocator.available_size() <= 0:
                break
            req = dreq.req
            required = memory.ceil_page(dreq.kv_len)
            allocatable = allocatable_tokens(memory, state, self.retracted_queue, len(preallocated))
            if not fits(memory, state, req, required, allocatable):
                break
            dreq.slots = memory.alloc_prompt(req, dreq.kv_len)
            index = memory.metadata_allocator.alloc()
            assert index is not None  # available_size() was checked above
            dreq.metadata_buffer_index = index
            # Published to the prefill only after the forwards in flight finished: one of them may
            # still write a slot that was freed when its request finished and is reused here.
            dreq.publish_after = self.fence()
            preallocated.append(dreq)
        if preallocated:
            taken = {id(d) for d in preallocated}
            self.queue = [d for d in self.queue if id(d) not in taken]
        return preallocated, failed

    def _update_handshake_waiters(self) -> List[Req]:
        if not self.queue:
            return []
        polls = poll_and_all_reduce(d.kv_receiver for d in self.queue)
        failed: List[Req] = []
        kept: List[DecodeRequest] = []
        reasons = iter(agreed_failures(d.kv_receiver for d, p in zip(self.queue, polls) if p == KVPoll.Failed))
        for dreq, poll in zip(self.queue, polls):
            if poll == KVPoll.Failed:
                reason, cause = next(reasons)
                dreq.kv_receiver.abort(reason, cause)
                dreq.kv_receiver.clear()
                abort_req(dreq.req, f"KV transfer failed before it started: {reason}")
                self.metrics.observe_failure(False, cause)
                failed.append(dreq.req)
                continue
            if poll >= KVPoll.WaitingForInput:
                dreq.waiting_for_input = True
            kept.append(dreq)
        self.queue = kept
        return failed

    # ------------------------------------------------------------------ aborts
    def abort(self, match: Callable[[Req], bool]) -> List[Req]:
        """Client aborts: these requests hold no decode memory (a retracted one holds a backup)."""
        taken, self.queue = take_matching(self.queue, lambda d: match(d.req))
        for dreq in taken:
            dreq.kv_receiver.abort("aborted by the client")
            dreq.kv_receiver.clear()
        retracted, self.retracted_queue = take_matching(self.retracted_queue, lambda r: match(r.req))
        held, self.held = take_matching(self.held, match)  # SGLang cannot abort these; we can
        aborted = [d.req for d in taken] + [r.req for r in retracted] + held
        for req in aborted:
            req.finished_reason = FINISH_ABORT()
        return aborted
