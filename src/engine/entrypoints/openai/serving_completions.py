"""POST /v1/completions: OpenAI legacy completions over TokenizerManager.generate_request."""

from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Dict, List, Optional, Union

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.entrypoints.openai.logprobs import to_completion_logprobs
from engine.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    random_uuid,
)
from engine.entrypoints.openai.utils import (
    DEFAULT_CUSTOM_LABELS_HEADER,
    ClientConnection,
    ChoiceCursor,
    OrjsonResponse,
    abort_error,
    as_output_list,
    build_sampling_params,
    create_error_response,
    error_response_from_exception,
    final_output,
    finish_reason_to_openai,
    header_extras,
    last_hidden_state,
    make_usage,
    prime_stream,
    sse_event,
    sse_stream,
)
from engine.errors import EngineRequestError
from engine.tokenizer.request_normalizer import GenerateReqInput
from engine.tokenizer.lora_registry import loaded_adapters
from engine.tokenizer.tokenizer_manager_protocol import GenerateOutputs, TokenizerManagerProtocol

logger = logging.getLogger(__name__)


class OpenAIServingCompletion:
    def __init__(self, tokenizer_manager: TokenizerManagerProtocol,
                 labels_header: str = DEFAULT_CUSTOM_LABELS_HEADER) -> None:
        self.tokenizer_manager = tokenizer_manager
        self.labels_header = labels_header  # --tokenizer-metrics-custom-labels-header

    # ------------------------------------------------------------------ entry
    async def handle_request(self, request: CompletionRequest, raw_request: Request) -> Response:
        request_id = request.rid or f"cmpl-{random_uuid()}"
        prompts = _split_prompts(request.prompt)
        batched = _is_batch(request.prompt)
        obj = self._build_generate_input(request, prompts, batched, request_id,
                                         header_extras(raw_request, self.labels_header))
        stream = self.tokenizer_manager.generate_request(obj, ClientConnection(raw_request))
        if request.stream:
            first, error = await prime_stream(stream)
            if error is not None:
                return error
            body = self._stream_body(request, prompts, request_id, first, stream)
            return StreamingResponse(body, media_type="text/event-stream")
        try:
            result = await final_output(stream)
        except (EngineRequestError, ValueError) as exc:
            return error_response_from_exception(exc)
        return self._full_response(request, prompts, request_id, as_output_list(result))

    def _build_generate_input(
        self, request: CompletionRequest, prompts: List[Union[str, List[int]]], batched: bool, request_id: str,
        extras: Dict[str, Any],
    ) -> GenerateReqInput:
        want_logprobs = request.logprobs is not None
        text_prompts = isinstance(prompts[0], str)
        prompt_value: Any = prompts if batched else prompts[0]
        return GenerateReqInput(
            text=prompt_value if text_prompts else None,
            input_ids=None if text_prompts else prompt_value,
            sampling_params=build_sampling_params(request, request.max_tokens),
            rid=[f"{request_id}_{i}" for i in range(len(prompts))] if batched else request_id,
            stream=request.stream,
            return_logprob=want_logprobs,
            # echo with logprobs also reports the prompt's logprobs, from its first token.
            logprob_start_len=0 if (want_logprobs and request.echo) else -1,
            top_logprobs_num=request.logprobs or 0,
            return_text_in_logprobs=True,
            **request.generate_extras(loaded_adapters(self.tokenizer_manager.lora_registry)),
            **extras,
        )

    # ------------------------------------------------------------------ helpers
    def _decode(self, token_id: int) -> str:
        tokenizer = self.tokenizer_manager.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    def _prompt_text(self, prompt: Union[str, List[int]]) -> str:
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.tokenizer_manager.tokenizer
        return tokenizer.decode(prompt) if tokenizer is not None else ""

    def _logprobs(
        self, request: CompletionRequest, output: Dict[str, Any], include_prompt: bool, text_offset: int,
        new_tokens: Optional[List[Any]] = None, new_tops: Optional[List[Any]] = None,
    ) -> Optional[CompletionLogProbs]:
        if request.logprobs is None:
            return None
        meta = output["meta_info"]
        tokens = list(meta.get("output_token_logprobs") or []) if new_tokens is None else list(new_tokens)
        tops = list(meta.get("output_top_logprobs") or []) if new_tops is None else list(new_tops)
        if include_prompt:
            tokens = list(meta.get("input_token_logprobs") or []) + tokens
            input_tops = list(meta.get("input_top_logprobs") or [])
            input_tops += [None] * (len(meta.get("input_token_logprobs") or []) - len(input_tops))
            tops = input_tops + tops
        return to_completion_logprobs(tokens, tops, self._decode, text_offset)

    # ------------------------------------------------------------------ non-streaming
    def _full_response(
        self, request: CompletionRequest, prompts: List[Union[str, List[int]]], request_id: str,
        outputs: List[Dict[str, Any]],
    ) -> Response:
        choices = []
        for index, output in enumerate(outputs):
            finish = output["meta_info"].get("finish_reason")
            aborted = abort_error(finish)
            if aborted is not None:
                return create_error_response(*aborted)
            prefix = self._prompt_text(prompts[index // request.n]) if request.echo else ""
            finish_reason, matched = finish_reason_to_openai(finish)
            choices.append(
                CompletionResponseChoice(
                    index=index,
                    text=prefix + output["text"],
                    logprobs=self._logprobs(request, output, request.echo, 0),
                    finish_reason=finish_reason,
                    matched_stop=matched,
                    hidden_states=last_hidden_state(output["meta_info"]),
                )
            )
        response = CompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=self.tokenizer_manager.served_model_name,
            choices=choices,
            usage=make_usage(outputs, request.n),
        )
        return OrjsonResponse(response.model_dump())

    # ------------------------------------------------------------------ streaming
    def _stream_body(
        self, request: CompletionRequest, prompts: List[Union[str, List[int]]], request_id: str,
        first: Any, stream: GenerateOutputs,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = self.tokenizer_manager.served_model_name
        num_choices = len(prompts) * request.n
        cursors = [ChoiceCursor() for _ in range(num_choices)]
        echoed = [False] * num_choices
        chars_sent = [0] * num_choices
        def render(output: Dict[str, Any]) -> List[bytes]:
            index = int(output.get("index", 0))
            delta, new_tokens, new_tops = cursors[index].advance(output)
            include_prompt = request.echo and not echoed[index]
            if include_prompt:
                echoed[index] = True
                delta = self._prompt_text(prompts[index // request.n]) + delta
            finish_reason, matched = finish_reason_to_openai(output["meta_info"].get("finish_reason"))
            if not delta and finish_reason is None and not new_tokens:
                return []
            # Offsets are positions in the text this client has seen, echoed prompt included.
            logprobs = self._logprobs(request, output, include_prompt, chars_sent[index], new_tokens, new_tops)
            chars_sent[index] += len(delta)
            hidden = last_hidden_state(output["meta_info"]) if finish_reason else None
            choice = CompletionResponseStreamChoice(index=index, text=delta, logprobs=logprobs,
                                                    finish_reason=finish_reason, matched_stop=matched,
                                                    hidden_states=hidden)
            return [sse_event(CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice]).model_dump())]

        def usage() -> List[bytes]:
            if request.stream_options is None or not request.stream_options.include_usage:
                return []
            outputs = [c.last_output for c in cursors if c.last_output is not None]
            totals = make_usage(outputs, request.n) if len(outputs) == num_choices else None
            return [sse_event(CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[], usage=totals).model_dump())]

        return sse_stream(first, stream, render, epilogue=usage)


def _is_batch(prompt: Any) -> bool:
    """A list of prompts (texts or token lists), as opposed to one text or one token list."""
    return isinstance(prompt, list) and isinstance(prompt[0], (str, list))


def _split_prompts(prompt: Any) -> List[Union[str, List[int]]]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)

