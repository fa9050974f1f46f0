"""TokenizerManager: the main process's half of the runtime (asyncio).

It validates and tokenizes requests, sends them to scheduler rank 0, and yields SGLang-shaped
outputs as the detokenizer's BatchStrOutput messages arrive. One background task receives from
the tokenizer socket and dispatches: text deltas go to the per-request state (an asyncio.Event
plus the accumulated output), control replies (flush_cache, get_internal_state) to their
waiters in FIFO order.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence, Union

import psutil
import zmq
import zmq.asyncio

from engine.managers.errors import EngineRequestError
from engine.managers.io_struct import (
    AbortReq,
    BatchStrOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    Message,
    TokenizedGenerateReqInput,
    decode,
    encode,
)
from engine.managers.metrics import RequestTimer, TokenizerMetricsCollector
from engine.sampling.sampling_params import check_parallel_sample_num
from engine.server_args import PortArgs, ServerArgs
from engine.utils.tokenizer_utils import load_tokenizer
from engine.utils.zmq_utils import get_zmq_socket

logger = logging.getLogger(__name__)

# How often a waiting request checks whether its HTTP client went away.
DISCONNECT_POLL_INTERVAL_S = 1.0
# How long a send may wait for the scheduler's socket to accept a message before giving up.
SEND_TIMEOUT_S = 5.0
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
# How often a health probe on a busy server asks the scheduler whether forwards advance.
HEALTH_CHECK_PROGRESS_POLL_S = 0.25
SHUTDOWN_MESSAGE = "The server is shutting down."


@dataclass
class GenerateReqInput:
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    rid: Optional[Union[str, list[str]]] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool]] = False
    logprob_start_len: Union[int, list[int]] = -1  # -1: no input logprobs
    top_logprobs_num: Union[int, list[int]] = 0
    return_text_in_logprobs: bool = False
    # False: not counted in /metrics (health probes). True no_logs: --log-requests skips its text.
    log_metrics: bool = True
    no_logs: bool = False

    # Filled by normalize(): one entry per sub-request.
    is_single: bool = field(default=True, init=False)
    batch_size: int = field(default=1, init=False)
    # The prompt each sub-request samples from: the n copies of a prompt share its tokenization.
    prompt_index: list[int] = field(default_factory=list, init=False)
    _normalized: bool = field(default=False, init=False, repr=False)

    def normalize(self) -> None:
        """Validate shapes and turn every field into a list with one entry per sub-request."""
        if self._normalized:
            return
        prompts_text, prompts_ids, is_batch = self._split_prompts()
        num_prompts = len(prompts_text) if prompts_text is not None else len(prompts_ids)
        if num_prompts == 0:
            raise EngineRequestError("The batch of prompts is empty.")

        sampling_params = self._per_prompt(self.sampling_params, num_prompts, "sampling_params", dict, None)
        sampling_params = [dict(sp) if sp is not None else {} for sp in sampling_params]
        rids = self._normalize_rids(num_prompts, is_batch)
        return_logprob = self._per_prompt(self.return_logprob, num_prompts, "return_logprob", bool, False)
        start_lens = self._per_prompt(self.logprob_start_len, num_prompts, "logprob_start_len", int, -1)
        top_nums = self._per_prompt(self.top_logprobs_num, num_prompts, "top_logprobs_num", int, 0)

        out_text: list[str] = []
        out_ids: list[list[int]] = []
        out_sp: list[dict] = []
        out_rid: list[str] = []
        out_lp: list[bool] = []
        out_start: list[int] = []
        out_top: list[int] = []
        out_prompt: list[int] = []
        # Every n is checked before any fan-out: a huge n must not build a huge list first.
        fan_outs = [_parallel_sample_num(sp) for sp in sampling_params]
        for i, n in enumerate(fan_outs):
            sub_params = {k: v for k, v in sampling_params[i].items() if k != "n"}
            for j in range(n):
                out_prompt.append(i)
                if prompts_text is not None:
                    out_text.append(prompts_text[i])
                else:
                    out_ids.append(prompts_ids[i])
                out_sp.append(dict(sub_params))
                out_rid.append(f"{rids[i]}-{j}" if n > 1 else rids[i])
                out_lp.append(bool(return_logprob[i]))
                out_start.append(int(start_lens[i]))
                out_top.append(int(top_nums[i]))

        self.text = out_text if prompts_text is not None else None
        self.input_ids = out_ids if prompts_ids is not None else None
        self.sampling_params = out_sp
        self.rid = out_rid
        self.return_logprob = out_lp
        self.logprob_start_len = out_start
        self.top_logprobs_num = out_top
        self.prompt_index = out_prompt
        self.batch_size = len(out_rid)
        self.is_single = not is_batch and self.batch_size == 1
        self._normalized = True

    # ------------------------------------------------------------------ helpers
    def _split_prompts(self) -> tuple[Optional[list[str]], Optional[list[list[int]]], bool]:
        if (self.text is None) == (self.input_ids is None):
            raise EngineRequestError("Exactly one of text or input_ids must be provided.")
        if self.text is not None:
            if isinstance(self.text, str):
                return [self.text], None, False
            if isinstance(self.text, list) and all(isinstance(t, str) for t in self.text):
                return list(self.text), None, True
            raise EngineRequestError("text must be a string or a list of strings.")
        ids = self.input_ids
        if not isinstance(ids, list) or not ids:
            raise EngineRequestError("input_ids must be a non-empty list of token ids or a list of such lists.")
        if all(_is_token_id(t) for t in ids):
            return None, [list(ids)], False
        if all(isinstance(seq, list) and seq and all(_is_token_id(t) for t in seq) for seq in ids):
            return None, [list(seq) for seq in ids], True
        raise EngineRequestError("input_ids must be a non-empty list of non-negative integers or a list of such lists.")

    def _normalize_rids(self, num_prompts: int, is_batch: bool) -> list[str]:
        if self.rid is None:
            return [uuid.uuid4().hex for _ in range(num_prompts)]
        if isinstance(self.rid, str):
            if not self.rid:
                raise EngineRequestError("rid must not be empty.")
            # One rid for a batch is a prefix, as in SGLang: "{rid}_{i}" for prompt i.
            return [f"{self.rid}_{i}" for i in range(num_prompts)] if is_batch else [self.rid]
        if isinstance(self.rid, list) and len(self.rid) == num_prompts and all(
            isinstance(r, str) and r for r in self.rid
        ):
            if len(set(self.rid)) != len(self.rid):
                raise EngineRequestError("rid values must be unique within a batch.")
            return list(self.rid)
        raise EngineRequestError(f"rid must be a list of {num_prompts} non-empty strings.")

    @staticmethod
    def _per_prompt(value: Any, num_prompts: int, name: str, kind: type, default: Any) -> list:
        """Broadcast a scalar over the prompts, or check a list has one entry per prompt."""
        if value is None:
            return [default] * num_prompts
        if isinstance(value, list):
            if len(value) != num_prompts:
                raise EngineRequestError(f"{name} has {len(value)} entries but there are {num_prompts} prompts.")
            items = value
        else:
            items = [value] * num_prompts
        for item in items:
            # bool is a subclass of int: an int option must not silently accept True.
            wrong_type = not isinstance(item, kind) or (kind is int and isinstance(item, bool))
            if item is not None and wrong_type:
                raise EngineRequestError(f"{name} must be of type {kind.__name__} (or a list of them), got {item!r}.")
        return [default if item is None else item for item in items]


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parallel_sample_num(sampling_params: dict) -> int:
    n = sampling_params.get("n", 1)
    if n is None:
        return 1
    try:
        return check_parallel_sample_num(n)
    except ValueError as e:
        raise EngineRequestError(f"{e}.") from None


# ---------------------------------------------------------------------------------------------
# Per-request state
# ---------------------------------------------------------------------------------------------


@dataclass
class ReqState:
    """What the TokenizerManager knows about one in-flight (sub-)request."""

    rid: str
    stream: bool
    return_logprob: bool
    return_text_in_logprobs: bool
    created_time: float
    no_logs: bool = False
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finished_reason: Optional[dict] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    # Set when metrics are enabled and the request is not a health probe.
    timer: Optional[RequestTimer] = None


class _ReplyWaiters:
    """Callers waiting for one kind of control reply, answered in FIFO order.

    The scheduler answers control requests in the order it receives them, and each request
    gets `fan_out` replies (one per DP replica). A caller that timed out stays queued so that its
    late reply is consumed by it rather than handed to the next caller.
    """

    def __init__(self, fan_out: int) -> None:
        self.fan_out = fan_out
        self.waiters: collections.deque[tuple[asyncio.Future, list]] = collections.deque()

    def add(self) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self.waiters.append((future, []))
        return future

    def on_reply(self, reply: Message) -> None:
        if not self.waiters:
            logger.warning("Unexpected control reply %s with no waiter", type(reply).__name__)
            return
        future, replies = self.waiters[0]
        replies.append(reply)
        if len(replies) >= self.fan_out:
            self.waiters.popleft()
            if not future.done():
                future.set_result(replies)

    def fail_all(self, error: Exception) -> None:
        while self.waiters:
            future, _ = self.waiters.popleft()
            if not future.done():
                future.set_exception(error)


# ---------------------------------------------------------------------------------------------
# TokenizerManager
# ---------------------------------------------------------------------------------------------


class TokenizerManager:
    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        scheduler_info: dict,
        child_processes: Sequence[Any] = (),
        tokenizer: Any = None,
    ) -> None:
        """`scheduler_info` is the "ready" message of scheduler rank 0 (context_len, vocab_size, ...)."""
        self.server_args = server_args
        self.port_args = port_args
        self.model_path = server_args.model_path
        self.tokenizer_path = server_args.tokenizer_path or server_args.model_path
        self.served_model_name = server_args.served_model_name
        self.context_len: int = int(scheduler_info["context_len"])
        self.max_req_input_len: int = int(scheduler_info.get("max_req_input_len", self.context_len - 1))
        self.max_total_num_tokens: Optional[int] = scheduler_info.get("max_total_num_tokens")
        self.vocab_size: Optional[int] = scheduler_info.get("vocab_size")
        self.child_processes = list(child_processes)

        if tokenizer is None and not server_args.skip_tokenizer_init:
            tokenizer = load_tokenizer(self.tokenizer_path, server_args.trust_remote_code)
        self.tokenizer = tokenizer
        self.chat_template = load_chat_template(server_args.chat_template)

        # The PULL socket is asyncio-aware (the receive loop awaits it); the PUSH socket is a
        # plain one so that abort_request can stay a synchronous call.
        self._async_context = zmq.asyncio.Context()
        self._sync_context = zmq.Context()
        self.recv_from_detokenizer = get_zmq_socket(
            self._async_context, zmq.PULL, port_args.tokenizer_ipc_name, bind=True)
        self.send_to_scheduler = get_zmq_socket(
            self._sync_context, zmq.PUSH, port_args.scheduler_input_ipc_name, bind=True)

        self.rid_to_state: dict[str, ReqState] = {}
        fan_out = max(1, server_args.dp_size)
        self._flush_waiters = _ReplyWaiters(fan_out)
        self._state_waiters = _ReplyWaiters(fan_out)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._handle_task: Optional[asyncio.Task] = None
        self._dead_message: Optional[str] = None
        self._shutting_down = False
        self.last_receive_tstamp = 0.0
        # Last arrival of generated output (not of control replies): a sign that batches finish.
        self.last_output_tstamp = 0.0
        # Concurrent /health_generate calls share this one in-flight probe.
        self._health_probe: Optional[asyncio.Future] = None
        self.metrics_collector: Optional[TokenizerMetricsCollector] = (
            TokenizerMetricsCollector(self.served_model_name) if server_args.enable_metrics else None)

    # ------------------------------------------------------------------ lifecycle
    def auto_create_handle_loop(self) -> None:
        """Start the receive task in the running event loop (once)."""
        loop = asyncio.get_running_loop()
        if self._handle_task is not None and not self._handle_task.done() and self._loop is loop:
            return
        self._loop = loop
        self._handle_task = loop.create_task(self.handle_loop(), name="tokenizer-manager-recv")

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
        """True while every child process is alive, no fatal error was reported and no shutdown began."""
        return self._dead_message is None and all(_child_alive(p) for p in self.child_processes)

    def begin_shutdown(self) -> None:
        """Graceful shutdown (run in the loop thread): end every request now, refuse new ones.

        Streams in flight get their final error chunk instead of being cut when the HTTP server
        closes their connections; the scheduler is told to drop its work.
        """
        if self._dead_message is not None:
            return
        logger.info("Shutting down: ending %d request(s) in flight.", len(self.rid_to_state))
        self._shutting_down = True
        self._dead_message = SHUTDOWN_MESSAGE
        self._fail_all(SHUTDOWN_MESSAGE)
        self._send_now(AbortReq(abort_all=True), timeout_ms=0)

    def mark_dead(self, message: str) -> None:
        """A child died: fail every pending request and control call (callable from any thread)."""
        self._dead_message = message
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if _in_loop_thread(loop):
            self._fail_all(message)
        else:
            loop.call_soon_threadsafe(self._fail_all, message)

    async def stop_handle_loop(self) -> None:
        """Cancel the receive task and wait for it (run inside its loop before stopping the loop)."""
        task, self._handle_task = self._handle_task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def close(self) -> None:
        if self._handle_task is not None and self._loop is not None and not self._loop.is_closed():
            if _in_loop_thread(self._loop):
                self._handle_task.cancel()
            else:
                self._loop.call_soon_threadsafe(self._handle_task.cancel)
        self.recv_from_detokenizer.close(linger=0)
        self.send_to_scheduler.close(linger=0)

    # ------------------------------------------------------------------ generate
    async def generate_request(
        self, obj: GenerateReqInput, request: Any = None
    ) -> AsyncIterator[Union[dict, list[dict]]]:
        """Validate, tokenize and send `obj`; yield its outputs (see the module docstring)."""
        self.auto_create_handle_loop()
        self._check_alive()
        obj.normalize()
        # Validate every sub-request before sending any, so a bad batch has no side effects.
        # Each prompt is tokenized and checked once, however many samples (n) it fans out into.
        prompt_ids: dict[int, list[int]] = {}
        tokenized = []
        for i in range(obj.batch_size):
            prompt = obj.prompt_index[i]
            if prompt not in prompt_ids:
                prompt_ids[prompt] = self._prompt_input_ids(obj, i)
            tokenized.append(self._tokenize_one(obj, i, prompt_ids[prompt]))
        states: list[ReqState] = []
        for req in tokenized:
            if req.rid in self.rid_to_state:
                raise EngineRequestError(f"Duplicate request id {req.rid!r}: a request with this id is running.")
        for i, req in enumerate(tokenized):
            state = ReqState(
                rid=req.rid,
                stream=obj.stream,
                return_logprob=obj.return_logprob[i],
                return_text_in_logprobs=obj.return_text_in_logprobs,
                created_time=time.time(),
                no_logs=obj.no_logs,
            )
            if self.metrics_collector is not None and obj.log_metrics \
                    and not req.rid.startswith(HEALTH_CHECK_RID_PREFIX):
                state.timer = RequestTimer(created=time.monotonic())
            self.rid_to_state[req.rid] = state
            states.append(state)
        sent: list[str] = []
        try:
            for req in tokenized:
                await self._send_async(req)
                sent.append(req.rid)
                if self.server_args.log_requests and not obj.no_logs:
                    logger.info("Receive: rid=%s, prompt_tokens=%d, sampling_params=%s, text=%r",
                                req.rid, len(req.input_ids), req.sampling_params, _clip(req.input_text))
        except BaseException:
            for state in states:
                self.rid_to_state.pop(state.rid, None)
            for rid in sent:
                self.abort_request(rid)
            raise

        if obj.is_single:
            async for out in self._wait_one_response(states[0], request):
                yield out
        elif obj.stream:
            async for out in self._stream_batch(states, request):
                yield out
        else:
            yield await self._gather_batch(states, request)

    def _prompt_input_ids(self, obj: GenerateReqInput, i: int) -> list[int]:
        """The token ids of sub-request i's prompt, checked against the vocabulary and context."""
        if obj.input_ids is not None:
            input_ids = list(obj.input_ids[i])
        else:
            if self.tokenizer is None:
                raise EngineRequestError("This server has no tokenizer (--skip-tokenizer-init): send input_ids.")
            input_ids = list(self.tokenizer.encode(obj.text[i]))
        input_len = len(input_ids)
        if input_len == 0:
            raise EngineRequestError("The input is empty.")
        if self.vocab_size is not None:
            bad = [t for t in input_ids if t >= self.vocab_size]
            if bad:
                raise EngineRequestError(
                    f"Token id {bad[0]} in input_ids is out of range for the vocabulary of size {self.vocab_size}.")
        if input_len >= self.context_len:
            raise EngineRequestError(
                f"The input ({input_len} tokens) is longer than the model's context length "
                f"({self.context_len} tokens).")
        return input_ids

    def _tokenize_one(self, obj: GenerateReqInput, i: int, input_ids: list[int]) -> TokenizedGenerateReqInput:
        input_text = obj.text[i] if obj.text is not None else None
        input_len = len(input_ids)
        sampling_params = self._verify_sampling_params(obj.sampling_params[i])
        # Only a budget the client asked for is checked: the default (SamplingParams') would
        # reject every long prompt, and the scheduler clamps it to the context anyway.
        max_new_tokens = obj.sampling_params[i].get("max_new_tokens")
        if isinstance(max_new_tokens, int) and input_len + max_new_tokens > self.context_len:
            raise EngineRequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                f"tokens. You requested a total of {input_len + max_new_tokens} tokens: {input_len} tokens "
                f"from the input messages and {max_new_tokens} tokens for the completion. Please reduce the "
                f"number of tokens in the input messages or the completion to fit within the limit.")

        return_logprob = obj.return_logprob[i]
        logprob_start_len = obj.logprob_start_len[i]
        top_logprobs_num = obj.top_logprobs_num[i]
        if top_logprobs_num < 0:
            raise EngineRequestError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}.")
        if logprob_start_len < -1:
            raise EngineRequestError(f"logprob_start_len must be >= -1, got {logprob_start_len}.")
        # As SGLang: a start at the prompt length is allowed (no input logprobs), beyond it is not.
        if return_logprob and logprob_start_len > input_len:
            raise EngineRequestError(
                f"logprob_start_len ({logprob_start_len}) must not exceed the input length ({input_len}).")
        return TokenizedGenerateReqInput(
            rid=obj.rid[i],
            input_ids=input_ids,  # shared by the n samples of a prompt: encoded, never mutated
            sampling_params=sampling_params,
            input_text=input_text,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            stream=obj.stream,
        )

    def _verify_sampling_params(self, params: dict) -> dict:
        from engine.sampling.sampling_params import SamplingParams

        try:
            sampling_params = SamplingParams(**params)
        except TypeError as e:
            raise EngineRequestError(f"Invalid sampling_params: {e}") from None
        except ValueError as e:
            raise EngineRequestError(str(e)) from None
        try:
            sampling_params.verify(self.vocab_size)
        except ValueError as e:
            raise EngineRequestError(str(e)) from None
        return sampling_params.to_dict()

    # ------------------------------------------------------------------ waiting for outputs
    async def _wait_one_response(self, state: ReqState, request: Any = None) -> AsyncIterator[dict]:
        """Yield the outputs of one sub-request; abort it if the consumer or the client goes away."""
        loop = asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_INTERVAL_S
        try:
            while True:
                try:
                    await asyncio.wait_for(state.event.wait(), timeout=DISCONNECT_POLL_INTERVAL_S)
                    woke = True
                except asyncio.TimeoutError:
                    woke = False
                # Check the client at least every poll interval, also while outputs keep arriving
                # (a non-streaming client that left would otherwise decode to the end).
                if request is not None and loop.time() >= next_check:
                    next_check = loop.time() + DISCONNECT_POLL_INTERVAL_S
                    if await request.is_disconnected():
                        logger.info("Client disconnected; aborting request %s", state.rid)
                        raise EngineRequestError("The client disconnected; the request was aborted.",
                                                 status_code=400, err_type="ClientDisconnected") from None
                if not woke:
                    continue
                state.event.clear()
                out = self._build_output(state)
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
            if not state.finished:
                # The consumer stopped listening (disconnect, cancellation, error): free the
                # scheduler's work for this request instead of leaving a ghost running.
                self.rid_to_state.pop(state.rid, None)
                self.abort_request(state.rid)

    async def _gather_batch(self, states: list[ReqState], request: Any) -> list[dict]:
        async def last_output(state: ReqState) -> dict:
            result: dict = {}
            async for out in self._wait_one_response(state, request):
                result = out
            return result

        tasks = [asyncio.ensure_future(last_output(s)) for s in states]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()

    async def _stream_batch(self, states: list[ReqState], request: Any) -> AsyncIterator[dict]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, state: ReqState) -> None:
            try:
                async for out in self._wait_one_response(state, request):
                    out["index"] = index
                    queue.put_nowait(("out", out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer below
                queue.put_nowait(("error", e))
                raise
            finally:
                queue.put_nowait(("done", None))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(states)]
        remaining = len(tasks)
        try:
            while remaining:
                kind, payload = await queue.get()
                if kind == "out":
                    yield payload
                elif kind == "error":
                    if not isinstance(payload, asyncio.CancelledError):
                        raise payload
                else:
                    remaining -= 1
        finally:
            for task in tasks:
                task.cancel()

    def _build_output(self, state: ReqState) -> dict:
        meta: dict[str, Any] = {
            "id": state.rid,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
            "finish_reason": copy.deepcopy(state.finished_reason),
            "e2e_latency": time.time() - state.created_time,
        }
        if state.return_logprob:
            meta["input_token_logprobs"] = list(state.input_token_logprobs)
            meta["input_top_logprobs"] = list(state.input_top_logprobs)
            meta["output_token_logprobs"] = list(state.output_token_logprobs)
            meta["output_top_logprobs"] = list(state.output_top_logprobs)
        return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}

    # ------------------------------------------------------------------ receiving
    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, BatchStrOutput):
            self._handle_batch_str_output(msg)
        elif isinstance(msg, FlushCacheReqOutput):
            self._flush_waiters.on_reply(msg)
        elif isinstance(msg, GetInternalStateReqOutput):
            self._state_waiters.on_reply(msg)
        elif isinstance(msg, AbortReq):
            self._handle_abort_notice(msg)
        else:
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

    def _handle_one_output(self, state: ReqState, batch: BatchStrOutput, i: int, now: float) -> None:
        state.text += batch.output_strs[i]
        state.output_ids.extend(batch.output_ids[i])
        state.prompt_tokens = batch.prompt_tokens[i]
        state.completion_tokens = batch.completion_tokens[i]
        state.cached_tokens = batch.cached_tokens[i]
        if state.return_logprob:
            self._append_logprobs(state, batch, i)
        if batch.finished_reasons[i] is not None:
            state.finished = True
            state.finished_reason = dict(batch.finished_reasons[i])
        if state.timer is not None and self.metrics_collector is not None:
            self.metrics_collector.observe_output(
                state.timer, state.prompt_tokens, state.completion_tokens, state.finished, now)
        state.event.set()

    def _handle_abort_notice(self, msg: AbortReq) -> None:
        """The scheduler dropped a queued request without output: finish it as aborted."""
        state = self.rid_to_state.get(msg.rid)
        if state is None or state.finished:
            return
        state.finished = True
        state.finished_reason = {"type": "abort", "message": "Aborted", "status_code": 400}
        state.event.set()

    def _append_logprobs(self, state: ReqState, batch: BatchStrOutput, i: int) -> None:
        text = state.return_text_in_logprobs
        vals = _at(batch.input_token_logprobs_val, i)
        if vals is not None:
            state.input_token_logprobs.extend(self._token_logprobs(vals, _at(batch.input_token_logprobs_idx, i), text))
        vals = _at(batch.input_top_logprobs_val, i)
        if vals is not None:
            state.input_top_logprobs.extend(self._top_logprobs(vals, _at(batch.input_top_logprobs_idx, i), text))
        vals = _at(batch.output_token_logprobs_val, i)
        if vals is not None:
            state.output_token_logprobs.extend(
                self._token_logprobs(vals, _at(batch.output_token_logprobs_idx, i), text))
        vals = _at(batch.output_top_logprobs_val, i)
        if vals is not None:
            state.output_top_logprobs.extend(self._top_logprobs(vals, _at(batch.output_top_logprobs_idx, i), text))

    def _token_logprobs(self, vals: list, ids: Optional[list], with_text: bool) -> list[list]:
        ids = ids or []
        texts = self._token_texts(ids) if with_text else [None] * len(ids)
        return [[v, t, s] for v, t, s in zip(vals, ids, texts)]

    def _top_logprobs(self, vals: list, ids: Optional[list], with_text: bool) -> list:
        out: list = []
        for pos_vals, pos_ids in zip(vals, ids or []):
            if pos_vals is None or pos_ids is None:
                out.append(None)
            else:
                out.append(self._token_logprobs(pos_vals, pos_ids, with_text))
        return out

    def _token_texts(self, ids: list[int]) -> list[Optional[str]]:
        if self.tokenizer is None or not ids:
            return [None] * len(ids)
        return self.tokenizer.batch_decode([[t] for t in ids])

    # ------------------------------------------------------------------ sending
    async def _send_async(self, msg: Message) -> None:
        data = encode(msg)
        deadline = time.monotonic() + SEND_TIMEOUT_S
        while True:
            try:
                self.send_to_scheduler.send(data, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                # PUSH refuses while no scheduler is connected (startup race, or it died).
                self._check_alive()
                if time.monotonic() > deadline:
                    raise EngineRequestError("The scheduler is not reachable.", 503, "ServiceUnavailableError")
                await asyncio.sleep(0.005)

    def _send_now(self, msg: Message, timeout_ms: int = 100) -> bool:
        data = encode(msg)
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
        """The 503 a request gets while the server is not alive (None while it is)."""
        if self.is_alive():
            return None
        message = self._dead_message or "A child process of the server died."
        return EngineRequestError(self._not_alive_message(message), 503, "ServiceUnavailableError")

    def _check_alive(self) -> None:
        error = self.unavailable_error()
        if error is not None:
            raise error

    def _not_alive_message(self, message: str) -> str:
        return message if self._shutting_down else f"The server is not alive: {message}"

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

    async def flush_cache(self) -> FlushCacheReqOutput:
        replies = await self._control_call(FlushCacheReqInput(), self._flush_waiters)
        success = all(r.success for r in replies)
        message = "; ".join(r.message for r in replies if r.message)
        return FlushCacheReqOutput(success=success, message=message)

    async def get_internal_state(self) -> list[dict]:
        replies = await self._control_call(GetInternalStateReq(), self._state_waiters)
        return [dict(r.internal_state) for r in replies]

    async def _control_call(self, msg: Message, waiters: _ReplyWaiters) -> list:
        self.auto_create_handle_loop()
        self._check_alive()
        future = waiters.add()
        try:
            await self._send_async(msg)
        except BaseException:
            # Never sent: no reply will come, so this waiter must not consume someone else's.
            for j, (f, _) in enumerate(waiters.waiters):
                if f is future:
                    del waiters.waiters[j]
                    break
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(future), timeout=self.server_args.control_timeout)
        except asyncio.TimeoutError:
            raise EngineRequestError(f"{type(msg).__name__} got no reply within "
                                     f"{self.server_args.control_timeout:.0f} s.",
                                     503, "ServiceUnavailableError") from None

    async def health_generate(self, timeout: Optional[float] = None) -> bool:
        """True if the engine shows it can make progress within `timeout` seconds
        (--health-check-timeout by default).

        Concurrent callers share one in-flight probe, so a flood of health checks on a slow or
        stuck server never piles probe requests into the scheduler's queue.
        """
        if not self.is_alive():
            return False
        self.auto_create_handle_loop()
        probe = self._health_probe
        if probe is None or probe.done() or probe.get_loop() is not asyncio.get_running_loop():
            if timeout is None:
                timeout = self.server_args.health_check_timeout
            probe = self._health_probe = asyncio.ensure_future(self._run_health_probe(timeout))
        # Shielded: a caller that goes away must not cancel the probe the others wait on.
        return await asyncio.shield(probe)

    async def _run_health_probe(self, timeout: float) -> bool:
        """Send a 1-token request and wait for a sign of progress; abort the probe in any case.

        Idle, the probe itself is the sign. Busy, the probe may wait behind other work, so the
        server counts as healthy as soon as the next batch completes: any generated output
        arrives, or a scheduler's forward_ct advances. A rejected probe (queue full) is no verdict
        either way: the other signs decide. No sign within `timeout`, or a dead child: unhealthy.
        """
        start = time.monotonic()
        deadline = start + timeout
        obj = GenerateReqInput(
            input_ids=[0],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            rid=f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}",
        )

        async def run_probe() -> bool:
            result: dict = {}
            async for out in self.generate_request(obj):
                result = out
            reason = result.get("meta_info", {}).get("finish_reason") or {}
            return reason.get("type") != "abort"

        probe = asyncio.ensure_future(run_probe())
        progress = asyncio.ensure_future(self._wait_forward_progress(deadline))
        try:
            while True:
                if probe.done() and _probe_succeeded(probe):
                    return True
                if progress.done() and not progress.cancelled() and progress.exception() is None \
                        and progress.result():
                    return True
                if self.last_output_tstamp > start:
                    return True
                if not self.is_alive():
                    return False
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("Health check timed out after %.1f s: no batch completed.", timeout)
                    return False
                # Wake on either task, or at least every 100 ms for the output and liveness checks.
                pending = {t for t in (probe, progress) if not t.done()}
                if pending:
                    await asyncio.wait(pending, timeout=min(remaining, 0.1), return_when=asyncio.FIRST_COMPLETED)
                else:
                    await asyncio.sleep(min(remaining, 0.1))
        finally:
            # Cancelling the probe's generator aborts the request in the scheduler if it still runs.
            for task in (probe, progress):
                if not task.done():
                    task.cancel()
            await asyncio.gather(probe, progress, return_exceptions=True)

    async def _wait_forward_progress(self, deadline: float) -> bool:
        """True once any scheduler's forward_ct is above what it was at the first reply."""
        baseline: Optional[list[int]] = None
        while time.monotonic() < deadline:
            try:
                states = await asyncio.wait_for(self.get_internal_state(),
                                                timeout=max(0.0, deadline - time.monotonic()))
            except (asyncio.TimeoutError, EngineRequestError):
                return False
            counts = [int(s.get("forward_ct", 0)) for s in states]
            if baseline is None:
                baseline = counts
            elif any(c > b for c, b in zip(counts, baseline)):
                return True
            await asyncio.sleep(HEALTH_CHECK_PROGRESS_POLL_S)
        return False

    # ------------------------------------------------------------------ chat and info
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None
    ) -> list[int]:
        if self.tokenizer is None:
            raise EngineRequestError("This server has no tokenizer, so chat templates are unavailable.")
        kwargs: dict[str, Any] = {}
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        if tools:
            kwargs["tools"] = tools
        try:
            # Render to text first: apply_chat_template(tokenize=True) changed its return type
            # across transformers versions, encode() has not.
            prompt = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # jinja errors, a missing template, malformed messages
            raise EngineRequestError(f"Failed to apply the chat template: {e}") from None
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def get_model_info(self) -> dict:
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
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
        state.event.set()

    def _fail_requests(self, message: str, status_code: int) -> None:
        for state in list(self.rid_to_state.values()):
            self._fail_request(state, message, status_code)

    def _fail_all(self, message: str) -> None:
        self._fail_requests(self._not_alive_message(message), 503)
        error = EngineRequestError(self._not_alive_message(message), 503, "ServiceUnavailableError")
        self._flush_waiters.fail_all(error)
        self._state_waiters.fail_all(error)


def load_chat_template(chat_template: Optional[str]) -> Optional[str]:
    """`--chat-template` is a path to a Jinja file or the Jinja text itself."""
    if not chat_template:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    if "{" not in chat_template:
        raise ValueError(f"--chat-template {chat_template!r} is neither a file nor a Jinja template")
    return chat_template


def _probe_succeeded(probe: asyncio.Future) -> bool:
    if probe.cancelled():
        return False
    error = probe.exception()
    if error is not None:
        if not isinstance(error, EngineRequestError):
            logger.warning("Health check probe failed: %r", error)
        return False
    return bool(probe.result())


def _in_loop_thread(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _at(values: list, i: int) -> Any:
    return values[i] if i < len(values) else None


def _clip(text: Optional[str], limit: int = 200) -> Optional[str]:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + "..."


def _child_alive(process: Any) -> bool:
    """A killed child can be a zombie for a moment before its parent reaps it: count that as dead."""
    if not process.is_alive():
        return False
    try:
        return psutil.Process(process.pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
