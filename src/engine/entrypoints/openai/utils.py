"""Helpers shared by the HTTP handlers: error bodies, SSE framing, finish reasons, usage, sampling.

Every rejection goes through `create_error_response` so that all errors have the OpenAI shape
`{"object": "error", "message", "type", "param", "code"}` whatever layer produced them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable, Dict, Iterable, List, Optional, Tuple, Union

import orjson
from fastapi.responses import Response

from engine.entrypoints.openai.protocol import PromptTokensDetails, SamplingFields, UsageInfo
from engine.errors import EngineRequestError
from engine.tokenizer.tokenizer_manager_protocol import GenerateOutputs

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestEntityTooLarge",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    499: "ClientDisconnected",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

SSE_DONE = b"data: [DONE]\n\n"
# SGLang's header for the routing key of an OpenAI request (its gateway sets it).
ROUTING_KEY_HEADER = "x-smg-routing-key"
DEFAULT_CUSTOM_LABELS_HEADER = "x-custom-labels"


def header_extras(request: Any, labels_header: str) -> Dict[str, Any]:
    """What SGLang reads from an OpenAI request's headers: the routing key, and the custom metric
    labels (a JSON object in `labels_header`; anything else there is ignored, as SGLang)."""
    headers = request.headers
    labels: Any = None
    raw = headers.get(labels_header) if labels_header else None
    if raw:
        try:
            labels = orjson.loads(raw)
        except orjson.JSONDecodeError:
            logger.debug("Ignoring %s: not JSON", labels_header)
    return {"routing_key": headers.get(ROUTING_KEY_HEADER),
            "custom_labels": labels if isinstance(labels, dict) else None}


class OrjsonResponse(Response):
    """JSON via orjson: fast, and non-finite floats (a -inf logprob) become null, not invalid JSON."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


# ---------------------------------------------------------------------------- errors
def error_type_for(status_code: int) -> str:
    return _ERROR_TYPES.get(status_code, "InternalServerError" if status_code >= 500 else "BadRequestError")


def error_body(message: str, status_code: int = 400, err_type: Optional[str] = None) -> Dict[str, Any]:
    return {
        "object": "error",
        "message": message,
        "type": err_type or error_type_for(status_code),
        "param": None,
        "code": status_code,
    }


def create_error_response(
    message: str, status_code: int = 400, err_type: Optional[str] = None
) -> OrjsonResponse:
    return OrjsonResponse(error_body(message, status_code, err_type), status_code=status_code)


def error_response_from_exception(exc: Exception) -> OrjsonResponse:
    """The response for an exception raised by the TokenizerManager while handling a request."""
    if isinstance(exc, EngineRequestError):
        return create_error_response(exc.message, exc.status_code, exc.err_type)
    # SGLang answers ValueError with 400 too: it is how validation deep in the stack reports.
    return create_error_response(str(exc), 400)


def abort_error(finish_reason: Optional[Dict[str, Any]]) -> Optional[Tuple[str, int]]:
    """(message, status) when the server aborted the request with an error status, else None.

    An abort without a status code was asked for by a client (`/abort_request`, the Engine's
    `abort_request`): as in SGLang it is a normal answer carrying the partial output and
    finish_reason abort, not an error.
    """
    if not finish_reason or finish_reason.get("type") != "abort":
        return None
    status = finish_reason.get("status_code")
    if status is None:
        return None
    return finish_reason.get("message") or "The request was aborted.", int(status)


def sse_error_chunk(message: str, status_code: int) -> bytes:
    return sse_event({"error": error_body(message, status_code)})


# ---------------------------------------------------------------------------- the client
class ClientConnection:
    """The HTTP client of one request, for the TokenizerManager's disconnect checks.

    Starlette's `Request.is_disconnected()` opens and cancels an anyio cancel scope, and the
    cancellation formats the task's repr (inspecting every callback's source): ~0.1 ms per call,
    a tenth of the main process with a thousand open streams checked every second. Here one task
    per request waits on the ASGI receive channel, which yields `http.disconnect` when the client
    goes (or the response is complete: the task ends then too), and `is_disconnected()` reads a
    flag. Started once the handler runs, when FastAPI has read the body: what is left on the
    channel is the disconnect.
    """

    def __init__(self, request: Any) -> None:
        self._gone = False
        self._task = asyncio.ensure_future(self._watch(request.receive))

    async def _watch(self, receive: Callable[[], Any]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self._gone = True
                return

    async def is_disconnected(self) -> bool:
        return self._gone


# ---------------------------------------------------------------------------- SSE
def sse_event(payload: Union[Dict[str, Any], List[Any]]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def prime_stream(
    stream: GenerateOutputs,
) -> Tuple[Optional[Any], Optional[OrjsonResponse]]:
    """Pull the first item before any byte is sent.

    The manager validates before it yields, so a bad request surfaces here and can still get a
    real HTTP error status instead of an error inside a 200 stream (vllm#16445). So does a
    request the scheduler refused before generating anything (a full queue: 503).
    Returns (first_item, None) or (None, error_response).
    """
    try:
        first = await stream.__anext__()
    except (EngineRequestError, ValueError) as exc:
        return None, error_response_from_exception(exc)
    except StopAsyncIteration:
        return None, create_error_response("The engine produced no output.", 500)
    # Rejected before any token (queue full, shutting down): still time for a real status.
    for output in as_output_list(first):
        aborted = abort_error(output.get("meta_info", {}).get("finish_reason"))
        if aborted is not None and not output.get("output_ids"):
            await close_stream(stream)
            return None, create_error_response(*aborted)
    return first, None


# ---------------------------------------------------------------------------- outputs
def finish_reason_to_openai(finish_reason: Optional[Dict[str, Any]]) -> Tuple[Optional[str], Any]:
    """SGLang finish reason -> (OpenAI finish_reason, matched stop)."""
    if not finish_reason:
        return None, None
    kind = finish_reason.get("type")
    if kind == "stop":
        return "stop", finish_reason.get("matched")
    if kind == "length":
        return "length", None
    return kind, None


def make_usage(outputs: List[Dict[str, Any]], n: int) -> UsageInfo:
    """Usage over request-major outputs where each prompt appears `n` times in a row.

    A prompt is counted once however many choices it has; its cached tokens are the fewest any
    of its sub-requests saw, since the siblings hit the cache the first one filled (sgl#5525).
    """
    prompt_tokens = 0
    cached_tokens = 0
    for start in range(0, len(outputs), n):
        group = [o["meta_info"] for o in outputs[start : start + n]]
        prompt = int(group[0].get("prompt_tokens", 0))
        prompt_tokens += prompt
        cached_tokens += min(prompt, min(int(m.get("cached_tokens", 0) or 0) for m in group))
    completion_tokens = sum(int(o["meta_info"].get("completion_tokens", 0)) for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def build_sampling_params(request: SamplingFields, max_new_tokens: Optional[int]) -> Dict[str, Any]:
    """OpenAI fields -> SGLang sampling_params; unset fields are left to the engine's defaults."""
    params: Dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": request.min_tokens or None,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "frequency_penalty": request.frequency_penalty,
        "presence_penalty": request.presence_penalty,
        "repetition_penalty": request.repetition_penalty,
        "stop": request.stop,
        "stop_token_ids": request.stop_token_ids,
        "sampling_seed": request.seed,
        "logit_bias": request.logit_bias or None,
        "n": request.n if request.n > 1 else None,
        "json_schema": request.json_schema,
        "regex": request.regex,
        "ebnf": request.ebnf,
        "stop_regex": request.stop_regex,
        "custom_params": request.custom_params,
    }
    from_format = request.response_format.to_constraint() if request.response_format is not None else None
    if from_format is not None:  # SamplingFields refuses it together with another constraint
        params[from_format[0]] = from_format[1]
    params = {key: value for key, value in params.items() if value is not None}
    # Booleans are always sent: False is a meaningful choice that must override nothing.
    params["ignore_eos"] = request.ignore_eos
    params["skip_special_tokens"] = request.skip_special_tokens
    params["spaces_between_special_tokens"] = request.spaces_between_special_tokens
    params["no_stop_trim"] = request.no_stop_trim
    return params


def last_hidden_state(meta: Dict[str, Any]) -> Optional[List[float]]:
    """An OpenAI choice's `hidden_states`: the last position's vector (SGLang), or [] when there is
    only the prompt's block (a "full" answer of one token)."""
    states = meta.get("hidden_states")
    if not states:
        return None if states is None else []
    last = states[-1]
    # "full" starts with the prompt's [len, hidden] block; every other entry is one vector.
    return last if last and not isinstance(last[0], list) else []


def as_output_list(result: Union[Dict[str, Any], List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    return result if isinstance(result, list) else [result]


async def iter_outputs(first: Any, stream: AsyncIterator[Any]) -> AsyncIterator[Dict[str, Any]]:
    """Every output dict of a generate stream, starting with the already received `first`."""
    if first is not None:
        for output in as_output_list(first):
            yield output
    async for result in stream:
        for output in as_output_list(result):
            yield output


class ChoiceCursor:
    """What has been streamed so far for one choice; turns cumulative outputs into deltas.

    The manager reports text, and logprob lists, cumulatively (like SGLang); a client wants only
    what is new. Concatenating the deltas gives back exactly the final text.
    """

    __slots__ = ("text_sent", "logprobs_sent", "finished", "last_output")

    def __init__(self) -> None:
        self.text_sent = 0
        self.logprobs_sent = 0
        self.finished = False
        self.last_output: Optional[Dict[str, Any]] = None

    def advance(self, output: Dict[str, Any]) -> Tuple[str, List[Any], List[Any]]:
        """(new text, new output token logprobs, new output top logprobs) since the last call."""
        text = output.get("text", "")
        delta = text[self.text_sent :]
        self.text_sent = len(text)
        meta = output.get("meta_info", {})
        tokens = meta.get("output_token_logprobs") or []
        tops = meta.get("output_top_logprobs") or []
        new_tokens = tokens[self.logprobs_sent :]
        new_tops = tops[self.logprobs_sent :]
        self.logprobs_sent = len(tokens)
        self.last_output = output
        if meta.get("finish_reason") is not None:
            self.finished = True
        return delta, new_tokens, new_tops


async def close_stream(stream: GenerateOutputs) -> None:
    """Close the manager's async generator now rather than at garbage collection.

    Its cleanup aborts unfinished requests in the scheduler, which must happen as soon as the
    client is gone, not whenever the generator object happens to be collected (sgl#37833).
    """
    try:
        await stream.aclose()
    except Exception:  # it already failed; the error was reported to the client
        logger.debug("closing the output stream failed", exc_info=True)


async def final_output(stream: GenerateOutputs) -> Any:
    """The one output of a non-streaming request, which the manager yields when it ends.

    The manager also watches the client: one that leaves gets its request aborted in the
    scheduler and an EngineRequestError(499) here (no ghost requests decoding to max_tokens,
    sgl#37833).
    """
    try:
        return await stream.__anext__()
    finally:
        await close_stream(stream)


async def sse_stream(
    first: Any,
    stream: GenerateOutputs,
    render: Callable[[Dict[str, Any]], Iterable[bytes]],
    prologue: Iterable[bytes] = (),
    epilogue: Callable[[], Iterable[bytes]] = lambda: (),
) -> AsyncIterator[bytes]:
    """The SSE body of every streaming route: `prologue`, then each output (one choice's update,
    from the primed `first` on) rendered into zero or more events, then `epilogue()` and
    `data: [DONE]`.

    A request the server aborted with an error status, or an error raised while streaming, ends
    the stream with an error event and [DONE]. Closing the manager's generator at the end aborts,
    on an early exit (client gone, abort, error), every sub-request still running.
    """
    try:
        for event in prologue:
            yield event
        async for output in iter_outputs(first, stream):
            aborted = abort_error(output["meta_info"].get("finish_reason"))
            if aborted is not None:
                yield sse_error_chunk(*aborted)
                break
            for event in render(output):
                yield event
        else:
            for event in epilogue():
                yield event
        yield SSE_DONE
    except (EngineRequestError, ValueError) as exc:
        status = exc.status_code if isinstance(exc, EngineRequestError) else 400
        yield sse_error_chunk(str(getattr(exc, "message", exc)), status)
        yield SSE_DONE
    finally:
        await close_stream(stream)
