"""The prefill role of a scheduler: bootstrap queue -> waiting queue -> prefill -> inflight queue.

A request first waits in the bootstrap queue until every decode rank that will hold it reserved
its memory (its sender reaches WaitingForInput): a decode server that is out of memory slows the
prefill down instead of overflowing. Then it is an ordinary waiting request (prefix cache, chunked
prefill, batching). After its last chunk the result processor hands it here (`handoff`): the
first token goes into a metadata row, the KV of the whole prompt is sent by the transfer
manager's background thread, and the request waits in the inflight queue, its KV locked, until
the transfer is done. Then it finishes with length 0 (SGLang's shape; the router only uses this
response for its input logprobs) and its KV is released into the radix cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional

from engine.disaggregation.base import (
    FAKE_BOOTSTRAP_HOST,
    DisaggregationMode,
    FailureCause,
    KVPoll,
    agreed_failures,
    poll_and_all_reduce,
    take_matching,
    validate_pd_request,
)
from engine.disaggregation.conn_common import KVSender, TransferConfig
from engine.disaggregation.decode import abort_req
from engine.disaggregation.fake import FakeKVSender
from engine.disaggregation.metadata import (
    MAX_TOP_LOGPROBS,
    FirstTokenMetadata,
    MetadataBuffers,
    ReqToMetadataIdxAllocator,
    idle_leaks,
)
from engine.disaggregation.metrics import DisaggMetrics
from engine.disaggregation.wiring import TransferBackend, build_prefill_manager, kv_args_for
from engine.scheduler.req import FINISH_ABORT, FINISH_LENGTH, Req

if TYPE_CHECKING:
    from engine.disaggregation.loopback import LoopbackNetwork
    from engine.disaggregation.host import RoleHost

logger = logging.getLogger(__name__)


@dataclass
class PrefillRequest:
    req: Req
    sender: KVSender
    metadata_buffer_index: int = -1


class PrefillDisaggregation:
    # A Literal, so that checking `mode` tells the type checker which role it has.
    mode: Literal[DisaggregationMode.PREFILL] = DisaggregationMode.PREFILL

    def __init__(self, host: "RoleHost", network: Optional["LoopbackNetwork"] = None) -> None:
        self.host = host
        args = host.server_args
        self.backend = TransferBackend(args.disaggregation_transfer_backend)
        self.metrics = DisaggMetrics()
        # Requests past the bootstrap queue hold a request row until their transfer ends, so
        # there are never more of them than rows.
        rows = host.kv.req_to_token_pool.size
        self.metadata = MetadataBuffers(rows)
        self.metadata_allocator = ReqToMetadataIdxAllocator(rows)
        self.config = TransferConfig.from_server_args(args)
        self.manager = None if self.backend == TransferBackend.FAKE else build_prefill_manager(
            args, kv_args_for(host, self.metadata), self.config, self.metrics, network)
        self.bootstrap_queue: List[PrefillRequest] = []
        self.tracked: Dict[int, PrefillRequest] = {}  # waiting or being prefilled, by id(req)
        self.inflight: List[PrefillRequest] = []

    # ------------------------------------------------------------------ requests in
    def validate(self, req: Req) -> Optional[str]:
        error = validate_pd_request(req, self.backend == TransferBackend.FAKE)
        if error is None and req.return_logprob and req.top_logprobs_num > MAX_TOP_LOGPROBS:
            error = f"top_logprobs_num must be <= {MAX_TOP_LOGPROBS} with PD disaggregation."
        return error

    def on_refused(self, req: Req, message: str) -> None:
        """Nothing to tell: the decode half of a request refused here reserves memory, publishes
        it and then ends at its waiting timeout (SGLang's behaviour too)."""

    def add_request(self, req: Req, is_retracted: bool = False) -> None:
        # The prefill computes one token; an exact estimate makes its admission exact too.
        req.sampling_params.max_new_tokens = 1
        if self.manager is None or req.bootstrap_host in (None, FAKE_BOOTSTRAP_HOST):
            sender: KVSender = FakeKVSender(req.bootstrap_room or 0)
        else:
            from engine.disaggregation.conn_prefill import PrefillKVSender

            assert req.bootstrap_room is not None  # validate_pd_request: a bootstrap host comes with a room
            sender = PrefillKVSender(self.manager, req.bootstrap_room)
        self.bootstrap_queue.append(PrefillRequest(req=req, sender=sender))

    # ------------------------------------------------------------------ queues
    def process_queues(self) -> None:
        self._pop_bootstrapped()
        self._process_inflight()
        self._sweep_finished()
        if self.manager is not None:
            self.manager.prune()

    def _pop_bootstrapped(self) -> None:
        if not self.bootstrap_queue:
            return
        polls = poll_and_all_reduce(p.sender for p in self.bootstrap_queue)
        kept: List[PrefillRequest] = []
        failed: List[Req] = []
        reasons = iter(agreed_failures(p.sender for p, poll in zip(self.bootstrap_queue, polls)
                                       if poll == KVPoll.Failed))
        for preq, poll in zip(self.bootstrap_queue, polls):
            if poll == KVPoll.Failed:
                reason, cause = next(reasons)
                preq.sender.clear()
                abort_req(preq.req, f"KV transfer failed before the prefill: {reason}")
                self.metrics.observe_failure(False, cause)
                failed.append(preq.req)
            elif poll >= KVPoll.WaitingForInput:
                self.metrics.observe_bootstrap(preq.sender.times)
                self.tracked[id(preq.req)] = preq
                self.host.enqueue_waiting(preq.req)
            else:
                kept.append(preq)
        self.bootstrap_queue = kept
        self.host.stream(failed)

    def handoff(self, req: Req) -> None:
        """The last chunk of `req` was prefilled and its first token appended: send its KV."""
        preq = self.tracked.pop(id(req))
        host = self.host
        if req.to_finish is not None:  # aborted by the client while it was prefilled (all ranks)
            preq.sender.abort("aborted by the client")
            req.finished_reason, req.to_finish = req.to_finish, None
            preq.sender.clear()
            host.kv.tree_cache.cache_finished_req(req, is_insert=False)
            host.stream([req])
            return
        # A sender that failed meanwhile is not looked at here: its rank alone may know. The send
        # stops at once and the inflight queue's reduced poll fails the request on every rank.
        # Keep the prompt's KV (shareable, locked by this request) until the transfer is done.
        host.kv.tree_cache.cache_unfinished_req(req)
        # The hybrid sliding-window pool: the decode side reads the windowed K/V of the last window only.
        assert req.req_pool_idx is not None  # a prefilled request holds its row until the transfer ends
        host.kv.token_to_kv_pool_allocator.keep_last_window(
            req.req_pool_idx, len(req.origin_input_ids), req.cache_protected_len, host.kv.req_to_token_pool.req_to_token)
        index = self.metadata_allocator.alloc()
        assert index is not None, "more requests in transfer than request rows"
        preq.metadata_buffer_index = index
        self.metadata.set_buf(index, _first_token_metadata(req))
        row = host.kv.req_to_token_pool.req_to_token[req.req_pool_idx, :len(req.origin_input_ids)]
        preq.sender.send(row, self.metadata.row_bytes(index))
        self.inflight.append(preq)

    def _process_inflight(self) -> None:
        if not self.inflight:
            return
        polls = poll_and_all_reduce(p.sender for p in self.inflight)
        kept: List[PrefillRequest] = []
        done: List[Req] = []
        reasons = iter(agreed_failures(p.sender for p, poll in zip(self.inflight, polls) if poll == KVPoll.Failed))
        for preq, poll in zip(self.inflight, polls):
            req = preq.req
            if poll == KVPoll.Success:
                req.finished_reason = FINISH_LENGTH(0)
                self.host.kv.tree_cache.cache_finished_req(req)
            elif poll == KVPoll.Failed:
                reason, cause = next(reasons)
                abort_req(req, f"KV transfer failed: {reason}")
                self.metrics.observe_failure(True, cause)
                self.host.kv.tree_cache.cache_finished_req(req, is_insert=False)
            else:
                kept.append(preq)
                continue
            preq.sender.clear()
            self.metadata.reset(preq.metadata_buffer_index)
            self.metadata_allocator.free(preq.metadata_buffer_index)
            done.append(req)
        self.inflight = kept
        self.host.stream(done)

    def _sweep_finished(self) -> None:
        """Requests that ended while waiting or mid-prefill (client abort, chunk teardown, a
        waiting timeout): tell the decode side and forget their transfer state."""
        for key, preq in list(self.tracked.items()):
            if preq.req.finished():
                preq.sender.abort("the prefill server dropped the request", FailureCause.ABORTED)
                preq.sender.clear()
                del self.tracked[key]

    # ------------------------------------------------------------------ aborts and state
    def abort(self, match: Callable[[Req], bool]) -> List[Req]:
        taken, self.bootstrap_queue = take_matching(self.bootstrap_queue, lambda p: match(p.req))
        for preq in taken:
            preq.sender.abort("aborted by the client")
            preq.sender.clear()
            preq.req.finished_reason = FINISH_ABORT()
        for preq in self.inflight:  # the next poll sees Failed and releases
            if match(preq.req):
                preq.sender.abort("aborted by the client")
        return [p.req for p in taken]

    def requests_holding_kv(self) -> int:
        """Requests whose KV is locked for their transfer (the others are in the scheduler's view)."""
        return len(self.inflight)

    def is_idle(self) -> bool:
        return not (self.bootstrap_queue or self.tracked or self.inflight)

    def check_memory(self) -> Optional[str]:
        return idle_leaks(self.metadata, self.metadata_allocator, self.manager)

    def internal_state(self) -> Dict[str, Any]:
        return {
            "mode": self.mode.value,
            "num_prefill_prealloc_queue_reqs": len(self.bootstrap_queue),
            "num_prefill_inflight_queue_reqs": len(self.inflight),
            "metrics": self.metrics.snapshot(),
        }

    def queue_summary(self) -> str:
        return f"#bootstrap-req: {len(self.bootstrap_queue)}, #inflight-req: {len(self.inflight)}"

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def _first_token_metadata(req: Req) -> FirstTokenMetadata:
    meta = FirstTokenMetadata(room=req.bootstrap_room or 0, output_id=req.output_ids[-1],
                              cached_tokens=req.cached_tokens)
    if req.return_logprob and req.output_token_logprobs_val:
        meta.logprob = req.output_token_logprobs_val[-1]
        if req.top_logprobs_num > 0 and req.output_top_logprobs_val:
            meta.top_val = list(req.output_top_logprobs_val[-1])
            meta.top_idx = list(req.output_top_logprobs_idx[-1])
    return meta
