"""The scheduler: continuous batching over a radix prefix cache and a paged KV pool.

One Scheduler per tensor-parallel rank. Each iteration of its loop:
    receive requests -> get_next_batch_to_run -> run_batch -> process_batch_result -> stream_output
The class is usable in-process (tests, the offline benchmark: `add_request` + `step`) and as the body
of the scheduler process (`scheduler_process.run_scheduler_process`).

The Scheduler is a sequencer of owners, each the only writer of its state (the others call its
methods):
- `KVManager` (kv_manager.py): the prefix cache, the request-to-token pool, the token allocator,
  the idle leak check;
- `WaitingQueue` (waiting_queue.py): the waiting requests, the queue limit, the waiting timeout;
  `GrammarManager` (constrained/): the requests whose grammar is compiling;
- `RunningSet` (running_set.py): the decode batch, `new_token_ratio`, retraction;
- `PrefillBuilder` (prefill.py): the chunked request and which waiting requests a prefill takes;
- `Admission` (admission.py, no state): requests in, checked, queued or refused;
- `ResultProcessor` / `OutputStreamer` (output.py): results out; `SchedulerControl` (control.py):
  weights, memory, pause; `SchedulerStats` (stats.py): log lines and counters; in PD
  disaggregation, the role (engine/disaggregation/), which owns the transfer queues.
The loop's own state is the last batch, the results in flight and the outputs of this iteration.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union


from engine.constrained.grammar_manager import server_grammar_manager
from engine.io_struct import (
    AbortReq,
    ExpertDistributionReq,
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
from engine.scheduler.admission import Admission, ModelLimits
from engine.scheduler.control import SchedulerControl
from engine.scheduler.embedding import build_embedding_output, process_embedding_result
from engine.scheduler.experts import ExpertStats
from engine.scheduler.forward_launcher import ForwardLauncher, Launched
from engine.scheduler.kv_manager import KVManager
from engine.scheduler.output import OutputStreamer, ResultProcessor
from engine.scheduler.prefill import PrefillBuilder
from engine.scheduler.running_set import RunningSet
from engine.scheduler.stats import Load, SchedulerStats
from engine.scheduler.waiting_queue import WaitingQueue
from engine.speculative.speculator import Speculator, build_speculator
from engine.speculative.step import VerifyStep

from engine.disaggregation.base import DisaggregationMode
from engine.disaggregation.host import RoleHost
from engine.disaggregation.roles import make_role

if TYPE_CHECKING:
    from engine.disaggregation.decode_scheduler import DecodeDisaggregation
    from engine.disaggregation.prefill import PrefillDisaggregation
    from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.mem_cache.memory_pool import ReqToTokenPool
    from engine.scheduler.worker_protocol import ModelWorker
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

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

            worker = self._on_forward_thread(lambda: TpModelWorker(server_args, gpu_id=gpu_id, tp_rank=tp_rank))
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
        # The KV pool's element type and bytes per token (--kv-cache-dtype), as /get_server_info reports them.
        self.kv_cache_facts: Dict[str, Any] = {k: info[k] for k in ("kv_cache_dtype", "kv_cache_bytes_per_token")
                                               if k in info}
        self.eos_token_ids = set(worker.eos_token_ids)
        self.tokenizer = tokenizer
        if self.tokenizer is not None and getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)

        # An embedding server (scheduler_embedding.py) runs prefill-only requests.
        self.is_generation: bool = info.get("is_generation", True)
        self.embedding_kv_reusable: bool = info.get("embedding_kv_reusable", False)

        # The owners (see the module docstring), each the only writer of its state.
        self.kv = KVManager(worker.req_to_token_pool, worker.token_to_kv_pool_allocator, self.max_total_num_tokens,
                            self.page_size, self.vocab_size, self.device,
                            use_radix_cache=not server_args.disable_radix_cache
                            and (self.is_generation or self.embedding_kv_reusable),
                            strict_memory_check=server_args.strict_memory_check)
        self.priority = PriorityPolicy(server_args)
        self.waiting = WaitingQueue(server_args.max_queued_requests, server_args.req_waiting_timeout, self.priority)
        self.running = RunningSet(self.kv, server_args.schedule_conservativeness)
        # Constrained decoding: the grammar queue and the compiled-grammar cache (constrained/).
        self.grammar_manager = server_grammar_manager(server_args, tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.stats = SchedulerStats(tp_rank, server_args.decode_log_interval, self._load)
        self.prefill = PrefillBuilder(server_args, self.kv, self.waiting, self.running, self.priority,
                                      self.max_running_requests, self.page_size,
                                      requeue=self._requeue, on_batch=self.stats.on_prefill_batch)
        # The loop's own state.
        self.last_batch: Optional[ScheduleBatch] = None
        self.cur_batch: Optional[ScheduleBatch] = None
        self.result_queue: Deque = deque()
        self._to_stream: List[Req] = []  # requests that may emit at the end of this iteration

        # Speculative decoding: eligible decode steps run as verify steps (engine/speculative/). Built
        # before the PD role, whose transfer carries an EAGLE head's features (a PD prefill server keeps
        # them for its decode server and never verifies).
        self.spec: Optional[Speculator] = (
            build_speculator(server_args, worker, self.kv.tree_cache, self._on_forward_thread)
            if server_args.speculative_algorithm is not None and self.is_generation else None)
        # PD disaggregation: the prefill or decode role, a collaborator that owns the transfer
        # queues (engine/disaggregation/); None in a unified server.
        if server_args.disaggregation_mode != "null" and not self.is_generation:
            raise ValueError("PD disaggregation serves generative models only; this is an embedding model")
        self.disagg: Optional[Union[PrefillDisaggregation, DecodeDisaggregation]] = (
            make_role(self._role_host(), transfer_network) if server_args.disaggregation_mode != "null" else None)
        limits = ModelLimits(self.vocab_size, self.max_req_len, self.max_req_input_len, self.max_total_num_tokens,
                             self.page_size, self.is_generation, self.embedding_kv_reusable)
        # Requests in: checks, the queue limit (admission.py).
        self.admission = Admission(server_args, limits, tokenizer, self.eos_token_ids, self.waiting, self.priority,
                                   self.grammar_manager, self.disagg, self.stream,
                                   lora_uid=worker.lora_uid if server_args.enable_lora else None)
        # A mixture-of-experts model's layout and routed-token counts (experts.py).
        self.experts = ExpertStats(worker.expert_recorder() if "moe_layout" in info else None,
                                   info.get("moe_layout", {}))
        # Weights, memory, pause/continue (control.py).
        self.control = SchedulerControl(self, worker, self.forward_stream, tp_rank,
                                        server_args.enable_pickled_weight_updates)
        handoff = (self.disagg.handoff if self.disagg is not None and self.disagg.mode == DisaggregationMode.PREFILL
                   else None)
        self.results = ResultProcessor(self.kv.tree_cache, prefill_handoff=handoff)
        self.streamer = OutputStreamer(server_args.stream_interval,
                                       speculative=server_args.speculative_algorithm is not None)
        # Where outputs go: a ZMQ socket in the server, a list in-process.
        self.outbox: List[Any] = []
        self.send_output = send_output or self.outbox.append
        self.inbox: List[Any] = []
        # Where inputs come from: the inbox in-process; run_scheduler_process puts ZMQ here.
        self.recv_requests: Callable[[], List[Any]] = self._take_inbox

        # Overlap scheduling (the default) processes each forward's result one step later; the
        # normal loop waits for it at once.
        self.enable_overlap = not server_args.disable_overlap_schedule
        self.launcher = ForwardLauncher(worker, self.forward_stream, self.is_generation, self.vocab_size, self.spec)
        self.forward_done_ct = 0  # forwards whose result was processed (the watchdog compares both)

    def _on_forward_thread(self, build: Callable[[], Any]) -> Any:
        """Build a model where the worker's was built (on the CPU: the forward thread)."""
        return build() if self.forward_stream.is_cuda else self.forward_stream.call(build)

    def _role_host(self) -> RoleHost:
        """What a PD role may use: the owners and the loop's callbacks (disaggregation/host.py)."""
        return RoleHost(
            server_args=self.server_args, tp_rank=self.tp_rank, page_size=self.page_size, vocab_size=self.vocab_size,
            total_kv_heads=self.total_kv_heads, max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests, kv=self.kv, running=self.running,
            priority=self.priority, grammar_manager=self.grammar_manager, forward_stream=self.forward_stream,
            stream=self.stream, enqueue_waiting=self.enqueue_waiting, update_running_batch=self.update_running_batch,
            flush_outputs=self.flush_outputs, write_relay=self.write_relay,
            has_results_in_flight=lambda: bool(self.result_queue),
            paused_by_retract=lambda: self.control.paused and self.control.pause_mode == "retract",
            features=self.spec.transfer_features() if self.spec is not None else None)

    # ================================================================== the owners' state, read-only
    @property
    def waiting_queue(self) -> Sequence[Req]:
        return self.waiting.reqs

    @property
    def running_batch(self) -> ScheduleBatch:
        return self.running.batch

    @property
    def chunked_req(self) -> Optional[Req]:
        return self.prefill.chunked_req

    @property
    def new_token_ratio(self) -> float:
        return self.running.new_token_ratio

    @property
    def forward_ct(self) -> int:
        return self.launcher.forward_ct

    @property
    def num_extend_tokens_computed(self) -> int:
        return self.launcher.num_extend_tokens_computed

    @property
    def tree_cache(self) -> BasePrefixCache:
        return self.kv.tree_cache

    @property
    def req_to_token_pool(self) -> ReqToTokenPool:
        return self.kv.req_to_token_pool

    @property
    def token_to_kv_pool_allocator(self) -> PagedTokenToKVPoolAllocator:
        return self.kv.token_to_kv_pool_allocator

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
                self.abort(recv)
            elif isinstance(recv, FlushCacheReqInput):
                self.send_reply(recv, self.flush_cache())
            elif isinstance(recv, GetInternalStateReq):
                self.send_reply(recv, GetInternalStateReqOutput(internal_state=self.internal_state()))
            elif isinstance(recv, ExpertDistributionReq):
                self.send_reply(recv, self.experts.handle(recv, self.settle))
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

    def abort(self, recv: AbortReq) -> None:
        """Aborts find a request wherever it is: the grammar queue, the PD queues, the waiting
        queue, the chunked prefill, the running batch (the last two at a safe point)."""
        def match(req: Req) -> bool:
            if recv.abort_all:
                return not recv.worker_only or req.http_worker == recv.http_worker
            return bool(recv.rid) and req.rid.startswith(recv.rid)

        for req in self.grammar_manager.abort_requests(match):
            # Waiting for its grammar, it holds no KV either (and was never prefilled).
            req.finished_reason = FINISH_ABORT("Abort before prefill")
            self.stream([req])
        if self.disagg is not None:
            self.stream(self.disagg.abort(match))
        for req in self.waiting.pop_matching(match):
            # Waiting requests hold no KV: answer at once (SGLang's message for a request that was
            # never prefilled; a retracted one keeps its output).
            req.finished_reason = FINISH_ABORT("Aborted" if req.output_ids else "Abort before prefill")
            self.stream([req])
        chunked = self.prefill.chunked_req
        self.prefill.abort_chunked_if(match)
        self.running.mark_to_abort(match, exclude=chunked)
        if self.last_batch is not None and self.last_batch is not self.running.batch:
            for req in self.last_batch.reqs:
                if match(req) and not req.finished() and req is not chunked:
                    req.to_finish = FINISH_ABORT()

    # ================================================================== control
    def is_fully_idle(self) -> bool:
        return (self.running.is_empty() and not len(self.waiting) and self.prefill.chunked_req is None
                and (self.last_batch is None or self.last_batch.is_empty()) and not self.result_queue
                and not len(self.grammar_manager) and (self.disagg is None or self.disagg.is_idle()))

    def flush_cache(self) -> FlushCacheReqOutput:
        if not self.is_fully_idle():
            msg = (f"Cache not flushed because there are pending requests. #queue-req: "
                   f"{len(self.waiting)}, #running-req: {self.running.size()}")
            logger.warning(msg)
            return FlushCacheReqOutput(success=False, message=msg)
        self.last_batch = None
        self.kv.reset()
        self.grammar_manager.reset()
        self.running.reset_ratio()
        logger.info("Cache flushed successfully!")
        return FlushCacheReqOutput(success=True, message="Cache flushed.")

    # ------------------------------------------------------------------ for SchedulerControl
    def settle(self) -> None:
        while self.result_queue:
            self._pop_and_process()

    def retract_all(self) -> None:
        self.merge_last_prefill_batch()
        self.last_batch = None
        victims = self.running.preempt_all()  # a PD decode server keeps their KV first
        chunked = self.prefill.take_chunked_for_retract()
        if chunked is not None:
            victims.insert(0, chunked)
        for req in victims:
            self.admission.enqueue(req, is_retracted=True)

    def _batched_reqs(self, waiting: bool = False) -> List[Req]:
        """Each request of the running batch, the last batch and the chunked prefill once (and of
        the waiting queue with `waiting`)."""
        reqs = {id(r): r for r in [*(self.waiting if waiting else ()), *self.running.reqs]}
        if self.last_batch is not None:
            reqs.update((id(r), r) for r in self.last_batch.reqs)
        chunked = self.prefill.chunked_req
        if chunked is not None:
            reqs[id(chunked)] = chunked
        return list(reqs.values())

    def live_requests(self) -> int:
        transferring = self.disagg.requests_holding_kv() if self.disagg is not None else 0  # PD: outside the batches
        return transferring + sum(1 for r in self._batched_reqs() if not r.finished() and not r.is_retracted)

    def flush_kv(self) -> None:
        assert self.live_requests() == 0, "flush_kv with requests holding KV"
        self.running.clear()
        self.last_batch = None
        self.kv.reset()
        self.running.reset_ratio()
        logger.info("Cache flushed (control request)")

    def num_waiting(self) -> int:
        return len(self.waiting)

    def requests_using_lora(self, lora_uid: str) -> int:
        # (A request still compiling its grammar is counted by the TokenizerManager, which waits for it.)
        return sum(1 for r in self._batched_reqs(waiting=True) if r.lora_id == lora_uid and not r.finished())

    # ------------------------------------------------------------------ reports
    def internal_state(self) -> Dict[str, Any]:
        return {
            **self.kv.state(),
            "num_running_reqs": self.running.size() + (1 if self.prefill.chunked_req is not None else 0),
            "num_waiting_reqs": len(self.waiting),
            "waiting_tokens": self.waiting.waiting_tokens(),
            "num_grammar_queue_reqs": len(self.grammar_manager),
            "max_running_requests": self.max_running_requests,
            "max_req_input_len": self.max_req_input_len,
            "context_len": self.context_len,
            "new_token_ratio": self.running.new_token_ratio,
            "page_size": self.page_size,
            **self.kv_cache_facts,
            "cache_hit_rate": self.stats.cache_hit_rate(),
            "gen_throughput": self.stats.last_gen_throughput,
            "forward_ct": self.forward_ct,
            "num_extend_tokens_computed": self.num_extend_tokens_computed,
            **(self.spec.state() if self.spec is not None else {}),
            **self.experts.state(),
            **({"disaggregation": self.disagg.internal_state()} if self.disagg is not None else {}),
        }

    def _load(self) -> Load:
        suffix = f", {self.disagg.queue_summary()}" if self.disagg is not None else ""
        return Load(self.kv.token_usage(), self.running.size(), len(self.waiting), suffix)

    def check_memory(self) -> None:
        """The idle leak check (KVManager.check_memory, with the PD role's buffers)."""
        self.kv.check_memory(self.disagg.check_memory() if self.disagg is not None else None)

    # ================================================================== building batches
    def get_next_batch_to_run(self) -> Optional[ScheduleBatch]:
        if self.disagg is not None and self.disagg.mode == DisaggregationMode.DECODE:
            return self.disagg.get_next_batch_to_run()  # prebuilt batches, never a prefill
        aborted = self.prefill.teardown_pending_abort()
        if aborted is not None:
            self._to_stream.append(aborted)
        self.admission.expire_waiting()
        self.admission.take_ready_grammars()
        self.prefill.cache_chunked_progress()

        self.merge_last_prefill_batch()
        new_batch = self.prefill.build()
        if new_batch is not None:
            return new_batch
        return self.update_running_batch()

    def merge_last_prefill_batch(self) -> None:
        """Freshly prefilled requests join the decode batch one iteration after their prefill."""
        last = self.last_batch
        if self.disagg is not None:
            # PD prefill: prefilled requests wait for their transfer and never decode here; the
            # transfers that ended since the last step gave rows and KV back.
            last = None
            self.running.set_full(False)
        if last is not None and last.forward_mode is not None and last.forward_mode.is_extend():
            before = last.batch_size()
            last.filter_batch(chunked_req_to_exclude=self.prefill.chunked_req)
            if last.batch_size() < before:
                # Requests finished at their prefill freed their slots: admission may resume.
                self.running.set_full(False)
            # Embedding requests end with their prefill: they never join the decode batch.
            if not last.is_empty() and self.is_generation:
                self.running.merge(last)

    def update_running_batch(self) -> Optional[ScheduleBatch]:
        """The running batch's next decode step, or None when nothing runs: retracted requests go
        back to the queue (their grammar rewound), aborted ones are answered."""
        if self.running.is_empty():
            return None
        retracted, aborted = self.running.update()
        for req in retracted:
            if req.grammar is not None and not req.grammar.sync_with(req.output_ids):
                req.set_finish_with_abort("The grammar state could not be restored after retraction.", 500,
                                          "InternalServerError")
                self._to_stream.append(req)
                continue
            self.admission.enqueue(req, is_retracted=True)
        self._to_stream.extend(aborted)
        return None if self.running.is_empty() else self.running.batch

    def _requeue(self, req: Req) -> None:
        """A request preempted for a more urgent one goes back to the queue, output kept."""
        self.admission.enqueue(req, is_retracted=True)

    # ================================================================== running
    def run_batch(self, batch: ScheduleBatch) -> Launched:
        """Run the forward now (normal loop) or launch it on the forward stream (overlap loop)."""
        return self.launcher.launch(batch, overlap=self.enable_overlap, results_in_flight=bool(self.result_queue))

    def launch_batch_sample_if_needed(self) -> None:
        """Sample the newest launched batch if its sampling waits for a mask."""
        if self.result_queue:
            self.launcher.sample_if_delayed(*self.result_queue[-1])

    def process_batch_result(self, batch: ScheduleBatch, result) -> None:
        if isinstance(result, (PendingResult, DelayedSample)):
            result = result.result()  # waits for copy_done only here
        assert batch.forward_mode is not None  # set when the batch was built
        if isinstance(result, VerifyStep):
            assert self.spec is not None  # a verify step runs only with speculation on
            emit = self.spec.process(batch, result)
            self.stats.on_tokens(batch, self.spec.emitted_tokens(result))
        elif not self.is_generation:
            emit = process_embedding_result(batch, result, self.tree_cache, self.embedding_kv_reusable)
        else:
            decode = batch.forward_mode.is_decode()
            emit = self.results.process_decode(batch, result) if decode else self.results.process_prefill(batch, result)
            self.stats.on_tokens(batch, len(emit))
        self._to_stream.extend(emit)
        self.forward_done_ct += 1
        if self.spec is not None:  # the speculation switch weighs verify steps against plain ones
            self.spec.batch_processed(batch, result if isinstance(result, VerifyStep) else None)

    def stream(self, reqs: List[Req]) -> None:
        """Emit these requests' outputs at the end of this iteration (finished ones once)."""
        self._to_stream.extend(reqs)

    def enqueue_waiting(self, req: Req) -> None:
        """PD prefill: a request whose destination is ready joins the waiting queue."""
        self.waiting.push_unbounded(req)

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
        scheduling, batch = self._begin_step()
        if not scheduling:
            return None
        if batch is not None:
            self.process_batch_result(batch, self.run_batch(batch))
        else:
            self.on_idle()
        self._end_step(batch)
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
        scheduling, batch = self._begin_step()
        if not scheduling:
            return None
        disable_overlap = self._is_disable_overlap_for_batch(batch)
        if disable_overlap:
            self._pop_and_process()
        if batch is not None:
            launched = self.run_batch(batch)
            if isinstance(launched, VerifyStep):  # ran with nothing in flight; its tokens set the next batch's lengths
                self.process_batch_result(batch, launched)
            else:
                self.result_queue.append((batch.copy(), launched))
        if not disable_overlap and len(self.result_queue) > (1 if batch is not None else 0):
            self._pop_and_process()
        self.launch_batch_sample_if_needed()
        if batch is None and not self.result_queue:
            self.on_idle()
        self._end_step(batch)
        return batch

    def _begin_step(self) -> Tuple[bool, Optional[ScheduleBatch]]:
        """Inputs, then the batch to run; (False, None) while scheduling is blocked (paused, or
        memory released: only inputs are handled, see _step_blocked)."""
        self.process_input_requests(self.recv_requests())
        if self.control.blocks_scheduling():
            self._step_blocked()
            return False, None
        if self.disagg is not None:
            self.disagg.process_queues()
        if self.result_queue and self.spec is not None and self.spec.wants_verify(
                self.running.reqs, self.last_batch, self.prefill.chunked_req):
            self.settle()  # overlap loop: the verify step drafts from the tokens in flight
        self.cur_batch = self.get_next_batch_to_run()
        return True, self.cur_batch

    def _end_step(self, batch: Optional[ScheduleBatch]) -> None:
        self.last_batch = batch
        self.cur_batch = None
        self.flush_outputs()

    def _step_blocked(self) -> None:
        """A step while paused or released: the control handler settled the forward in flight,
        so there is nothing to run; outputs (aborts, finished retractions) still go out."""
        while self.result_queue:
            self._pop_and_process()
        self.flush_outputs()

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
        if len(self.grammar_manager) and self.running.is_empty() and not len(self.waiting):
            # Only compilations are pending: wait for the first one instead of spinning.
            self.grammar_manager.wait_for_progress(GRAMMAR_IDLE_WAIT_S)
        if not self.is_fully_idle():
            return
        self.running.reset_ratio()
        self.stats.on_idle()
        self.check_memory()
