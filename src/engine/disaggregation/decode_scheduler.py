"""The decode role of a scheduler: its transfer queues, prebuilt batches and retraction backups.

The Scheduler keeps its running batch and its loops; in decode mode it hands new requests here,
calls `process_queues()` once per iteration (prealloc -> transfer -> waiting), and asks
`get_next_batch_to_run()` instead of building prefill batches:

  waiting queue --(prebuilt batch: the KV is already in the pool, no forward)--> running batch
  running batch --(update_running_batch: decode memory check, retraction, prepare_for_decode)--> run

A prebuilt batch only fills in what a finished extend would have left: the request rows, the
sequence lengths (the committed KV) and the sampling info; its "result" is the handoff token the
prefill sampled, which may already finish the request (EOS, max_new_tokens 1: a quick finish).
The handoff token reaches the first decode step through the overlap relay, written on the forward
stream after the forwards in flight (one of them may still write that row for a request that just
finished). Requests retracted for memory keep a CPU copy of their committed KV and resume from it;
requests retracted by pause_generation(mode="retract") are re-bootstrapped once generation
continues: the prefill recomputes their KV with the weights it has then (decode_prealloc.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Tuple

import torch

from engine.disaggregation.base import (
    FAKE_BOOTSTRAP_HOST,
    DisaggregationMode,
    take_matching,
    bootstrap_addr,
    validate_pd_request,
)
from engine.disaggregation.conn_common import KVReceiver, TransferConfig
from engine.disaggregation.decode import AdmissionState, DecodeMemory, DecodeTransferQueue
from engine.disaggregation.decode_prealloc import DecodePreallocQueue
from engine.disaggregation.decode_refusal import RefusalNotices
from engine.disaggregation.fake import FakeKVReceiver
from engine.disaggregation.kv_io import gather_kv, layer_slots, scatter_kv
from engine.disaggregation.metadata import MetadataBuffers, ReqToMetadataIdxAllocator, idle_leaks
from engine.disaggregation.metrics import DisaggMetrics
from engine.disaggregation.wiring import TransferBackend, build_decode_manager, kv_args_for
from engine.scheduler.req import FINISH_ABORT, Req

if TYPE_CHECKING:
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.constrained.grammar_manager import PendingGrammar
    from engine.disaggregation.loopback import LoopbackNetwork
    from engine.disaggregation.host import RoleHost

logger = logging.getLogger(__name__)


class DecodeDisaggregation:
    # A Literal, so that checking `mode` tells the type checker which role it has.
    mode: Literal[DisaggregationMode.DECODE] = DisaggregationMode.DECODE

    def __init__(self, host: "RoleHost", network: Optional["LoopbackNetwork"] = None) -> None:
        self.host = host
        args = host.server_args
        self.metrics = DisaggMetrics()
        self.backend = TransferBackend(args.disaggregation_transfer_backend)
        rows = host.kv.req_to_token_pool.size  # every row may be in transfer at once
        metadata = MetadataBuffers(rows)
        self.memory = DecodeMemory(
            req_to_token_pool=host.kv.req_to_token_pool, allocator=host.kv.token_to_kv_pool_allocator,
            tree_cache=host.kv.tree_cache, metadata=metadata, metadata_allocator=ReqToMetadataIdxAllocator(rows),
            max_total_num_tokens=host.max_total_num_tokens,
            num_reserved_decode_tokens=args.num_reserved_decode_tokens)
        self.config = TransferConfig.from_server_args(args)
        self.manager = None if self.backend == TransferBackend.FAKE else build_decode_manager(
            args, kv_args_for(host, metadata), self.config, network, host.tp_rank)
        # With --enable-priority-scheduling both queues go by priority, as SGLang's decode does.
        self.order_key = host.priority.queue_order_key if host.priority.enabled else None
        self.prealloc = DecodePreallocQueue(self.memory, self.metrics, self._make_receiver, self._fence,
                                            self._restore, self.order_key)
        self.transfer = DecodeTransferQueue(self.memory, self.metrics, host.vocab_size,
                                            host.grammar_manager)
        self.waiting: List[Req] = []
        self.refusals = RefusalNotices()
        self.polling_interval = args.disaggregation_decode_polling_interval
        self._iteration = 0
        # Retraction keeps a copy of the committed KV (the scheduler calls this before the free).
        host.running.set_retraction_backup(self.backup_for_retract)

    # ------------------------------------------------------------------ requests in
    def validate(self, req: Req) -> Optional[str]:
        return (validate_pd_request(req, self.backend == TransferBackend.FAKE) or self._prefill_refusal(req)
                or self.prealloc.capacity_error(req))

    def _prefill_refusal(self, req: Req) -> Optional[str]:
        """A prefill outside --disaggregation-prefill-allowlist is refused before anything is fetched."""
        if self.manager is None or req.bootstrap_host in (None, FAKE_BOOTSTRAP_HOST) or req.bootstrap_port is None:
            return None
        return self.manager.refusal(req.bootstrap_host, req.bootstrap_port)

    def on_refused(self, req: Req, message: str) -> None:
        """The scheduler refused `req` before taking it: have its prefill half dropped now, not at
        its bootstrap timeout (decode_refusal.py). Nothing to tell without a valid, allowed
        prefill address, and never for a room a live request holds (a duplicate must not abort it).
        """
        if self.manager is None or req.bootstrap_host in (None, FAKE_BOOTSTRAP_HOST):
            return
        if not self.refusals.can_take():
            return
        if validate_pd_request(req, False) is not None or self._prefill_refusal(req) is not None:
            return
        if req.bootstrap_room is None or self.manager.has_room(req.bootstrap_room):
            return
        self.refusals.add(self._make_receiver(req), message)

    def add_request(self, req: Req, is_retracted: bool = False, grammar: Optional[PendingGrammar] = None) -> None:
        if is_retracted and self._paused_by_retract():
            self.prealloc.hold(req)
        elif is_retracted:
            self.prealloc.add_retracted(req)
        else:
            self.prealloc.add(req, grammar)

    def _paused_by_retract(self) -> bool:
        """pause_generation(mode="retract") is under way: the weights may change before continue."""
        return self.host.paused_by_retract()

    def _make_receiver(self, req: Req) -> KVReceiver:
        room = req.bootstrap_room or 0
        if self.manager is None or req.bootstrap_host == FAKE_BOOTSTRAP_HOST or req.bootstrap_host is None:
            return FakeKVReceiver(room)
        from engine.disaggregation.conn_decode import DecodeKVReceiver

        assert req.bootstrap_port is not None  # validate_pd_request: a bootstrap host comes with a port
        return DecodeKVReceiver(self.manager, room, bootstrap_addr(req.bootstrap_host, req.bootstrap_port))

    # ------------------------------------------------------------------ queues
    def _admission_state(self) -> AdmissionState:
        return AdmissionState(running=list(self.host.running.reqs),
                              num_transferring=len(self.transfer.queue), num_waiting=len(self.waiting))

    def process_queues(self) -> None:
        """prealloc -> transfer -> waiting, retracted requests first (SGLang's process_decode_queue)."""
        if self.prealloc.held:  # called only while generation runs: it continued since the pause
            self.prealloc.enqueue_held()
        self.refusals.send_ready()
        resumed = self.prealloc.resume_retracted(self._admission_state())
        self.waiting.extend(resumed)
        self._iteration += 1
        if self._iteration % self.polling_interval != 0:
            return
        failed: List[Req] = []
        if not self.prealloc.retracted_queue:
            preallocated, failed = self.prealloc.pop_preallocated(self._admission_state())
            self.transfer.extend(preallocated)
        # Polled every tick even while retracted requests wait, so finished transfers and
        # failures are never left sitting (SGLang skips it then).
        transferred, failed_transfers = self.transfer.pop_transferred()
        self.waiting.extend(transferred)
        for req in failed + failed_transfers:
            assert req.finished_reason is not None  # abort_req finished them
            logger.warning("Request %s (room %s) failed: %s", req.rid, req.bootstrap_room,
                           req.finished_reason.to_json().get("message"))
        self.host.stream(failed + failed_transfers)

    # ------------------------------------------------------------------ batches
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        host = self.host
        prebuilt = self._get_new_prebuilt_batch()
        if prebuilt is not None:
            host.running.merge(prebuilt)
        return host.update_running_batch()

    def _get_new_prebuilt_batch(self) -> Optional[ScheduleBatch]:
        host = self.host
        room = host.max_running_requests - host.running.size()
        if room <= 0 or not self.waiting:
            return None
        if self.order_key is not None:
            self.waiting.sort(key=self.order_key)  # stable: FIFO among equals
        taken, self.waiting = self.waiting[:room], self.waiting[room:]
        live: List[Req] = []
        fresh_count = 0
        for req in taken:
            fresh = not req.is_retracted
            req.is_retracted = False
            req.fill_ids = req.origin_input_ids + req.output_ids
            req.already_computed = req.kv_allocated_len
            if fresh:
                # The handoff token is the first output token: it may finish the request already.
                if not req.finished():
                    req.check_finished()
                if req.finished():
                    host.kv.tree_cache.cache_finished_req(req)
                host.stream([req])
                fresh_count += 1
            if not req.finished():
                live.append(req)
        if fresh_count:
            # The first token goes out now, not after the decode step that is about to run
            # (SGLang streams the prebuilt result at once too): it is the time to first token.
            host.flush_outputs()
        if not live:
            return None
        batch = host.kv.new_batch(live)
        batch.prepare_for_prebuilt()
        rows = batch.req_pool_indices
        assert rows is not None  # prepare_for_prebuilt sets it
        tokens = torch.tensor([r.output_ids[-1] for r in live], dtype=torch.int64)
        host.write_relay(rows, tokens)
        return batch

    # ------------------------------------------------------------------ retraction
    def backup_for_retract(self, req: Req) -> None:
        """Copy the committed KV (prompt + outputs - 1 positions) before the retraction frees it, and
        the features that travel with the KV (an EAGLE head's: the resumed request's drafts read them).

        The copy runs on the forward stream, in order: a restore queued there for this request
        (it may have resumed this very iteration) must land first, and whatever reuses the freed
        slots (forwards, restores, published transfers) comes after it.
        """
        pool = self.memory.allocator.get_kvcache()
        if pool is None or self._paused_by_retract():
            return  # nothing to keep (a test worker), or recomputed by the prefill after the pause
        committed = len(req.origin_input_ids) + len(req.output_ids) - 1
        slots = self.memory.req_to_token_pool.req_to_token[req.req_pool_idx, :committed].to(torch.int64).clone()
        rows = layer_slots(pool, slots)  # now: the release right after this unmaps windowed slots at once
        features = self.host.features

        def backup() -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
            return gather_kv(pool, slots, rows=rows), None if features is None else features.gather_features(slots)

        req.kv_backup = self.host.forward_stream.run_in_order(backup)

    def _fence(self) -> Callable[[], bool]:
        """When slots reserved now may be written by others: after the forwards in flight."""
        if not self.host.has_results_in_flight():
            return _always  # nothing in flight (always so in the normal loop)
        return self.host.forward_stream.fence()

    def _restore(self, req: Req, slots: torch.Tensor, backup: Optional[Future]) -> None:
        if backup is None:
            return
        pool = self.memory.allocator.get_kvcache()
        assert pool is not None  # a decode server's allocator owns its KV pool
        # Same stream, later job: the backup's copy has run by then, so result() does not wait.
        rows = layer_slots(pool, slots)
        features = self.host.features

        def restore() -> None:
            kv, saved_features = backup.result()
            scatter_kv(pool, slots, kv, rows=rows)
            if features is not None and saved_features is not None:
                features.scatter_features(slots, saved_features)

        self.host.forward_stream.run_in_order(restore)

    # ------------------------------------------------------------------ aborts and state
    def abort(self, match: Callable[[Req], bool]) -> List[Req]:
        waiting, self.waiting = take_matching(self.waiting, match)
        for req in waiting:  # transferred: it holds its row and KV
            self.memory.release(req)
            req.finished_reason = req.finished_reason or FINISH_ABORT()
        return self.prealloc.abort(match) + self.transfer.abort(match) + waiting

    def requests_holding_kv(self) -> int:
        """Requests that hold decode memory outside the running batch (in transfer or waiting)."""
        return len(self.transfer.queue) + len(self.waiting)

    def is_idle(self) -> bool:
        return not (self.prealloc.queue or self.prealloc.retracted_queue or self.prealloc.held or self.transfer.queue
                    or self.waiting or self.refusals)

    def check_memory(self) -> Optional[str]:
        memory = self.memory
        return idle_leaks(memory.metadata, memory.metadata_allocator, self.manager)

    def internal_state(self) -> Dict[str, Any]:
        return {
            "mode": self.mode.value,
            "num_decode_prealloc_queue_reqs": len(self.prealloc.queue),
            "num_decode_transfer_queue_reqs": len(self.transfer.queue),
            "num_decode_retracted_queue_reqs": len(self.prealloc.retracted_queue),
            "num_decode_held_rebootstrap_reqs": len(self.prealloc.held),
            "num_decode_waiting_reqs": len(self.waiting),
            "num_late_kv_frames": self.manager.late_frames if self.manager is not None else 0,
            "metrics": self.metrics.snapshot(),
        }

    def queue_summary(self) -> str:
        return (f"#prealloc-req: {len(self.prealloc.queue)}, #transfer-req: {len(self.transfer.queue)}, "
                f"#retracted-req: {len(self.prealloc.retracted_queue)}, #held-req: {len(self.prealloc.held)}, "
                f"#waiting-req: {len(self.waiting)}")

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()


def _always() -> bool:
    return True
