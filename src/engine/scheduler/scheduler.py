"""The scheduler: continuous batching over a radix prefix cache and a paged KV pool.

One Scheduler per tensor-parallel rank. Each iteration of its loop:
    receive requests -> get_next_batch_to_run -> run_batch -> process_batch_result -> stream_output
The class is usable in-process (tests, the offline benchmark: `add_request` + `step`) and as the body
of the scheduler process (`scheduler_process.run_scheduler_process`).

The loops, the waiting queue, the running batch and the building of batches are here; the rest is
in collaborators the Scheduler owns: `Admission` (scheduler_admission.py: requests in, aborts),
`PrefillBuilder` (scheduler_prefill.py: which waiting requests a prefill batch takes),
`ResultProcessor` and `OutputStreamer` (scheduler_output.py: results out), `SchedulerControl`
(scheduler_control.py: weights, memory, pause), `SchedulerStats` (scheduler_stats.py: logs, the
internal state, the idle memory check) and, in PD disaggregation, the role (engine/disaggregation/).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, List, Optional, Tuple, Union


from engine.constrained.grammar_manager import GrammarManager
from engine.parsers.reasoning import REASONING_FORMATS
from engine.constrained.vocab_mask import build_vocab_mask
from engine.io_struct import (
    AbortReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    Routed,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from engine.scheduler.overlap_utils import DelayedSample, ForwardStream, PendingResult
from engine.scheduler.priority import PriorityPolicy
from engine.scheduler.req import FINISH_ABORT, Req
from engine.scheduler.schedule_batch import ScheduleBatch
from engine.scheduler.admission import Admission
from engine.scheduler.control import SchedulerControl
from engine.scheduler.embedding import build_embedding_output, process_embedding_result
from engine.scheduler.output import OutputStreamer, ResultProcessor
from engine.scheduler.prefill import PrefillBuilder
from engine.scheduler.stats import SchedulerStats

from engine.disaggregation.base import DisaggregationMode
from engine.disaggregation.roles import make_role

if TYPE_CHECKING:
    from engine.constrained.base_grammar_backend import BaseGrammarBackend
    from engine.disaggregation.decode_scheduler import DecodeDisaggregation
    from engine.disaggregation.prefill import PrefillDisaggregation
    from engine.scheduler.worker_protocol import ModelWorker
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
# With only grammar compilations pending, the loop waits this long at most for one to finish
# (new requests are noticed at the next iteration).
GRAMMAR_IDLE_WAIT_S = 0.005


class Scheduler:
    def __init__(
        self,
        server_args: ServerArgs,
        worker: Optional[ModelWorker] = None,
        tokenizer: Any = None,
        gpu_id: int = 0,
        tp_rank: int = 0,
        send_output: Optional[Callable[[Any], None]] = None,
        transfer_network: Any = None,
    ) -> None:
        """`transfer_network`: the LoopbackNetwork of an in-process PD pair (tests) or None."""
        self.server_args = server_args
        self.tp_rank = tp_rank
        # Forwards run on the forward stream. On the CPU the model is built there as well: that
        # thread is the only one that runs multi-threaded torch ops (see overlap_utils).
        self.forward_stream = ForwardStream(server_args.device if worker is None
                                            else worker.get_worker_info()["device"])
        if worker is None:
            from engine.scheduler.tp_worker import TpModelWorker

            def build() -> Any:
                return TpModelWorker(server_args, gpu_id=gpu_id, tp_rank=tp_rank)

            worker = build() if self.forward_stream.is_cuda else self.forward_stream.call(build)
        self.worker = worker
        info = worker.get_worker_info()
        self.max_total_num_tokens: int = info["max_total_num_tokens"]
        self.max_running_requests: int = min(info["max_running_requests"],
                                             server_args.max_running_requests or info["max_running_requests"])
        self.max_req_len: int = info["max_req_len"]
        self.max_req_input_len: int = info["max_req_input_len"]
        self.context_len: int = info["context_len"]
        self.vocab_size: int = info["vocab_size"]
        self.page_size: int = info["page_size"]
        self.device: str = info["device"]
        self.total_kv_heads: int = info.get("total_kv_heads", 0)
        self.eos_token_ids = set(worker.eos_token_ids)
        self.tokenizer = tokenizer
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        # An embedding server (scheduler_embedding.py) runs prefill-only requests.
        self.is_generation: bool = info.get("is_generation", True)
        self.embedding_kv_reusable: bool = info.get("embedding_kv_reusable", False)

        self.req_to_token_pool = worker.req_to_token_pool
        self.token_to_kv_pool_allocator = worker.token_to_kv_pool_allocator
        self.tree_cache: BasePrefixCache
        if server_args.disable_radix_cache or (not self.is_generation and not self.embedding_kv_reusable):
            from engine.mem_cache.chunk_cache import ChunkCache

            self.tree_cache = ChunkCache(self.req_to_token_pool, self.token_to_kv_pool_allocator, self.page_size)
        else:
            from engine.mem_cache.radix_cache import RadixCache

            self.tree_cache = RadixCache(self.req_to_token_pool, self.token_to_kv_pool_allocator, self.page_size)
        self.priority = PriorityPolicy(server_args)
        # Which waiting requests join this step's prefill batch (scheduler_prefill.py).
        self.prefill = PrefillBuilder(self)

        self.waiting_queue: List[Req] = []
        self.running_batch: ScheduleBatch = self._empty_batch()
        self.last_batch: Optional[ScheduleBatch] = None
        self.cur_batch: Optional[ScheduleBatch] = None
        self.chunked_req: Optional[Req] = None
        self.pending_chunked_abort = False

        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0)
        self.min_new_token_ratio = min(self.init_new_token_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio_decay = (self.init_new_token_ratio - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_new_token_ratio

        # Constrained decoding: the grammar queue and the compiled-grammar cache (constrained/).
        self.grammar_manager = GrammarManager(self._create_grammar_backend, sync_ready_count=_tp_min_or_none(),
                                              timeout_s=server_args.grammar_timeout,
                                              think_end_ids=self._think_end_ids())
        # Weights, memory, pause/continue (scheduler_control.py).
        self.control = SchedulerControl(self)
        # Requests in: checks, the queue limit; aborts (scheduler_admission.py).
        self.admission = Admission(self)
        # Log lines, the internal state, the idle memory check (scheduler_stats.py).
        self.stats = SchedulerStats(self)
        # PD disaggregation: the prefill or decode role, a collaborator that owns the transfer
        # queues (engine/disaggregation/); None in a unified server.
        self.retraction_backup: Optional[Callable[[Req], None]] = None
        if server_args.disaggregation_mode != "null" and not self.is_generation:
            raise ValueError("PD disaggregation serves generative models only; this is an embedding model")
        self.disagg: Optional[Union[PrefillDisaggregation, DecodeDisaggregation]] = make_role(self, transfer_network)
        handoff = (self.disagg.handoff if self.disagg is not None and self.disagg.mode == DisaggregationMode.PREFILL
                   else None)
        self.results = ResultProcessor(self.tree_cache, prefill_handoff=handoff)
        self.streamer = OutputStreamer(server_args.stream_interval)
        self._to_stream: List[Req] = []  # requests that may emit at the end of this iteration
        # Where outputs go: a ZMQ socket in the server, a list in-process.
        self.outbox: List[Any] = []
        self.send_output = send_output or self.outbox.append
        self.inbox: List[Any] = []
        # Where inputs come from: the inbox in-process; run_scheduler_process puts ZMQ here.
        self.recv_requests: Callable[[], List[Any]] = self._take_inbox

        # Seconds a request may wait in the queue (<= 0: no limit), like SGLANG_REQ_WAITING_TIMEOUT.
        self.waiting_timeout = server_args.req_waiting_timeout
        # Testing aid (like SGLang's forward_sleep_time): every forward sleeps this long first.
        self.forward_sleep_s = float(os.environ.get("ENGINE_TEST_FORWARD_SLEEP_S", "0"))
        # Overlap scheduling (the default) processes each forward's result one step later; the
        # normal loop waits for it at once.
        self.enable_overlap = not server_args.disable_overlap_schedule
        self.result_queue: Deque = deque()
        self.forward_ct = 0  # forwards launched
        self.forward_done_ct = 0  # forwards whose result was processed (the watchdog compares both)
        # Prompt and output positions this rank computed in extend forwards (a PD decode server
        # computes none: its prompts arrive by transfer).
        self.num_extend_tokens_computed = 0

    def _create_grammar_backend(self) -> Tuple[Optional[BaseGrammarBackend], Optional[str]]:
        """The backend of --grammar-backend, or why constrained requests are refused (lazy: the
        first constrained request builds it, so a server without one never imports xgrammar)."""
        from engine.constrained.base_grammar_backend import create_grammar_backend

        return create_grammar_backend(
            self.server_args.grammar_backend, self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
            any_whitespace=not self.server_args.constrained_json_disable_any_whitespace)

    def _think_end_ids(self) -> Optional[List[int]]:
        """The token ids of --reasoning-parser's closing tag (None without a parser or tokenizer)."""
        name = self.server_args.reasoning_parser
        if name is None or self.tokenizer is None:
            return None
        return list(self.tokenizer.encode(REASONING_FORMATS[name].think_end, add_special_tokens=False)) or None

    def _empty_batch(self) -> ScheduleBatch:
        return ScheduleBatch.init_new([], self.req_to_token_pool, self.token_to_kv_pool_allocator,
                                      self.tree_cache, self.vocab_size, self.device)

    # ================================================================== input
    def add_request(self, recv: Any) -> None:
        """In-process submission (tests, offline benchmark)."""
        self.inbox.append(recv)

    def _take_inbox(self) -> List[Any]:
        recv, self.inbox = self.inbox, []
        return recv

    def process_input_requests(self, recv_reqs: List[Any]) -> None:
        for recv in recv_reqs:
            if isinstance(recv, TokenizedGenerateReqInput):
                self.admission.handle_generate(recv)
            elif isinstance(recv, TokenizedEmbeddingReqInput):
                self.admission.handle_embedding(recv)
            elif isinstance(recv, AbortReq):
                self.admission.abort(recv)
            elif isinstance(recv, FlushCacheReqInput):
                self.send_reply(recv, self.flush_cache())
            elif isinstance(recv, GetInternalStateReq):
                self.send_reply(recv, GetInternalStateReqOutput(internal_state=self.stats.internal_state()))
            else:
                handle = self.control.handler(recv)
                if handle is None:
                    logger.error("Scheduler got an unknown message %r", type(recv).__name__)
                else:
                    self.send_reply(recv, handle(recv))

    def send_reply(self, request: Routed, reply: Routed) -> None:
        """A control reply goes back to the HTTP worker that asked."""
        reply.http_worker = request.http_worker
        self.send_output(reply)

    # ================================================================== control
    def is_fully_idle(self) -> bool:
        return (self.running_batch.is_empty() and not self.waiting_queue and self.chunked_req is None
                and (self.last_batch is None or self.last_batch.is_empty()) and not self.result_queue
                and not len(self.grammar_manager) and (self.disagg is None or self.disagg.is_idle()))

    def flush_cache(self) -> FlushCacheReqOutput:
        if not self.is_fully_idle():
            msg = (f"Cache not flushed because there are pending requests. #queue-req: "
                   f"{len(self.waiting_queue)}, #running-req: {self.running_batch.batch_size()}")
            logger.warning(msg)
            return FlushCacheReqOutput(success=False, message=msg)
        self.last_batch = None
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()
        self.grammar_manager.reset()
        self.new_token_ratio = self.init_new_token_ratio
        logger.info("Cache flushed successfully!")
        return FlushCacheReqOutput(success=True, message="Cache flushed.")

    # ================================================================== building batches
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        if self.disagg is not None and self.disagg.mode == DisaggregationMode.DECODE:
            return self.disagg.get_next_batch_to_run()  # prebuilt batches, never a prefill
        if self.pending_chunked_abort:
            self._teardown_chunked_req()
        self.admission.expire_waiting()
        self.admission.take_ready_grammars()
        if self.chunked_req is not None:
            # Make the processed chunks tree-owned and locked; the next chunk extends them.
            self.tree_cache.cache_unfinished_req(self.chunked_req)

        self.merge_last_prefill_batch()
        new_batch = self.prefill.build()
        if new_batch is not None:
            return new_batch
        if not self.running_batch.is_empty():
            self.running_batch = self.update_running_batch(self.running_batch)
            if not self.running_batch.is_empty():
                return self.running_batch
        return None

    def merge_last_prefill_batch(self) -> None:
        """Freshly prefilled requests join the decode batch one iteration after their prefill."""
        last = self.last_batch
        if self.disagg is not None:
            # PD prefill: prefilled requests wait for their transfer and never decode here; the
            # transfers that ended since the last step gave rows and KV back.
            last = None
            self.running_batch.batch_is_full = False
        if last is not None and last.forward_mode is not None and last.forward_mode.is_extend():
            before = last.batch_size()
            last.filter_batch(chunked_req_to_exclude=self.chunked_req)
            if last.batch_size() < before:
                # Requests finished at their prefill freed their slots: admission may resume.
                self.running_batch.batch_is_full = False
            # Embedding requests end with their prefill: they never join the decode batch.
            if not last.is_empty() and self.is_generation:
                if self.running_batch.is_empty():
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)
                self.running_batch.batch_is_full = False

    def _teardown_chunked_req(self) -> None:
        self.pending_chunked_abort = False
        req = self.chunked_req
        if req is None:
            return
        self.chunked_req = None
        req.finished_reason = FINISH_ABORT()
        self.tree_cache.cache_finished_req(req, is_insert=False)
        self._to_stream.append(req)

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch:
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            batch.batch_is_full = False
            return batch
        if not batch.check_decode_mem():
            old_ratio = self.new_token_ratio
            retracted, self.new_token_ratio, aborted = batch.retract_decode(self.retraction_backup)
            logger.warning(
                "KV cache pool is full. Retract requests. #retracted_reqs: %d, #aborted_reqs: %d, "
                "#new_token_ratio: %.4f -> %.4f", len(retracted), len(aborted), old_ratio, self.new_token_ratio)
            for req in retracted:
                if req.grammar is not None and not req.grammar.sync_with(req.output_ids):
                    req.set_finish_with_abort("The grammar state could not be restored after retraction.", 500,
                                              "InternalServerError")
                    self._to_stream.append(req)
                    continue
                self.admission.enqueue(req, is_retracted=True)
            self._to_stream.extend(aborted)
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.batch_size() < initial_bs:
            batch.batch_is_full = False
        if not batch.is_empty():
            batch.prepare_for_decode()
        return batch

    # ================================================================== running
    def run_batch(self, batch: ScheduleBatch):
        """Run the forward now (normal loop) or launch it on the forward stream (overlap loop).

        A batch with constrained requests samples under its vocabulary mask, which needs every
        earlier token accepted by the matchers. When an earlier result is still unprocessed
        (overlap), the forward is launched at once and its sampling is delayed: the loop calls
        `launch_batch_sample_if_needed` after processing that result.
        """
        self.forward_ct += 1
        assert batch.forward_mode is not None  # the batches to run are prepared (prepare_for_*)
        if batch.forward_mode.is_extend():
            self.num_extend_tokens_computed += batch.extend_num_tokens
        worker_batch = batch.get_model_worker_batch()
        sleep_s = self.forward_sleep_s
        delay_sample = False
        if any(req.grammar is not None for req in batch.reqs):
            if self.enable_overlap and self.result_queue:
                delay_sample = True
            else:
                assert worker_batch.sampling_info is not None  # a generation batch always has one
                worker_batch.sampling_info.vocab_mask = build_vocab_mask(batch.reqs, self.vocab_size)

        def forward():
            if sleep_s > 0:  # the testing aid: a slow (or hung) forward, on the forward thread
                time.sleep(sleep_s)
            if not self.is_generation:
                return self.worker.forward_batch_embedding(worker_batch)
            if delay_sample:
                return self.worker.forward_batch_generation(worker_batch, delay_sample=True)
            return self.worker.forward_batch_generation(worker_batch)

        # The pending result keeps worker_batch's tensors alive until it is processed (the CUDA
        # caching allocator must not hand them out while the forward still reads them).
        pending = self.forward_stream.launch(forward, inputs=worker_batch)
        if delay_sample:
            return DelayedSample(pending, self.worker.sample_delayed, self.forward_stream)
        return pending if self.enable_overlap else pending.result()

    def launch_batch_sample_if_needed(self) -> None:
        """Sample the newest launched batch if its sampling waits for a mask: every older result
        has been processed by now, so its matchers are current."""
        if not self.result_queue:
            return
        batch, result = self.result_queue[-1]
        if isinstance(result, DelayedSample) and result.sampled is None:
            result.launch_sample(build_vocab_mask(batch.reqs, self.vocab_size))

    def process_batch_result(self, batch: ScheduleBatch, result) -> None:
        if isinstance(result, (PendingResult, DelayedSample)):
            result = result.result()  # waits for copy_done only here
        assert batch.forward_mode is not None  # set when the batch was built
        if not self.is_generation:
            emit = process_embedding_result(batch, result, self.tree_cache, self.embedding_kv_reusable)
        else:
            decode = batch.forward_mode.is_decode()
            emit = self.results.process_decode(batch, result) if decode else self.results.process_prefill(batch, result)
            self.stats.on_tokens(batch, len(emit))
        self._to_stream.extend(emit)
        self.forward_done_ct += 1

    def stream(self, reqs: List[Req]) -> None:
        """Emit these requests' outputs at the end of this iteration (finished ones once)."""
        self._to_stream.extend(reqs)

    def enqueue_waiting(self, req: Req) -> None:
        """PD prefill: a request whose destination is ready joins the waiting queue."""
        req.queue_time = time.monotonic()
        self.waiting_queue.append(req)

    def write_relay(self, rows: Any, tokens: Any) -> None:
        """Seed the overlap relay with these rows' last tokens, after the forwards in flight (one of
        them may still write a row that just changed hands)."""
        buf = self.worker.output_tokens_buf
        rows, tokens = rows.to(buf.device), tokens.to(buf.device)

        def write() -> None:
            buf[rows] = tokens

        self.forward_stream.run_in_order(write)

    def flush_outputs(self) -> None:
        """One message per iteration to the detokenizer."""
        reqs, self._to_stream = self._to_stream, []
        if not self.is_generation:  # every request of an embedding server is an embedding one
            embedding_out = build_embedding_output(reqs)
            if embedding_out is not None:
                self.send_output(embedding_out)
            return
        out = self.streamer.build(reqs)
        if out is not None:
            self.send_output(out)

    # ================================================================== loop
    def step(self) -> Optional[ScheduleBatch]:
        """One iteration of the normal (non-overlap) loop."""
        self.process_input_requests(self.recv_requests())
        if self.control.blocks_scheduling():  # paused, or memory released: only inputs are handled
            self._step_blocked()
            return None
        if self.disagg is not None:
            self.disagg.process_queues()
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        if batch is not None:
            result = self.run_batch(batch)
            self.process_batch_result(batch, result)
        else:
            self.on_idle()
        self.last_batch = batch
        self.cur_batch = None
        self.flush_outputs()
        return batch

    def step_overlap(self) -> Optional[ScheduleBatch]:
        """One iteration of the overlap loop: schedule and launch step N+1, then process step N.

        A request that finished in step N is still part of step N+1 (its result is ignored, its
        KV, including the slot allocated for that extra step, was released when step N was
        processed). With --disable-consecutive-prefill-overlap (SGLang's
        SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP, off by default) a prefill that follows a
        prefill waits for the first one's result to be processed before it is launched, so the
        first one's tokens go out without waiting behind the second forward; it was scheduled
        before that, as every overlapped batch is.
        """
        self.process_input_requests(self.recv_requests())
        if self.control.blocks_scheduling():
            self._step_blocked()
            return None
        if self.disagg is not None:
            self.disagg.process_queues()
        batch = self.get_next_batch_to_run()
        self.cur_batch = batch
        disable_overlap = self._is_disable_overlap_for_batch(batch)
        if disable_overlap:
            self._pop_and_process()
        if batch is not None:
            self.result_queue.append((batch.copy(), self.run_batch(batch)))
        if not disable_overlap and len(self.result_queue) > (1 if batch is not None else 0):
            self._pop_and_process()
        self.launch_batch_sample_if_needed()
        if batch is None and not self.result_queue:
            self.on_idle()
        self.last_batch = batch
        self.cur_batch = None
        self.flush_outputs()
        return batch

    def _step_blocked(self) -> None:
        """A step while paused or released: the control handler settled the forward in flight,
        so there is nothing to run; outputs (aborts, finished retractions) still go out."""
        while self.result_queue:
            self._pop_and_process()
        self.flush_outputs()
        return None

    def _is_disable_overlap_for_batch(self, batch: Optional[ScheduleBatch]) -> bool:
        last = self.last_batch
        return (self.server_args.disable_consecutive_prefill_overlap
                and batch is not None and batch.forward_mode is not None and batch.forward_mode.is_extend()
                and last is not None and last.forward_mode is not None and last.forward_mode.is_extend())

    def _pop_and_process(self) -> None:
        if self.result_queue:
            batch, result = self.result_queue.popleft()
            self.process_batch_result(batch, result)

    def has_work(self) -> bool:
        if self.control.blocks_scheduling():
            # Requests wait without being scheduled: only new input (continue, resume) is work.
            return bool(self.inbox) or bool(self._to_stream) or bool(self.result_queue)
        return (bool(self.inbox) or not self.is_fully_idle() or bool(self._to_stream)
                or bool(self.result_queue))

    def event_loop(self, wait_for_input: Callable[[], None]) -> None:
        step = self.step_overlap if self.enable_overlap else self.step
        while True:
            if not self.has_work():
                wait_for_input()
            step()

    def shutdown(self) -> None:
        """Stop the forward thread (in-process use; the scheduler process just exits)."""
        if self.disagg is not None:
            self.disagg.close()
        self.forward_stream.shutdown()
        self.grammar_manager.shutdown()

    def on_idle(self) -> None:
        if len(self.grammar_manager) and self.running_batch.is_empty() and not self.waiting_queue:
            # Only compilations are pending: wait for the first one instead of spinning.
            self.grammar_manager.wait_for_progress(GRAMMAR_IDLE_WAIT_S)
        if not self.is_fully_idle():
            return
        self.new_token_ratio = self.init_new_token_ratio
        self.stats.last_gen_throughput = 0.0
        self.stats.check_memory()

def _tp_min_or_none() -> Optional[Callable[[int], int]]:
    """With TP > 1, the collective that makes every rank take the same number of ready grammars."""
    from engine.distributed.parallel_state import all_reduce_min_int, get_tp_size

    return all_reduce_min_int if get_tp_size() > 1 else None
