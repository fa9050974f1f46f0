"""The OpenAI protocol models and the pure helpers behind the HTTP handlers."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from engine.entrypoints.openai.logprobs import (
    MIN_LOGPROB,
    to_chat_logprobs,
    to_completion_logprobs,
)
from engine.entrypoints.openai.protocol import (
    MAX_N,
    AbortRequestBody,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from engine.entrypoints.openai.utils import (
    SSE_DONE,
    ChoiceCursor,
    OrjsonResponse,
    abort_error,
    build_sampling_params,
    error_body,
    final_output,
    finish_reason_to_openai,
    make_usage,
    sse_error_chunk,
    sse_event,
    sse_stream,
)
from engine.errors import EngineRequestError

USER = [{"role": "user", "content": "hi"}]


def test_completion_defaults() -> None:
    req = CompletionRequest(prompt="hi")
    assert req.max_tokens == 16 and req.n == 1 and req.logprobs is None and not req.echo
    assert req.model is None  # any model name, or none, is accepted


@pytest.mark.parametrize("prompt", ["x", ["x", "y"], [1, 2], [[1], [2, 3]]])
def test_completion_prompt_forms(prompt) -> None:
    assert CompletionRequest(prompt=prompt).prompt == prompt


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt": []},
        {"prompt": [[1], []]},
        {"prompt": "x", "n": MAX_N + 1},
        {"prompt": "x", "n": "2"},  # strict: no coercion of strings
        {"prompt": "x", "max_tokens": True},
        {"prompt": "x", "logprobs": 21},
        {"prompt": "x", "top_k": -2},
        {"prompt": "x", "suffix": "s"},
        {"prompt": "x", "stop": ["a"] * 33},
        {"prompt": "x", "stream_options": {"include_usage": True}},
        {"prompt": "x", "stop_token_ids": [-3]},
    ],
)
def test_completion_rejects(fields) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest(**fields)


def test_top_k_zero_and_minus_one_mean_off() -> None:
    assert CompletionRequest(prompt="x", top_k=0).top_k == 0
    assert CompletionRequest(prompt="x", top_k=-1).top_k == -1


def test_chat_request_rules() -> None:
    req = ChatCompletionRequest(messages=USER, max_tokens=5, max_completion_tokens=3)
    assert req.resolved_max_tokens() == 3
    assert ChatCompletionRequest(messages=USER).resolved_max_tokens() is None
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}])
    assert parts.messages[0].text() == "a\nb"
    for bad in (
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": USER, "top_logprobs": 3},
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        {"messages": USER, "response_format": {"type": "json_schema"}},
        {"messages": USER, "tools": [{"type": "function"}]},
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest(**bad)


def test_native_generate_request() -> None:
    assert GenerateRequest(text="a").stream is False
    for bad in ({}, {"text": "a", "input_ids": [1]}, {"input_ids": [[1], []]}, {"text": []},
                {"text": "a", "unknown": 1}, {"text": "a", "top_logprobs_num": -1}):
        with pytest.raises(ValidationError):
            GenerateRequest(**bad)
    with pytest.raises(ValidationError):
        AbortRequestBody()
    assert AbortRequestBody(abort_all=True).rid == ""


def test_build_sampling_params_leaves_unset_to_engine_defaults() -> None:
    params = build_sampling_params(CompletionRequest(prompt="x"), 16)
    assert params == {"max_new_tokens": 16, "ignore_eos": False, "skip_special_tokens": True,
                      "spaces_between_special_tokens": True, "no_stop_trim": False}
    params = build_sampling_params(CompletionRequest(prompt="x", n=3, seed=1, logit_bias={"5": 1.0}), 4)
    assert params["n"] == 3 and params["sampling_seed"] == 1 and params["logit_bias"] == {"5": 1.0}


def test_finish_reason_mapping() -> None:
    assert finish_reason_to_openai(None) == (None, None)
    assert finish_reason_to_openai({"type": "stop", "matched": 2}) == ("stop", 2)
    assert finish_reason_to_openai({"type": "stop", "matched": "END"}) == ("stop", "END")
    assert finish_reason_to_openai({"type": "length", "length": 4}) == ("length", None)
    assert abort_error({"type": "stop"}) is None
    assert abort_error({"type": "abort", "message": "gone", "status_code": 503}) == ("gone", 503)
    # No status code: a client's abort, answered normally with finish_reason "abort" (SGLang).
    assert abort_error({"type": "abort", "message": "Aborted", "status_code": None}) is None
    assert finish_reason_to_openai({"type": "abort", "message": "Aborted", "status_code": None}) == ("abort", None)


def _out(prompt: int, completion: int, cached: int) -> dict:
    return {"meta_info": {"prompt_tokens": prompt, "completion_tokens": completion, "cached_tokens": cached}}


def test_usage_counts_each_prompt_once_with_n() -> None:
    # Two prompts, n = 2: the second sibling of each prompt hits the cache the first one filled.
    outputs = [_out(10, 3, 0), _out(10, 4, 10), _out(6, 1, 2), _out(6, 2, 6)]
    usage = make_usage(outputs, n=2)
    assert usage.prompt_tokens == 16 and usage.completion_tokens == 10 and usage.total_tokens == 26
    assert usage.prompt_tokens_details.cached_tokens == 2


def test_completion_logprobs_format() -> None:
    tokens = [[None, 1, "He"], [-0.25, 2, "llo"], [float("-inf"), 3, "!"]]
    tops = [None, [[-0.25, 2, "llo"], [-2.0, 9, "y"]], [[-1.0, 4, "?"]]]
    lp = to_completion_logprobs(tokens, tops, decode=lambda t: "?", text_offset=5)
    assert lp.tokens == ["He", "llo", "!"]
    assert lp.token_logprobs == [None, -0.25, MIN_LOGPROB]
    assert lp.top_logprobs[0] is None
    assert lp.top_logprobs[1] == {"llo": -0.25, "y": -2.0}
    # The chosen token is always present, even when it was not in the top list.
    assert lp.top_logprobs[2] == {"?": -1.0, "!": MIN_LOGPROB}
    assert lp.text_offset == [5, 7, 10]


def test_chat_logprobs_format_uses_decode_when_text_missing() -> None:
    content = to_chat_logprobs([[-0.5, 7, None]], [[[-0.5, 7, None], [-1.5, 8, "é"]]], decode=lambda t: f"<{t}>")
    assert content[0].token == "<7>" and content[0].bytes == list(b"<7>")
    assert content[0].top_logprobs[1].token == "é" and content[0].top_logprobs[1].bytes == [0xC3, 0xA9]


def test_orjson_response_never_emits_invalid_json() -> None:
    body = OrjsonResponse({"x": float("-inf"), "y": float("nan")}).body
    assert body == b'{"x":null,"y":null}'


def test_error_body_shape() -> None:
    assert error_body("bad", 400) == {"object": "error", "message": "bad", "type": "BadRequestError",
                                      "param": None, "code": 400}
    assert error_body("busy", 503)["type"] == "ServiceUnavailableError"


@given(st.lists(st.text(min_size=0, max_size=4), min_size=1, max_size=12))
def test_choice_cursor_deltas_concatenate_to_final_text(pieces) -> None:
    cursor = ChoiceCursor()
    text, sent = "", []
    for i, piece in enumerate(pieces):
        text += piece
        last = i == len(pieces) - 1
        logprobs = [[-1.0, j, "t"] for j in range(i + 1)]
        delta, new_tokens, _ = cursor.advance({"text": text, "meta_info": {
            "finish_reason": {"type": "length"} if last else None, "output_token_logprobs": logprobs}})
        sent.append(delta)
        assert len(new_tokens) == 1 and new_tokens[0][1] == i
    assert "".join(sent) == text and cursor.finished


def test_min_logprob_is_finite() -> None:
    assert math.isfinite(MIN_LOGPROB)


def _generator(outputs, error=None, closed=None):
    async def gen():
        try:
            for output in outputs:
                yield output
            if error is not None:
                raise error
            await asyncio.Event().wait()  # never ends by itself, like a request still running
        finally:
            if closed is not None:
                closed.append(True)  # where the real manager aborts what is still running
    return gen()


def test_final_output_returns_the_output_and_closes_the_stream() -> None:
    closed: list = []

    async def run() -> None:
        assert await final_output(_generator([{"text": "ok"}], closed=closed)) == {"text": "ok"}
        with pytest.raises(EngineRequestError, match="nope"):
            await final_output(_generator([], error=EngineRequestError("nope", 499)))

    asyncio.run(run())
    assert closed == [True]


def _update(index: int, text: str, finish=None) -> dict:
    return {"index": index, "text": text, "meta_info": {"finish_reason": finish}}


def _events(first, stream, **kwargs) -> list:
    async def run() -> list:
        body = sse_stream(first, stream, lambda o: [sse_event({"t": o["text"]})], **kwargs)
        return [event async for event in body]

    return asyncio.run(run())


def test_sse_stream_frames_prologue_outputs_epilogue_then_done() -> None:
    closed: list = []
    stream = _generator([_update(0, "b", {"type": "length"})], error=None, closed=closed)

    async def finite():
        async for item in stream:
            yield item
            return

    events = _events(_update(0, "a"), finite(), prologue=[b"data: start\n\n"],
                     epilogue=lambda: [b"data: usage\n\n"])
    assert events == [b"data: start\n\n", sse_event({"t": "a"}), sse_event({"t": "b"}), b"data: usage\n\n",
                      SSE_DONE]


def test_sse_stream_ends_with_an_error_event_on_a_server_abort_or_an_error() -> None:
    closed: list = []
    aborted = _update(0, "partial", {"type": "abort", "message": "queue full", "status_code": 503})
    events = _events(_update(0, "a"), _generator([aborted], closed=closed), epilogue=lambda: [b"never"])
    assert events[:2] == [sse_event({"t": "a"}), sse_error_chunk("queue full", 503)]
    assert events[2:] == [SSE_DONE] and closed == [True]  # the rest of the request is aborted
    events = _events(_update(0, "a"), _generator([], error=EngineRequestError("gone", 499)))
    assert events[1:] == [sse_error_chunk("gone", 499), SSE_DONE]
    # A client abort (no status) is a normal end: its partial output, then [DONE].
    client_abort = _update(0, "part", {"type": "abort", "message": "Aborted"})
    stream = _generator([client_abort])

    async def finite():
        async for item in stream:
            yield item
            return

    assert _events(_update(0, "a"), finite()) == [sse_event({"t": "a"}), sse_event({"t": "part"}), SSE_DONE]
