"""The scheduler's way in and the way out before a request finishes: admission and aborts.

A tokenized request becomes a Req here; it is checked (sampling parameters, the input, stop strings
and custom logit processors, the PD role, the priority policy, its grammar), its max_new_tokens is
clamped to what the context and the KV pool allow, and it joins the waiting queue under the queue
limit (or the PD transfer queues, or the grammar queue, from which it joins once its grammar is
compiled). A request that waits longer than --req-waiting-timeout is refused. A refusal is answered
at once, with the HTTP status the API gives it; nothing refused ever holds KV.
Admission writes no state of its own: it queues through the waiting queue's, the grammar manager's
and the PD role's methods.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Set, Union

from engine.errors import NOT_A_GENERATION_MODEL, NOT_AN_EMBEDDING_MODEL
from engine.io_struct import TokenizedEmbeddingReqInput, TokenizedGenerateReqInput
from engine.scheduler.priority import PriorityPolicy
from engine.scheduler.req import Req
from engine.scheduler.embedding import make_embedding_req, validate_embedding_input
from engine.scheduler.waiting_queue import TIMEOUT_MESSAGE, WaitingQueue
from engine.sampling.custom_logit_processor import CustomLogitProcessorError, load_custom_logit_processor
from engine.sampling.stop_regex import StopRegexCompiler

from engine.disaggregation.base import DisaggregationMode

if TYPE_CHECKING:
    from engine.constrained.grammar_manager import GrammarManager
    from engine.disaggregation.decode_scheduler import DecodeDisaggregation
    from engine.disaggregation.prefill import PrefillDisaggregation
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What the worker reported: the bounds every request is checked and clamped against."""

    vocab_size: int
    max_req_len: int
    max_req_input_len: int
    max_total_num_tokens: int
    page_size: int
    is_generation: bool
    embedding_kv_reusable: bool


class Admission:
    def __init__(self, server_args: ServerArgs, limits: ModelLimits, tokenizer: Any, eos_token_ids: Set[int],
                 waiting: WaitingQueue, priority: PriorityPolicy, grammar_manager: GrammarManager,
                 disagg: Optional[Union[PrefillDisaggregation, DecodeDisaggregation]],
                 stream: Callable[[List[Req]], None],
                 lora_uid: Optional[Callable[[str], Optional[str]]] = None) -> None:
        self.server_args = server_args
        # With --enable-lora: the uid a loaded adapter is served under (None: not loaded).
        self.lora_uid = lora_uid
        self.limits = limits
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.waiting = waiting
        self.priority = priority
        self.grammar_manager = grammar_manager
        self.disagg = disagg
        self.stream = stream  # a finished (refused) request goes out at the end of the iteration
        # The n samples of a request arrive one after another: they share one stop_regex compilation.
        self.stop_regex_compiler = StopRegexCompiler()

    def handle_generate(self, recv: TokenizedGenerateReqInput) -> None:
        from engine.sampling.sampling_params import SamplingParams

        req = Req(
            rid=recv.rid,
            origin_input_ids=recv.input_ids,
            sampling_params=None,  # type: ignore[arg-type]
            origin_input_text=recv.input_text,
            stream=recv.stream,
            eos_token_ids=self.eos_token_ids,
            vocab_size=self.limits.vocab_size,
            options=recv.options,
        )
        req.tokenizer = self.tokenizer
        req.http_worker = recv.http_worker
        if req.bootstrap_port is None and self.disagg is not None:
            # As SGLang's scheduler: sglang-router sends a null port for a --prefill URL given without
            # one, meaning the default; both sides then take this server's --disaggregation-bootstrap-port.
            req.bootstrap_port = self.server_args.disaggregation_bootstrap_port
        try:
            sp = SamplingParams.from_dict(recv.sampling_params)
            sp.verify(self.limits.vocab_size, self.stop_regex_compiler.compile)
            sp.normalize(self.tokenizer)
        except (ValueError, TypeError) as e:
            req.sampling_params = SamplingParams()
            return self.refuse(req, str(e), 400)
        req.sampling_params = sp
        if not self.limits.is_generation:
            return self.refuse(req, NOT_A_GENERATION_MODEL, 400)
        error = self.validate_input(req) or self.validate_extras(req)
        if error is not None:
            return self.refuse(req, error, 400)
        self.clamp_max_new_tokens(req)
        if self.disagg is not None:
            error = self.disagg.validate(req)
            if error is not None:
                return self.refuse(req, error, 400)
        refused = self.priority.assign(req)
        if refused is not None:
            return self.refuse(req, refused, 503)
        if self.disagg is not None and self.disagg.mode == DisaggregationMode.DECODE:
            # As SGLang: the decode side compiles the grammar while the KV transfers; the transfer
            # queue holds the request until both are done, then the handed-over token is accepted.
            pending, error = self.grammar_manager.start(req)
            if error is not None:
                return self.refuse(req, error, 400)
            req.queue_time = time.monotonic()
            self.disagg.add_request(req, grammar=pending)
            return
        queued, error = self.grammar_manager.process_req_with_grammar(req)
        if error is not None:
            return self.refuse(req, error, 400)
        if not queued:
            self.enqueue(req)

    def handle_embedding(self, recv: TokenizedEmbeddingReqInput) -> None:
        req = make_embedding_req(recv, self.limits.vocab_size, self.limits.embedding_kv_reusable)
        if self.limits.is_generation:
            return self.refuse(req, NOT_AN_EMBEDDING_MODEL, 400)
        error = validate_embedding_input(req, self.limits.max_req_input_len, self.limits.vocab_size)
        if error is not None:
            return self.refuse(req, error, 400)
        self.enqueue(req)

    def validate_input(self, req: Req) -> Optional[str]:
        ids = req.origin_input_ids
        n = len(ids)
        if n == 0:
            return "The input is empty; give at least one token."
        if n > self.limits.max_req_input_len and self.server_args.allow_auto_truncate:
            # SGLang's --allow-auto-truncate keeps the first max_req_input_len tokens.
            logger.warning("Request %s: input of %d tokens truncated to %d (--allow-auto-truncate)",
                           req.rid, n, self.limits.max_req_input_len)
            req.origin_input_ids = ids = ids[: self.limits.max_req_input_len]
            n = len(ids)
        elif n >= self.limits.max_req_input_len and not self.server_args.allow_auto_truncate:
            return (f"Input length ({n} tokens) exceeds the maximum allowed length "
                    f"({self.limits.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
        if min(ids) < 0 or max(ids) >= self.limits.vocab_size:
            return f"Input token ids must be in [0, {self.limits.vocab_size}); got an id out of range."
        if req.return_logprob and req.logprob_start_len > n:
            return f"logprob_start_len ({req.logprob_start_len}) must not exceed the input length ({n})."
        return None

    def validate_extras(self, req: Req) -> Optional[str]:
        sp = req.sampling_params
        if (sp.stop_strs or sp.stop_regex_strs) and self.tokenizer is None:
            return "stop strings and stop_regex need a tokenizer; this scheduler has none"
        if req.custom_logit_processor is not None:
            if not self.server_args.enable_custom_logit_processor:
                return ("The server is not configured to enable custom logit processor. Please set "
                        "`--enable-custom-logit-processor` to enable this feature.")
            try:
                load_custom_logit_processor(req.custom_logit_processor)
            except CustomLogitProcessorError as e:
                return str(e)
        name = req.options.lora_path
        if name is not None:
            # The TokenizerManager checked the name; an unload between there and here is caught here.
            uid = self.lora_uid(name) if self.lora_uid is not None else None
            if self.lora_uid is None:
                return "LoRA is not enabled on this server (start it with --enable-lora or --lora-paths)."
            if uid is None:
                return f"LoRA adapter {name!r} is not loaded."
            req.use_lora(uid)
        return None

    def clamp_max_new_tokens(self, req: Req) -> None:
        n = len(req.origin_input_ids)
        page = self.limits.page_size
        requested = req.sampling_params.max_new_tokens
        cap = min(self.limits.max_req_len - n - 1,
                  self.limits.max_total_num_tokens - (-(-n // page) * page) - page - 1)
        req.sampling_params.max_new_tokens = max(0, min(requested if requested is not None else 1 << 30, cap))
        req.sampling_params.min_new_tokens = min(req.sampling_params.min_new_tokens,
                                                 req.sampling_params.max_new_tokens)

    def refuse(self, req: Req, message: str, status_code: int) -> None:
        """Finish `req` (holding no KV) with this error; it goes out at the end of the iteration."""
        logger.info("Abort request %s: %s", req.rid, message)
        req.set_finish_with_abort(message, status_code, "BadRequestError" if status_code == 400 else "ServiceUnavailableError")
        if self.disagg is not None:
            self.disagg.on_refused(req, message)  # PD: the other server's half ends now too
        self.stream([req])

    def enqueue(self, req: Req, is_retracted: bool = False) -> None:
        """Into the waiting queue (or, in PD, the transfer queues) under --max-queued-requests."""
        if self.disagg is not None and (self.disagg.mode == DisaggregationMode.DECODE or not is_retracted):
            # PD: new requests start with their transfer; decode-side retractions wait there too.
            req.queue_time = time.monotonic()
            self.disagg.add_request(req, is_retracted)
            return
        refused = self.waiting.push(req, is_retracted)
        if refused is not None:
            self.refuse(refused[0], refused[1], 503)

    def take_ready_grammars(self) -> None:
        """Requests whose grammar finished compiling join the waiting queue (or are refused)."""
        ready, refused = self.grammar_manager.get_ready_grammar_requests()
        for req in ready:
            self.enqueue(req)
        for req, error in refused:
            self.refuse(req, error, 400)

    def expire_waiting(self) -> None:
        """Refuse the requests that waited in the queue longer than --req-waiting-timeout (if set)."""
        for req in self.waiting.pop_expired():
            self.refuse(req, TIMEOUT_MESSAGE, 503)
