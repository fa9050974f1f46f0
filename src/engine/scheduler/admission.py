"""The scheduler's way in and the way out before a request finishes: admission and aborts.

A tokenized request becomes a Req here; it is checked (sampling parameters, the input, stop strings
and custom logit processors, the PD role, the priority policy, its grammar), its max_new_tokens is
clamped to what the context and the KV pool allow, and it joins the waiting queue under the queue
limit (or the PD transfer queues, or the grammar queue, from which it joins once its grammar is
compiled). A request that waits longer than --req-waiting-timeout is refused. A refusal is answered
at once, with the HTTP status the API gives it; nothing refused ever holds KV. Aborts find a request wherever it is:
the grammar queue, the PD queues, the waiting queue, the chunked prefill, the running batch.
One collaborator of the Scheduler (as SchedulerControl), not a mixin.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Optional

from engine.errors import NOT_A_GENERATION_MODEL, NOT_AN_EMBEDDING_MODEL
from engine.io_struct import AbortReq, TokenizedEmbeddingReqInput, TokenizedGenerateReqInput
from engine.scheduler.priority import EVICTED_MESSAGE
from engine.scheduler.req import FINISH_ABORT, Req, cache_namespace
from engine.scheduler.embedding import make_embedding_req, validate_embedding_input
from engine.sampling.custom_logit_processor import CustomLogitProcessorError, load_custom_logit_processor
from engine.sampling.stop_regex import StopRegexCompiler

from engine.disaggregation.base import DisaggregationMode

if TYPE_CHECKING:
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class Admission:
    def __init__(self, scheduler: "Scheduler") -> None:
        self.s = scheduler
        # The n samples of a request arrive one after another: they share one stop_regex compilation.
        self.stop_regex_compiler = StopRegexCompiler()

    def handle_generate(self, recv: TokenizedGenerateReqInput) -> None:
        from engine.sampling.sampling_params import SamplingParams

        s = self.s
        req = Req(
            rid=recv.rid,
            origin_input_ids=recv.input_ids,
            sampling_params=None,  # type: ignore[arg-type]
            origin_input_text=recv.input_text,
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len if recv.return_logprob else -1,
            top_logprobs_num=recv.top_logprobs_num if recv.return_logprob else 0,
            stream=recv.stream,
            eos_token_ids=s.eos_token_ids,
            vocab_size=s.vocab_size,
            priority=recv.priority,
            extra_key=cache_namespace(recv.extra_key, recv.cache_salt),
            return_hidden_states=recv.return_hidden_states,
            token_ids_logprob=recv.token_ids_logprob if recv.return_logprob else None,
            custom_logit_processor=recv.custom_logit_processor,
            require_reasoning=recv.require_reasoning,
            routing_key=recv.routing_key,
        )
        req.tokenizer = s.tokenizer
        req.http_worker = recv.http_worker
        req.bootstrap_host, req.bootstrap_port, req.bootstrap_room = (
            recv.bootstrap_host, recv.bootstrap_port, recv.bootstrap_room)
        if req.bootstrap_port is None and s.disagg is not None:
            # As SGLang's scheduler: sglang-router sends a null port for a --prefill URL given without
            # one, meaning the default; both sides then take this server's --disaggregation-bootstrap-port.
            req.bootstrap_port = s.server_args.disaggregation_bootstrap_port
        try:
            sp = SamplingParams.from_dict(recv.sampling_params)
            sp.verify(s.vocab_size, self.stop_regex_compiler.compile)
            sp.normalize(s.tokenizer)
        except (ValueError, TypeError) as e:
            req.sampling_params = SamplingParams()
            return self.refuse(req, str(e), 400)
        req.sampling_params = sp
        if not s.is_generation:
            return self.refuse(req, NOT_A_GENERATION_MODEL, 400)
        error = self.validate_input(req) or self.validate_extras(req)
        if error is not None:
            return self.refuse(req, error, 400)
        self.clamp_max_new_tokens(req)
        if s.disagg is not None:
            error = s.disagg.validate(req)
            if error is not None:
                return self.refuse(req, error, 400)
        refused = s.priority.assign(req)
        if refused is not None:
            return self.refuse(req, refused, 503)
        if s.disagg is not None and s.disagg.mode == DisaggregationMode.DECODE:
            # As SGLang: the decode side compiles the grammar while the KV transfers; the transfer
            # queue holds the request until both are done, then the handed-over token is accepted.
            pending, error = s.grammar_manager.start(req)
            if error is not None:
                return self.refuse(req, error, 400)
            req.queue_time = time.monotonic()
            s.disagg.add_request(req, grammar=pending)
            return
        queued, error = s.grammar_manager.process_req_with_grammar(req)
        if error is not None:
            return self.refuse(req, error, 400)
        if not queued:
            self.enqueue(req)

    def handle_embedding(self, recv: TokenizedEmbeddingReqInput) -> None:
        s = self.s
        req = make_embedding_req(recv, s.vocab_size, s.embedding_kv_reusable)
        if s.is_generation:
            return self.refuse(req, NOT_AN_EMBEDDING_MODEL, 400)
        error = validate_embedding_input(req, s.max_req_input_len, s.vocab_size)
        if error is not None:
            return self.refuse(req, error, 400)
        self.enqueue(req)

    def validate_input(self, req: Req) -> Optional[str]:
        s = self.s
        ids = req.origin_input_ids
        n = len(ids)
        if n == 0:
            return "The input is empty; give at least one token."
        if n > s.max_req_input_len and s.server_args.allow_auto_truncate:
            # SGLang's --allow-auto-truncate keeps the first max_req_input_len tokens.
            logger.warning("Request %s: input of %d tokens truncated to %d (--allow-auto-truncate)",
                           req.rid, n, s.max_req_input_len)
            req.origin_input_ids = ids = ids[: s.max_req_input_len]
            n = len(ids)
        elif n >= s.max_req_input_len and not s.server_args.allow_auto_truncate:
            return (f"Input length ({n} tokens) exceeds the maximum allowed length "
                    f"({s.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
        if min(ids) < 0 or max(ids) >= s.vocab_size:
            return f"Input token ids must be in [0, {s.vocab_size}); got an id out of range."
        if req.return_logprob and req.logprob_start_len > n:
            return f"logprob_start_len ({req.logprob_start_len}) must not exceed the input length ({n})."
        return None

    def validate_extras(self, req: Req) -> Optional[str]:
        sp = req.sampling_params
        if (sp.stop_strs or sp.stop_regex_strs) and self.s.tokenizer is None:
            return "stop strings and stop_regex need a tokenizer; this scheduler has none"
        if req.custom_logit_processor is not None:
            if not self.s.server_args.enable_custom_logit_processor:
                return ("The server is not configured to enable custom logit processor. Please set "
                        "`--enable-custom-logit-processor` to enable this feature.")
            try:
                load_custom_logit_processor(req.custom_logit_processor)
            except CustomLogitProcessorError as e:
                return str(e)
        return None

    def clamp_max_new_tokens(self, req: Req) -> None:
        s = self.s
        n = len(req.origin_input_ids)
        page = s.page_size
        requested = req.sampling_params.max_new_tokens
        cap = min(s.max_req_len - n - 1,
                  s.max_total_num_tokens - (-(-n // page) * page) - page - 1)
        req.sampling_params.max_new_tokens = max(0, min(requested if requested is not None else 1 << 30, cap))
        req.sampling_params.min_new_tokens = min(req.sampling_params.min_new_tokens,
                                                 req.sampling_params.max_new_tokens)

    def refuse(self, req: Req, message: str, status_code: int) -> None:
        """Finish `req` (holding no KV) with this error; it goes out at the end of the iteration."""
        logger.info("Abort request %s: %s", req.rid, message)
        req.set_finish_with_abort(message, status_code, "BadRequestError" if status_code == 400 else "ServiceUnavailableError")
        self.s.stream([req])

    def enqueue(self, req: Req, is_retracted: bool = False) -> None:
        """Into the waiting queue (or, in PD, the transfer queues) under --max-queued-requests."""
        s = self.s
        if s.disagg is not None and (s.disagg.mode == DisaggregationMode.DECODE or not is_retracted):
            # PD: new requests start with their transfer; decode-side retractions wait there too.
            req.queue_time = time.monotonic()
            s.disagg.add_request(req, is_retracted)
            return
        # The queue limit is backpressure on new arrivals (which count the retracted requests).
        # A retracted request is never refused: it was admitted and may have streamed output
        # (SGLang aborts it with 503 here; docs/architecture.md).
        limit = s.server_args.max_queued_requests
        req.queue_time = time.monotonic()
        if not is_retracted and limit is not None and len(s.waiting_queue) >= limit:
            if not s.priority.enabled:
                return self.refuse(req, "The request queue is full.", 503)
            # With priority scheduling the least urgent waiting request (the newest among equals)
            # makes room for a strictly more urgent newcomer; otherwise the newcomer is refused.
            worst = s.priority.least_urgent_index(s.waiting_queue)
            if not s.priority.beats(req, s.waiting_queue[worst]):
                return self.refuse(req, "The request queue is full.", 503)
            self.refuse(s.waiting_queue.pop(worst), EVICTED_MESSAGE, 503)
        s.waiting_queue.append(req)

    def take_ready_grammars(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue (or are refused)."""
        ready, refused = self.s.grammar_manager.get_ready_grammar_requests()
        for req in ready:
            self.enqueue(req)
        for req, error in refused:
            self.refuse(req, error, 400)

    def expire_waiting(self) -> None:
        """Refuse the requests that waited in the queue longer than --req-waiting-timeout (if set)."""
        s = self.s
        if s.waiting_timeout <= 0:
            return
        deadline = time.monotonic() - s.waiting_timeout
        expired = [r for r in s.waiting_queue if r.queue_time < deadline]
        if not expired:
            return
        s.waiting_queue = [r for r in s.waiting_queue if r.queue_time >= deadline]
        for req in expired:
            self.refuse(req, "Request waiting timeout reached.", 503)

    def abort(self, recv: AbortReq) -> None:
        s = self.s

        def match(req: Req) -> bool:
            if recv.abort_all:
                return not recv.worker_only or req.http_worker == recv.http_worker
            return bool(recv.rid) and req.rid.startswith(recv.rid)

        for req in s.grammar_manager.abort_requests(match):
            # Waiting for its grammar, it holds no KV either (and was never prefilled).
            req.finished_reason = FINISH_ABORT("Abort before prefill")
            s.stream([req])
        if s.disagg is not None:
            s.stream(s.disagg.abort(match))
        kept = []
        for req in s.waiting_queue:
            if match(req):
                # Waiting requests hold no KV: answer at once (SGLang's message for a request
                # that was never prefilled; a retracted one keeps its output).
                req.finished_reason = FINISH_ABORT("Aborted" if req.output_ids else "Abort before prefill")
                s.stream([req])
            else:
                kept.append(req)
        s.waiting_queue = kept
        if s.chunked_req is not None and match(s.chunked_req):
            # Tearing down a chunked request mid-iteration is unsafe: do it at the next scheduling step.
            s.pending_chunked_abort = True
        running = list(s.running_batch.reqs)
        if s.last_batch is not None and s.last_batch is not s.running_batch:
            running += s.last_batch.reqs
        for req in running:
            if match(req) and not req.finished() and req is not s.chunked_req:
                req.to_finish = FINISH_ABORT()
