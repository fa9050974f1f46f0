"""The decode server's transfer queues: PreallocQueue -> TransferQueue -> waiting queue.

A request arrives with its bootstrap address and room. The PreallocQueue creates its receiver,
waits until the prefill is found (WaitingForInput), then, in FIFO order and only while the memory
budget allows, reserves a request row, KV slots for the prompt and a metadata row, and publishes
them to the prefill (`send_metadata`). From then on the TransferQueue polls it until the KV and
the metadata row have arrived (Success, behind the metadata gate), commits the first token into
the request and hands it to the waiting queue; the scheduler builds prebuilt batches from there.
Every poll is reduced with a MIN across TP ranks before any request moves.

Failures anywhere end as an abort with status 500 (400 for a prompt that can never fit), streamed
to the client, and the queue that holds the request frees exactly what it holds: nothing in the
PreallocQueue, the row, the slots and the metadata row (stamp reset) in the TransferQueue.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple

import torch

from engine.disaggregation.base import FailureCause, KVPoll, agreed_failures, poll_and_all_reduce, take_matching
from engine.disaggregation.conn_common import KVReceiver, now
from engine.disaggregation.fake import fake_first_token
from engine.disaggregation.metadata import MetadataBuffers, ReqToMetadataIdxAllocator
from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator
from engine.disaggregation.metrics import DisaggMetrics
from engine.disaggregation.recompute import RecomputeReq
from engine.scheduler.req import CLIP_MAX_NEW_TOKENS_ESTIMATION, FINISH_ABORT, FINISH_LENGTH, Req

if TYPE_CHECKING:
    from engine.constrained.grammar_manager import GrammarManager, PendingGrammar
    from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)


@dataclass
class DecodeRequest:
    req: Req
    kv_receiver: KVReceiver
    waiting_for_input: bool = False
    metadata_buffer_index: int = -1
    # Decode: the destination was reserved but is published only once every forward launched
    # before the reservation finished (one of them may still write a slot it just got back).
    publish_after: Optional[Callable[[], bool]] = None
    slots: Optional[torch.Tensor] = None
    # A constrained request's grammar, compiling while the KV transfers (None once attached).
    grammar: Optional[PendingGrammar] = None
    # A re-bootstrap (pause_generation retract): the prefill recomputes the KV of these ids (the
    # prompt and every output token but the last, which the decode step computes); None: new.
    recompute_ids: Optional[List[int]] = None

    @property
    def kv_len(self) -> int:
        """The tokens whose KV the prefill sends (the slots reserved for them)."""
        return len(self.req.origin_input_ids) if self.recompute_ids is None else len(self.recompute_ids)


@dataclass
class RetractedReq:
    """A request taken out of the running batch, with its KV backed up until it resumes."""

    req: Req
    # Of (the KV [layers, 2, committed, heads, dim], the features [committed, width] or None) on the CPU.
    kv_backup: Optional[Future]
    committed_len: int


@dataclass
class DecodeMemory:
    """What the decode queues allocate from."""

    req_to_token_pool: ReqToTokenPool
    allocator: PagedTokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    metadata: MetadataBuffers
    metadata_allocator: ReqToMetadataIdxAllocator
    max_total_num_tokens: int
    num_reserved_decode_tokens: int

    def alloc_prompt(self, req: Req, num_tokens: int) -> torch.Tensor:
        """A request row and `num_tokens` slots for positions [0, num_tokens) of `req`.

        The budget check makes failure impossible; if it happens anyway that is a bug in it.
        """
        rows = self.req_to_token_pool.alloc(1)
        assert rows is not None, "decode pre-allocation: no free request row despite the budget check"
        page = self.allocator.page_size
        if isinstance(self.allocator, SWATokenToKVPoolAllocator):
            # The hybrid sliding-window pool: windowed slots for the last window only.
            slots = self.allocator.alloc_received(rows[0], num_tokens)
        elif page == 1:
            slots = self.allocator.alloc(num_tokens)
        else:
            slots = self.allocator.alloc_extend(torch.tensor([0]), torch.tensor([num_tokens]), torch.tensor([-1]),
                                                num_tokens)
        if slots is None:
            self.req_to_token_pool.free(rows[0])
            raise AssertionError(f"decode pre-allocation: {num_tokens} KV slots unavailable despite the budget check")
        req.req_pool_idx = rows[0]
        table = self.req_to_token_pool.req_to_token
        table[req.req_pool_idx, :num_tokens] = slots.to(table.dtype)
        req.kv_allocated_len = num_tokens
        req.cache_protected_len = 0
        return slots

    def release(self, req: Req) -> None:
        """Free a request's row and slots without inserting anything into the cache."""
        self.tree_cache.cache_finished_req(req, is_insert=False)

    def release_metadata(self, index: int) -> None:
        if index >= 0:
            self.metadata.reset(index)  # before the free: 0 means "not written" to the next owner
            self.metadata_allocator.free(index)

    def ceil_page(self, n: int) -> int:
        page = self.allocator.page_size
        return -(-n // page) * page


def recompute_request(req: Req, ids: List[int]) -> RecomputeReq:
    """What the prefill needs to recompute `req`'s KV: the ids, and its priority and cache namespace."""
    namespace = req.extra_key
    extra_key, cache_salt = namespace if isinstance(namespace, tuple) else (None, None)
    return RecomputeReq(rid=req.rid, room=req.bootstrap_room or 0, input_ids=ids, priority=req.priority,
                        extra_key=extra_key, cache_salt=cache_salt)


def abort_req(req: Req, message: str, status_code: int = 500) -> None:
    req.finished_reason = FINISH_ABORT(message, status_code,
                                       "InternalServerError" if status_code >= 500 else "BadRequestError")


class DecodeTransferQueue:
    def __init__(self, memory: DecodeMemory, metrics: DisaggMetrics, vocab_size: int,
                 grammars: "GrammarManager") -> None:
        self.memory = memory
        self.grammars = grammars
        self.metrics = metrics
        self.vocab_size = vocab_size
        self.queue: List[DecodeRequest] = []

    def extend(self, reqs: List[DecodeRequest]) -> None:
        self.queue.extend(reqs)

    def _publish_ready(self) -> None:
        for dreq in self.queue:
            if dreq.publish_after is not None and dreq.publish_after():
                dreq.publish_after = None
                assert dreq.slots is not None  # reserved (alloc_prompt) before publish_after is set
                dreq.kv_receiver.send_metadata(dreq.slots, dreq.metadata_buffer_index)
                if dreq.recompute_ids is not None:
                    # After the destination, as SGLang: the prefill may compute at once.
                    dreq.kv_receiver.request_recompute(recompute_request(dreq.req, dreq.recompute_ids))

    def _gated_poll(self, dreq: DecodeRequest) -> KVPoll:
        """The local poll with the metadata gate: Success counts only once the row carries the room."""
        poll = dreq.kv_receiver.poll()
        if poll != KVPoll.Failed and self._grammar_error(dreq) is not None:
            # The prefill refused the same constraint: it will send nothing. Fail now, as a 400.
            return KVPoll.Failed
        if dreq.publish_after is not None and poll != KVPoll.Failed:
            return KVPoll.WaitingForInput
        if poll == KVPoll.Success and not dreq.kv_receiver.is_fake \
                and self.memory.metadata.room(dreq.metadata_buffer_index) == 0:
            return KVPoll.Transferring
        if poll == KVPoll.Success and dreq.grammar is not None and not self.grammars.is_ready(dreq.grammar):
            return KVPoll.Transferring  # the KV is here, the grammar still compiles
        return poll

    def _grammar_error(self, dreq: DecodeRequest) -> Optional[str]:
        return None if dreq.grammar is None else self.grammars.compile_error(dreq.grammar)

    def failure(self, dreq: DecodeRequest) -> Optional[Tuple[str, FailureCause]]:
        """Why `dreq` failed on this rank: its grammar first (a 400), else its transfer."""
        error = self._grammar_error(dreq)
        return (error, FailureCause.BAD_REQUEST) if error is not None else dreq.kv_receiver.failure()

    def pop_transferred(self) -> Tuple[List[Req], List[Req]]:
        """(requests whose KV arrived, ready for the waiting queue; requests that failed)."""
        if not self.queue:
            return [], []
        self._publish_ready()
        polls = poll_and_all_reduce(_GatedSource(self, d) for d in self.queue)
        done: List[Req] = []
        failed: List[Req] = []
        kept: List[DecodeRequest] = []
        reasons = iter(agreed_failures(_GatedSource(self, d) for d, p in zip(self.queue, polls) if p == KVPoll.Failed))
        for dreq, poll in zip(self.queue, polls):
            req = dreq.req
            if poll == KVPoll.Success:
                if self._commit(dreq):
                    done.append(req)
                else:
                    failed.append(req)
            elif poll == KVPoll.Failed:
                reason, cause = next(reasons)
                dreq.kv_receiver.abort(reason, cause)  # fence (and tell the prefill) before freeing
                if cause == FailureCause.BAD_REQUEST:
                    abort_req(req, reason, 400)
                else:
                    abort_req(req, f"KV transfer failed: {reason}")
                self.metrics.observe_failure(True, cause)
                self._release(dreq)
                failed.append(req)
            else:
                kept.append(dreq)
        self.queue = kept
        return done, failed

    def _commit(self, dreq: DecodeRequest) -> bool:
        req, receiver, index = dreq.req, dreq.kv_receiver, dreq.metadata_buffer_index
        if dreq.grammar is not None:
            pending, dreq.grammar = dreq.grammar, None
            error = self.grammars.attach_pending(pending)
            if error is not None:  # the grammar failed to compile (or timed out): SGLang's 400 too
                abort_req(req, error, 400)
                self._release(dreq)
                return False
        if receiver.is_fake:
            token, logprob, top_val, top_idx, cached = fake_first_token(req.rid, self.vocab_size), 0.0, [], [], 0
        else:
            meta = self.memory.metadata.get_buf(index)
            if meta.room != req.bootstrap_room:
                # A metadata row with another request's room: an index collision or corruption.
                # Nothing of it may be used, and its KV never enters a cache.
                receiver.abort(f"metadata room mismatch (row {index} carries room {meta.room})",
                               FailureCause.CORRUPT)
                abort_req(req, f"KV transfer failed: metadata room mismatch (expected {req.bootstrap_room}, "
                               f"got {meta.room})")
                self.metrics.observe_failure(True, FailureCause.CORRUPT)
                self._release(dreq)
                return False
            token, logprob, top_val, top_idx, cached = (meta.output_id, meta.logprob, meta.top_val, meta.top_idx,
                                                        meta.cached_tokens)
        times = receiver.times
        times.done = now()
        self.metrics.observe_received(times, receiver.received_bytes(),
                                      0 if receiver.is_fake else len(req.origin_input_ids))
        if logger.isEnabledFor(logging.DEBUG) and times.bootstrapped is not None and times.dst_sent is not None:
            logger.debug("KV of %s (room %s) committed: bootstrap %.1f ms, waited for memory %.1f ms, transfer "
                         "%.1f ms, %d bytes", req.rid, req.bootstrap_room, (times.bootstrapped - times.created) * 1e3,
                         (times.dst_sent - times.bootstrapped) * 1e3, (times.done - times.dst_sent) * 1e3,
                         receiver.received_bytes())
        receiver.clear()
        self.memory.release_metadata(index)
        if dreq.recompute_ids is not None:
            # A re-bootstrap: its last output token (emitted before the pause) is already in
            # output_ids and goes into the next decode step; the prefill's handoff token, sampled
            # again, is dropped (SGLang replays the emitted one too), and so are its logprobs.
            return True
        req.cached_tokens = cached
        if req.max_new_tokens == 0:
            req.finished_reason = FINISH_LENGTH(0)  # the unified server returns no token either
            return True
        req.output_ids.append(token)
        if req.return_logprob:
            req.output_token_logprobs_val.append(logprob)
            req.output_token_logprobs_idx.append(token)
            if req.top_logprobs_num > 0:
                req.output_top_logprobs_val.append(top_val[:req.top_logprobs_num])
                req.output_top_logprobs_idx.append(top_idx[:req.top_logprobs_num])
        # The prefill sampled it under the same grammar; the matcher starts from it (a token it
        # refuses, only possible with a mismatched prefill, ends the request with a 400).
        req.accept_grammar_token(token)
        return True

    def _release(self, dreq: DecodeRequest) -> None:
        dreq.kv_receiver.clear()
        self.memory.release(dreq.req)
        self.memory.release_metadata(dreq.metadata_buffer_index)
        dreq.metadata_buffer_index = -1

    def abort(self, match: Callable[[Req], bool]) -> List[Req]:
        """Client aborts: fence, free and answer at once (status None: a client's own abort)."""
        taken, self.queue = take_matching(self.queue, lambda d: match(d.req))
        for dreq in taken:
            dreq.kv_receiver.abort("aborted by the client")
            dreq.req.finished_reason = FINISH_ABORT()
            self._release(dreq)
        return [d.req for d in taken]


class _GatedSource:
    def __init__(self, queue: DecodeTransferQueue, dreq: DecodeRequest) -> None:
        self.queue, self.dreq = queue, dreq

    def poll(self) -> KVPoll:
        return self.queue._gated_poll(self.dreq)

    def failure(self) -> Optional[Tuple[str, FailureCause]]:
        return self.queue.failure(self.dreq)


@dataclass
class AdmissionState:
    """What the admission budget reads about the requests that already hold decode memory."""

    running: List[Req] = field(default_factory=list)
    num_transferring: int = 0
    num_waiting: int = 0


def allocatable_tokens(memory: DecodeMemory, state: AdmissionState, retracted: List[RetractedReq],
                       admitted_now: int, count_retracted: bool = True) -> int:
    """SGLang's `_allocatable_token_budgets`: free slots minus what live requests may still need.

    Requests in transfer cannot be retracted (their KV is being written), so a new one is admitted
    only if it could run to the end even if every running request were retracted (the second rule
    in `fits`); `reserved` keeps room for every live request to decode a while.
    """
    reserve = memory.num_reserved_decode_tokens
    retractable = sum(len(r.origin_input_ids) + len(r.output_ids) for r in state.running)
    n_active = len(state.running) + state.num_transferring + state.num_waiting + admitted_now
    reserved = reserve * n_active
    worst_single = max((len(r.origin_input_ids) + min(r.max_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATION)
                        - retractable for r in state.running), default=0)
    available = memory.allocator.available_size()
    allocatable = available - max(reserved, worst_single)
    if count_retracted:
        allocatable -= sum(memory.ceil_page(r.committed_len) + reserve for r in retracted)
    return allocatable


def fits(memory: DecodeMemory, state: AdmissionState, req: Req, required: int, allocatable: int) -> bool:
    retractable = sum(len(r.origin_input_ids) + len(r.output_ids) for r in state.running)
    lifetime = len(req.origin_input_ids) + min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATION) - retractable
    return required + memory.num_reserved_decode_tokens <= allocatable and lifetime <= allocatable
