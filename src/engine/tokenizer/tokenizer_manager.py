"""TokenizerManager: the main process's half of the runtime (asyncio).

It validates and tokenizes requests, sends them to scheduler rank 0, and yields SGLang-shaped
outputs as the detokenizer's BatchStrOutput messages arrive. One background task receives from
the tokenizer socket and dispatches: text deltas go to the per-request state (an asyncio.Event
plus the accumulated output), control replies (flush_cache, get_internal_state) to their
waiters in FIFO order.

Collaborators: `RequestNormalizer` (request_normalizer.py: validation and tokenization),
`OutputAssembler` (output_assembly.py: folding detokenizer output into request state),
`ControlCalls` (control_calls.py: flush_cache, get_internal_state, health_generate, and the
control plane: weights, memory, pause/continue, with the gate every request passes) and, for
embedding models, `EmbeddingNormalizer` (embedding_requests.py: `encode_request`'s inputs and
the BatchEmbeddingOutput the scheduler sends straight here).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional, Sequence, Union

import zmq
import zmq.asyncio

from engine.tokenizer.control_calls import HEALTH_CHECK_RID_PREFIX, ControlCalls
from engine.tokenizer.embedding_requests import (
    EmbeddingModelInfo,
    EmbeddingNormalizer,
    EmbeddingReqInput,
    EmbeddingResult,
    apply_embedding_output,
    embedding_result,
)
from engine.errors import (
    CLIENT_CLOSED_REQUEST,
    NOT_A_GENERATION_MODEL,
    NOT_AN_EMBEDDING_MODEL,
    EngineRequestError,
)
from engine.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    FlushCacheReqOutput,
    Message,
    Routed,
    TokenizedGenerateReqInput,
    decode,
    encode,
)
from engine.tokenizer.metrics import RequestTimer, TokenizerMetricsCollector, checked_custom_labels
from engine.tokenizer.output_assembly import OutputAssembler, ReqState, build_output
from engine.tokenizer.request_normalizer import GenerateReqInput, RequestNormalizer, load_chat_template
from engine.tokenizer.liveness import SHUTDOWN_MESSAGE, Liveness
from engine.tokenizer.lora_registry import LoRARegistry
from engine.tokenizer.tokenization import Tokenization
from engine.tokenizer.tokenizer_manager_protocol import GenerateOutputs
from engine.port_args import PortArgs
from engine.server_args import ServerArgs
from engine.utils.async_streams import gather_last, merge_indexed
from engine.utils.tokenizer_utils import load_tokenizer
from engine.utils.zmq_utils import get_zmq_socket

if TYPE_CHECKING:
    from engine.disaggregation.bootstrap import BootstrapServer

logger = logging.getLogger(__name__)

# How often a waiting request checks whether its HTTP client went away.
DISCONNECT_POLL_INTERVAL_S = 1.0
# How long a send may wait for the scheduler's socket to accept a message before giving up.
SEND_TIMEOUT_S = 5.0



class TokenizerManager:
    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        scheduler_info: dict,
        child_processes: Sequence[Any] = (),
        tokenizer: Any = None,
        worker_id: int = 0,
    ) -> None:
        """`scheduler_info` is the "ready" message of scheduler rank 0 (context_len, vocab_size, ...).

        `worker_id`: this HTTP worker's index (--tokenizer-worker-num); its sockets are its own.
        """
        self.server_args = server_args
        self.worker_id = worker_id
        self.port_args = port_args
        self.model_path = server_args.model_path
        self.tokenizer_path = server_args.tokenizer_path or server_args.model_path
        assert server_args.served_model_name is not None  # ServerArgs.resolve_defaults fills it in
        self.served_model_name: str = server_args.served_model_name
        self.context_len: int = int(scheduler_info["context_len"])
        self.max_req_input_len: int = int(scheduler_info.get("max_req_input_len", self.context_len - 1))
        self.max_total_num_tokens: Optional[int] = scheduler_info.get("max_total_num_tokens")
        self.vocab_size: Optional[int] = scheduler_info.get("vocab_size")
        self.liveness = Liveness(child_processes)

        if tokenizer is None and not server_args.skip_tokenizer_init:
            assert self.tokenizer_path is not None  # the launcher resolved the model path (resolve_model_path)
            tokenizer = load_tokenizer(self.tokenizer_path, server_args.trust_remote_code)
        # An embedding model serves encode_request only (embedding_requests.py).
        self.embedding_model = EmbeddingModelInfo.from_scheduler_info(scheduler_info, self.served_model_name)
        self.is_generation = self.embedding_model.is_generation
        # Requests in: normalisation, tokenization and chat templates, on a thread of their own.
        self.tokenization = Tokenization(
            tokenizer,
            RequestNormalizer(tokenizer, self.vocab_size, self.context_len, max_req_input_len=self.max_req_input_len,
                              allow_auto_truncate=server_args.allow_auto_truncate,
                              enable_custom_logit_processor=server_args.enable_custom_logit_processor,
                              dp_size=max(1, server_args.dp_size)),
            EmbeddingNormalizer(tokenizer, self.embedding_model, server_args.allow_auto_truncate),
            load_chat_template(server_args.chat_template), self.context_len, server_args.allow_auto_truncate)
        # Outputs back: per-request state from the detokenizer's messages (output_assembly.py).
        self.output_assembler = OutputAssembler(tokenizer)

        # The PULL socket is asyncio-aware (the receive loop awaits it); the PUSH socket is a
        # plain one so that abort_request can stay a synchronous call.
        self._async_context = zmq.asyncio.Context()
        self._sync_context = zmq.Context()
        self.recv_from_detokenizer = get_zmq_socket(
            self._async_context, zmq.PULL, port_args.tokenizer_ipc_names()[worker_id], bind=True)
        self.send_to_scheduler = get_zmq_socket(
            self._sync_context, zmq.PUSH, port_args.scheduler_input_ipc_names()[worker_id], bind=True)

        self.rid_to_state: dict[str, ReqState] = {}
        self.control = ControlCalls(self, fan_out=max(1, server_args.dp_size))
        # With --enable-lora: the adapters requests may name, and their requests in flight.
        self.lora_registry: Optional[LoRARegistry] = (LoRARegistry(server_args.lora_paths)
                                                      if server_args.enable_lora else None)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._handle_task: Optional[asyncio.Task] = None
        self._sweep_task: Optional[asyncio.Task] = None
        self.last_receive_tstamp = 0.0
        # Last arrival of generated output (not of control replies): a sign that batches finish.
        self.last_output_tstamp = 0.0
        # Label names a request may add to its metrics (SGLang's --tokenizer-metrics-allowed-custom-labels).
        self.custom_label_names: tuple[str, ...] = tuple(server_args.tokenizer_metrics_allowed_custom_labels or ())
        self.metrics_collector: Optional[TokenizerMetricsCollector] = (
            TokenizerMetricsCollector(self.served_model_name, custom_label_names=self.custom_label_names)
            if server_args.enable_metrics else None)
        # A PD prefill server's bootstrap server (started with the children; closed with us).
        self.bootstrap_server: Optional[BootstrapServer] = None

    @property
    def tokenizer(self) -> Any:
        return self.tokenization.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        # The collaborators tokenize and detokenize with the same tokenizer.
        self.tokenization.tokenizer = tokenizer
        self.output_assembler.tokenizer = tokenizer

    # ------------------------------------------------------------------ lifecycle
    def auto_create_handle_loop(self) -> None:
        """Start the receive task in the running event loop (once)."""
        loop = asyncio.get_running_loop()
        if self._handle_task is not None and not self._handle_task.done() and self._loop is loop:
            return
        self._loop = loop
        self._handle_task = loop.create_task(self.handle_loop(), name="tokenizer-manager-recv")
        self._sweep_task = loop.create_task(self._disconnect_sweeper(), name="tokenizer-manager-disconnects")

    async def _disconnect_sweeper(self) -> None:
        """Every poll interval, wake each request that has an HTTP client to check on.

        One task for all requests: a waiter otherwise needs a timeout on every wait (a task and
        a timer per output with asyncio.wait_for), which at thousands of streams cost more than
        the outputs themselves.
        """
        while True:
            await asyncio.sleep(DISCONNECT_POLL_INTERVAL_S)
            for state in list(self.rid_to_state.values()):
                if state.client is not None:
                    state.check_client = True
                    state.event.set()

    async def handle_loop(self) -> None:
        try:
            while True:
                data = await self.recv_from_detokenizer.recv()
                self.last_receive_tstamp = time.monotonic()
                self._handle_message(data)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - nothing would ever be received again: say so to all
            logger.exception("The TokenizerManager's receive loop stopped")
            self.mark_dead(f"The receive loop of the TokenizerManager stopped: {e!r}")

    def _handle_message(self, data: bytes) -> None:
        """Dispatch one message; a failure never stops the loop and never leaves a waiter hanging."""
        try:
            msg = decode(data)
        except Exception as e:  # noqa: BLE001
            # Whose output it carried is unknown, and lost: end every request in flight.
            logger.exception("Undecodable message from the scheduler/detokenizer")
            self._fail_requests(f"Internal error: an output message could not be decoded ({e!r}).", 500)
            return
        try:
            self._dispatch(msg)
        except Exception:  # noqa: BLE001 - per-request failures are handled inside; this is the rest
            logger.exception("Failed to handle a %s from the scheduler/detokenizer", type(msg).__name__)

    def is_alive(self) -> bool:
        return self.liveness.is_alive()

    def begin_shutdown(self) -> None:
        """Graceful shutdown (run in the loop thread): end every request now, refuse new ones.

        Streams in flight get their final error chunk instead of being cut when the HTTP server
        closes their connections; the scheduler is told to drop its work.
        """
        if not self.liveness.begin_shutdown():
            return
        logger.info("Shutting down: ending %d request(s) in flight.", len(self.rid_to_state))
        self._fail_all(SHUTDOWN_MESSAGE)
        # Only this worker's requests: the other HTTP workers end their own streams themselves.
        self._send_now(AbortReq(abort_all=True, worker_only=True), timeout_ms=0)

    def set_model_path(self, model_path: str) -> None:
        self.model_path = model_path

    def mark_dead(self, message: str) -> None:
        """A child died: fail every pending request and control call (callable from any thread)."""
        self.liveness.mark_dead(message)
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _in_loop_thread(loop):
            self._fail_all(message)
        else:
            loop.call_soon_threadsafe(self._fail_all, message)

    async def stop_handle_loop(self) -> None:
        """Cancel the receive task and wait for it (run inside its loop before stopping the loop)."""
        for task in (self._handle_task, self._sweep_task):
            if task is not None and not task.done():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._handle_task = self._sweep_task = None

    def close(self) -> None:
        for task in (self._handle_task, self._sweep_task):
            if task is not None and self._loop is not None and not self._loop.is_closed():
                if _in_loop_thread(self._loop):
                    task.cancel()
                else:
                    self._loop.call_soon_threadsafe(task.cancel)
        self.recv_from_detokenizer.close(linger=0)
        self.send_to_scheduler.close(linger=0)
        self.tokenization.close()
        if self.bootstrap_server is not None:
            self.bootstrap_server.close()
            self.bootstrap_server = None

    # ------------------------------------------------------------------ generate
    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None, incremental: bool = False
    ) -> GenerateOutputs:
        """Validate, tokenize and send `obj`; yield its outputs (see the module docstring).

        `incremental`: a stream's outputs carry only what is new since the previous one
        (--incremental-streaming-output, for the native route and the Engine).
        """
        self.auto_create_handle_loop()
        self.check_alive()
        if not self.is_generation:
            raise EngineRequestError(NOT_A_GENERATION_MODEL)
        obj.normalize()
        try:
            obj.custom_labels = checked_custom_labels(obj.custom_labels, self.custom_label_names)
        except ValueError as e:
            raise EngineRequestError(str(e)) from None
        tokenized = await self.tokenization.tokenize_generate(obj)
        loras = self._check_loras(tokenized)
        registry = self.lora_registry
        if registry is not None:
            registry.acquire(loras)  # an unload of these adapters waits until this request ends
        try:
            # Waits while generation is paused or a weight update runs; held until the request ends.
            async with self.control.gate.slot():
                async for out in self._send_and_wait(obj, tokenized, request, incremental):
                    yield out
        finally:
            if registry is not None:
                registry.release(loras)

    def _check_loras(self, tokenized: list[TokenizedGenerateReqInput]) -> list[str]:
        """The LoRA adapters the sub-requests name (400 for one that is not loaded)."""
        names = [t.options.lora_path for t in tokenized if t.options.lora_path is not None]
        if names and self.lora_registry is None:
            raise EngineRequestError("LoRA is not enabled on this server (start it with --enable-lora or "
                                     "--lora-paths); lora_path must be null.")
        if self.lora_registry is not None:
            self.lora_registry.check(names)
        return names

    async def _send_and_wait(self, obj: GenerateReqInput, tokenized: list[TokenizedGenerateReqInput],
                             request: Any, incremental: bool) -> AsyncIterator[Union[dict, list[dict]]]:
        self.check_alive()
        self._check_new_rids(tokenized)
        states: list[ReqState] = []
        for i, req in enumerate(tokenized):
            options = req.options
            state = ReqState(
                rid=req.rid,
                stream=obj.stream,
                return_logprob=options.return_logprob,
                return_text_in_logprobs=obj.return_text_in_logprobs,
                created_time=time.time(),
                no_logs=obj.no_logs,
                return_hidden_states=bool(options.return_hidden_states),
                hidden_states_last=options.return_hidden_states == "last",
                incremental=incremental and obj.stream,
                prompt_token_ids=list(req.input_ids) if options.return_prompt_token_ids else None,
            )
            if self.metrics_collector is not None and obj.log_metrics \
                    and not req.rid.startswith(HEALTH_CHECK_RID_PREFIX):
                state.timer = RequestTimer(created=time.monotonic(),
                                           labels=self.metrics_collector.label_values(obj.custom_labels))
            self.rid_to_state[req.rid] = state
            states.append(state)
        await self._send_requests(tokenized, states, log=not obj.no_logs)

        if obj.is_single:
            async for out in self._wait_one_response(states[0], request):
                yield out
        elif obj.stream:
            async for out in merge_indexed([self._wait_one_response(st, request) for st in states]):
                yield out
        else:
            yield await gather_last([self._wait_one_response(st, request) for st in states])

    def _check_new_rids(self, reqs: list) -> None:
        for req in reqs:
            if req.rid in self.rid_to_state:
                raise EngineRequestError(f"Duplicate request id {req.rid!r}: a request with this id is running.")

    async def _send_requests(self, reqs: list, states: list[ReqState], log: bool) -> None:
        """Send registered requests; if any send fails, forget them all and abort those sent."""
        sent: list[str] = []
        try:
            for req in reqs:
                await self.send_async(req)
                sent.append(req.rid)
                if self.server_args.log_requests and log:
                    params = req.sampling_params if isinstance(req, TokenizedGenerateReqInput) else None
                    logger.info("Receive: rid=%s, prompt_tokens=%d, sampling_params=%s, text=%r",
                                req.rid, len(req.input_ids), params, _clip(req.input_text))
        except BaseException:
            for state in states:
                self.rid_to_state.pop(state.rid, None)
            for rid in sent:
                self.abort_request(rid)
            raise

    # ------------------------------------------------------------------ encode (embeddings)
    async def encode_request(self, obj: EmbeddingReqInput, request: Any = None) -> list[EmbeddingResult]:
        """Embed every input of `obj` (one result per input, in order); a failed input fails all."""
        self.auto_create_handle_loop()
        self.check_alive()
        if self.is_generation:
            raise EngineRequestError(NOT_AN_EMBEDDING_MODEL)
        tokenized = await self.tokenization.tokenize_embedding(obj)
        self._check_new_rids(tokenized)
        now = time.time()
        states = [ReqState(rid=req.rid, stream=False, return_logprob=False, return_text_in_logprobs=False,
                           created_time=now) for req in tokenized]
        for state in states:
            if self.metrics_collector is not None and not state.rid.startswith(HEALTH_CHECK_RID_PREFIX):
                state.timer = RequestTimer(created=time.monotonic())
            self.rid_to_state[state.rid] = state
        await self._send_requests(tokenized, states, log=True)
        await gather_last([self._wait_one_response(st, request) for st in states])
        return [embedding_result(state) for state in states]

    # ------------------------------------------------------------------ waiting for outputs
    async def _wait_one_response(self, state: ReqState, request: Any = None) -> AsyncIterator[dict]:
        """Yield the outputs of one sub-request; abort it if the consumer or the client goes away.

        The waiter wakes for new output (`has_update`) and, about once per
        DISCONNECT_POLL_INTERVAL_S, for the disconnect sweeper (`check_client`): the client is
        checked at least that often, also while outputs keep arriving (a non-streaming client
        that left would otherwise decode to the end).
        """
        state.client = request
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if state.check_client:
                    state.check_client = False
                    if request is not None and await request.is_disconnected():
                        logger.info("Client disconnected; aborting request %s", state.rid)
                        raise EngineRequestError("The client disconnected; the request was aborted.",
                                                 CLIENT_CLOSED_REQUEST, "ClientDisconnected") from None
                if not state.has_update:
                    continue
                state.has_update = False
                out = build_output(state)
                out["meta_info"]["weight_version"] = self.control.weight_version  # as SGLang's meta_info
                if state.finished:
                    self.rid_to_state.pop(state.rid, None)
                    if self.server_args.log_requests and not state.no_logs:
                        logger.info("Finish: rid=%s, finish_reason=%s, completion_tokens=%d, text=%r",
                                    state.rid, state.finished_reason, state.completion_tokens, _clip(state.text))
                    yield out
                    return
                if state.stream:
                    yield out
        finally:
            state.client = None
            if not state.finished:
                # The consumer stopped listening (disconnect, cancellation, error): free the
                # scheduler's work for this request instead of leaving a ghost running.
                self.rid_to_state.pop(state.rid, None)
                self.abort_request(state.rid)

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, BatchStrOutput):
            self._handle_batch_str_output(msg)
        elif isinstance(msg, BatchEmbeddingOutput):
            self._handle_batch_embedding_output(msg)
        elif not self.control.on_reply(msg):
            logger.warning("TokenizerManager ignores unexpected message %s", type(msg).__name__)

    def _handle_batch_str_output(self, batch: BatchStrOutput) -> None:
        now = time.monotonic()
        self.last_output_tstamp = now
        for i, rid in enumerate(batch.rids):
            state = self.rid_to_state.get(rid)
            if state is None or state.finished:
                # Aborted on our side already, or ended here (shutdown, a dead child): its last
                # outputs are of no use and must not replace the terminal reason it was given.
                continue
            try:
                self._handle_one_output(state, batch, i, now)
            except Exception as e:  # noqa: BLE001 - this request fails; the batch's others go on
                logger.exception("Failed to handle the output of request %s", rid)
                self._fail_request(state, f"Internal error while handling the output: {e!r}", 500)
                self.abort_request(rid)

    def _handle_batch_embedding_output(self, msg: BatchEmbeddingOutput) -> None:
        now = time.monotonic()
        self.last_output_tstamp = now
        for state in apply_embedding_output(self.rid_to_state, msg):
            if state.timer is not None and self.metrics_collector is not None:
                # A finished request with its prompt tokens and no generated ones, as SGLang counts it.
                self.metrics_collector.observe_one_finished_request(state.prompt_tokens, 0, now - state.timer.created)

    def _handle_one_output(self, state: ReqState, batch: BatchStrOutput, i: int, now: float) -> None:
        self.output_assembler.apply(state, batch, i)
        if state.timer is not None and self.metrics_collector is not None:
            self.metrics_collector.observe_output(
                state.timer, state.prompt_tokens, state.completion_tokens, state.finished, now)
        state.notify_update()

    # ------------------------------------------------------------------ sending
    def _encode(self, msg: Routed) -> bytes:
        msg.http_worker = self.worker_id  # where the scheduler sends what answers it
        return encode(msg)

    async def send_async(self, msg: Routed) -> None:
        data = self._encode(msg)
        deadline = time.monotonic() + SEND_TIMEOUT_S
        while True:
            try:
                self.send_to_scheduler.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                # PUSH refuses while no scheduler is connected (startup race, or it died).
                self.check_alive()
                if time.monotonic() > deadline:
                    raise EngineRequestError("The scheduler is not reachable.", 503, "ServiceUnavailableError")
                await asyncio.sleep(0.005)

    def _send_now(self, msg: Routed, timeout_ms: int = 100) -> bool:
        data = self._encode(msg)
        try:
            self.send_to_scheduler.send(data, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            if self.send_to_scheduler.poll(timeout_ms, zmq.POLLOUT):
                self.send_to_scheduler.send(data, flags=zmq.NOBLOCK)
                return True
        logger.warning("Could not send %s: the scheduler is not reachable", type(msg).__name__)
        return False

    def unavailable_error(self) -> Optional[EngineRequestError]:
        return self.liveness.unavailable_error()

    def check_alive(self) -> None:
        self.liveness.check()

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Abort the request(s) whose rid starts with `rid`, or all of them."""
        if not rid and not abort_all:
            return  # an empty prefix would match every request
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop_thread(loop):
            # The sockets belong to the loop's thread.
            loop.call_soon_threadsafe(self._send_now, AbortReq(rid=rid, abort_all=abort_all))
            return
        self._send_now(AbortReq(rid=rid, abort_all=abort_all))

    # ------------------------------------------------------------------ control calls
    async def flush_cache(self) -> FlushCacheReqOutput:
        return await self.control.flush_cache()

    async def get_internal_state(self) -> list[dict]:
        return await self.control.get_internal_state()

    async def health_generate(self, timeout: Optional[float] = None) -> bool:
        return await self.control.health_generate(timeout)

    # ------------------------------------------------------------------ chat and info
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None,
        continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
    ) -> list[int]:
        return self.tokenization.apply_chat_template(messages, add_generation_prompt, tools, continue_final_message,
                                                     template_kwargs)

    async def apply_chat_template_async(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None,
        continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
    ) -> list[int]:
        """apply_chat_template on the tokenizer thread (what the chat route awaits)."""
        return await self.tokenization.apply_chat_template_async(messages, add_generation_prompt, tools,
                                                                 continue_final_message, template_kwargs)

    def get_model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "is_generation": self.is_generation,
            "preferred_sampling_params": None,
            "weight_version": self.control.weight_version,
            "context_len": self.context_len,
            "max_req_input_len": self.max_req_input_len,
            "max_total_num_tokens": self.max_total_num_tokens,
            "vocab_size": self.vocab_size,
        }

    def _fail_request(self, state: ReqState, message: str, status_code: int) -> None:
        """End one waiting request with a terminal error (its waiter wakes and returns it).

        A request that already finished keeps its outcome, but its waiter is woken all the same:
        a failure after `finished` was set may have skipped the wake-up.
        """
        if not state.finished:
            state.finished = True
            state.finished_reason = {"type": "abort", "message": message, "status_code": status_code}
        state.notify_update()

    def _fail_requests(self, message: str, status_code: int) -> None:
        for state in list(self.rid_to_state.values()):
            self._fail_request(state, message, status_code)

    def _fail_all(self, message: str) -> None:
        self._fail_requests(self.liveness.not_alive_message(message), 503)
        error = EngineRequestError(self.liveness.not_alive_message(message), 503, "ServiceUnavailableError")
        self.control.fail_all(error)



def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _clip(text: Optional[str], limit: int = 200) -> Optional[str]:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + "..."
