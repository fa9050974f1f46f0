"""POST /v1/chat/completions: messages -> chat template -> TokenizerManager.generate_request.

Tools and reasoning are handled by chat_parsing.py: the constraint a forced tool choice implies,
and the split of each choice's text into reasoning_content, content and tool_calls.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, AsyncIterator, Dict, List, Optional

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from engine.entrypoints.openai.chat_parsing import (
    ChatParsing,
    ChoiceDelta,
    ChoiceStreamParser,
    answer_starts_in_reasoning,
    parse_choice,
    tools_for_template,
)
from engine.entrypoints.openai.logprobs import to_chat_logprobs
from engine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
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
from engine.utils.tokenizer_utils import TokenBytes, make_token_bytes

logger = logging.getLogger(__name__)

# Enough tokens to hold an opening think tag and the newlines around it, however it tokenizes.
_PROMPT_TAIL_TOKENS = 16


class OpenAIServingChat:
    def __init__(self, tokenizer_manager: TokenizerManagerProtocol, tool_call_parser: Optional[str] = None,
                 reasoning_parser: Optional[str] = None, labels_header: str = DEFAULT_CUSTOM_LABELS_HEADER) -> None:
        self.tokenizer_manager = tokenizer_manager
        self.labels_header = labels_header  # --tokenizer-metrics-custom-labels-header
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self._token_bytes: Optional[TokenBytes] = None  # built at the first logprobs request

    # ------------------------------------------------------------------ entry
    async def handle_request(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        request_id = request.rid or f"chatcmpl-{random_uuid()}"
        try:
            parsing, tool_constraint = ChatParsing.for_request(request, self.tool_call_parser, self.reasoning_parser)
            prompt_ids = await self.tokenizer_manager.apply_chat_template_async(
                _template_messages(request), add_generation_prompt=True, tools=tools_for_template(request),
                continue_final_message=request.continue_final_message,
                template_kwargs=request.chat_template_kwargs,
            )
        except EngineRequestError as exc:
            return error_response_from_exception(exc)
        except Exception as exc:  # a template that rejects the conversation (jinja raise_exception)
            logger.info("chat template rejected request %s: %s", request_id, exc)
            return create_error_response(f"The chat template rejected the messages: {exc}", 400)
        in_reasoning = answer_starts_in_reasoning(self.reasoning_parser, request, self._prompt_tail(prompt_ids))
        parsing = dataclasses.replace(parsing, in_reasoning=in_reasoning)
        sampling_params = build_sampling_params(request, self._max_new_tokens(request, len(prompt_ids)))
        if tools_for_template(request) is not None:
            # As SGLang: with tools in play the special tokens stay in the text, where a model's
            # tool-call markers (Llama's <|python_tag|>, ...) are found by the parsers or the client.
            sampling_params["skip_special_tokens"] = False
        if tool_constraint is not None:
            sampling_params["json_schema"] = tool_constraint
        obj = GenerateReqInput(
            input_ids=list(prompt_ids),
            sampling_params=sampling_params,
            rid=request_id,
            stream=request.stream,
            return_logprob=request.logprobs,
            top_logprobs_num=request.top_logprobs or 0,
            return_text_in_logprobs=True,
            require_reasoning=in_reasoning,
            **request.generate_extras(loaded_adapters(self.tokenizer_manager.lora_registry)),
            **header_extras(raw_request, self.labels_header),
        )
        stream = self.tokenizer_manager.generate_request(obj, ClientConnection(raw_request))
        if request.stream:
            first, error = await prime_stream(stream)
            if error is not None:
                return error
            return StreamingResponse(
                self._stream_body(request, parsing, request_id, first, stream), media_type="text/event-stream"
            )
        try:
            result = await final_output(stream)
        except (EngineRequestError, ValueError) as exc:
            return error_response_from_exception(exc)
        return self._full_response(request, parsing, request_id, as_output_list(result))

    def _max_new_tokens(self, request: ChatCompletionRequest, prompt_len: int) -> int:
        explicit = request.resolved_max_tokens()
        if explicit is not None:
            return explicit
        # OpenAI's chat default is "as much as fits": the rest of the context window. A prompt
        # that does not fit at all is rejected by the manager with both lengths in the message.
        return max(int(self.tokenizer_manager.context_len) - prompt_len, 1)

    def _prompt_tail(self, prompt_ids: List[int]) -> str:
        """The text of the prompt's last tokens: where a thinking template leaves its opening tag."""
        tokenizer = self.tokenizer_manager.tokenizer
        return tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:])) if tokenizer is not None else ""

    def _decode(self, token_id: int) -> str:
        tokenizer = self.tokenizer_manager.tokenizer
        return tokenizer.decode([token_id]) if tokenizer is not None else ""

    def _logprobs(self, request: ChatCompletionRequest, tokens: List[Any], tops: List[Any]) -> Optional[ChoiceLogprobs]:
        if not request.logprobs:
            return None
        if self._token_bytes is None:
            tokenizer = self.tokenizer_manager.tokenizer
            self._token_bytes = make_token_bytes(tokenizer) if tokenizer is not None else (lambda token_id: None)
        return ChoiceLogprobs(content=to_chat_logprobs(tokens, tops, self._decode, self._token_bytes))

    # ------------------------------------------------------------------ non-streaming
    def _full_response(
        self, request: ChatCompletionRequest, parsing: ChatParsing, request_id: str, outputs: List[Dict[str, Any]]
    ) -> Response:
        choices = []
        for index, output in enumerate(outputs):
            meta = output["meta_info"]
            aborted = abort_error(meta.get("finish_reason"))
            if aborted is not None:
                return create_error_response(*aborted)
            finish_reason, matched = finish_reason_to_openai(meta.get("finish_reason"))
            parsed = parse_choice(parsing, output["text"])
            if parsed.tool_calls and finish_reason == "stop":
                finish_reason, matched = "tool_calls", None
            message = ChatMessage(role="assistant", content=parsed.content, reasoning_content=parsed.reasoning,
                                  tool_calls=parsed.tool_calls or None)
            choices.append(
                ChatCompletionResponseChoice(
                    index=index,
                    message=message,
                    logprobs=self._logprobs(
                        request, meta.get("output_token_logprobs") or [], meta.get("output_top_logprobs") or []
                    ),
                    finish_reason=finish_reason,
                    matched_stop=matched,
                    hidden_states=last_hidden_state(meta),
                )
            )
        response = ChatCompletionResponse(
            id=request_id,
            created=int(time.time()),
            model=self.tokenizer_manager.served_model_name,
            choices=choices,
            usage=make_usage(outputs, request.n),
        ).model_dump()
        for choice in response["choices"]:
            # Fields a plain answer does not have are left out rather than sent as null.
            for key in ("reasoning_content", "tool_calls"):
                if choice["message"][key] is None:
                    del choice["message"][key]
        return OrjsonResponse(response)

    # ------------------------------------------------------------------ streaming
    def _stream_body(
        self, request: ChatCompletionRequest, parsing: ChatParsing, request_id: str, first: Any,
        stream: GenerateOutputs,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        model = self.tokenizer_manager.served_model_name
        cursors = [ChoiceCursor() for _ in range(request.n)]
        parsers = [ChoiceStreamParser(parsing) for _ in range(request.n)]

        def chunk(index: int, delta: DeltaMessage, logprobs: Optional[ChoiceLogprobs] = None,
                  finish_reason: Optional[str] = None, matched: Any = None,
                  hidden_states: Optional[List[float]] = None) -> bytes:
            body = ChatCompletionStreamResponse(
                id=request_id,
                created=created,
                model=model,
                choices=[
                    ChatCompletionResponseStreamChoice(
                        index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason,
                        matched_stop=matched, hidden_states=hidden_states,
                    )
                ],
            ).model_dump()
            # A delta carries only what it has: {"role": ...}, {"content": ...}, {"tool_calls": ...} or {}.
            body["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
            return sse_event(body)

        def parsed_chunks(index: int, parsed: ChoiceDelta, logprobs: Optional[ChoiceLogprobs]) -> List[bytes]:
            deltas = []
            if parsed.reasoning:
                deltas.append(DeltaMessage(reasoning_content=parsed.reasoning))
            if parsed.content:
                deltas.append(DeltaMessage(content=parsed.content))
            if parsed.tool_calls:
                deltas.append(DeltaMessage(tool_calls=parsed.tool_calls))
            if not deltas and logprobs is not None:
                deltas.append(DeltaMessage(content=""))
            # The new tokens' logprobs ride on the first chunk they produced.
            return [chunk(index, d, logprobs if i == 0 else None) for i, d in enumerate(deltas)]

        def render(output: Dict[str, Any]) -> List[bytes]:
            index = int(output.get("index", 0))
            finish = output["meta_info"].get("finish_reason")
            delta, new_tokens, new_tops = cursors[index].advance(output)
            parsed = parsers[index].feed(delta, final=finish is not None)
            logprobs = self._logprobs(request, new_tokens, new_tops) if new_tokens else None
            events = parsed_chunks(index, parsed, logprobs)
            if finish is not None:
                finish_reason, matched = finish_reason_to_openai(finish)
                if parsers[index].has_tool_calls and finish_reason == "stop":
                    finish_reason, matched = "tool_calls", None
                events.append(chunk(index, DeltaMessage(), finish_reason=finish_reason, matched=matched,
                                    hidden_states=last_hidden_state(output["meta_info"])))
            return events

        def usage() -> List[bytes]:
            if request.stream_options is None or not request.stream_options.include_usage:
                return []
            outputs = [c.last_output for c in cursors if c.last_output is not None]
            totals = make_usage(outputs, request.n) if len(outputs) == request.n else None
            return [sse_event(ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[], usage=totals).model_dump())]

        roles = [chunk(index, DeltaMessage(role="assistant", content="")) for index in range(request.n)]
        return sse_stream(first, stream, render, prologue=roles, epilogue=usage)


def _template_messages(request: ChatCompletionRequest) -> List[Dict[str, Any]]:
    """Pydantic messages -> the plain dicts a Hugging Face chat template expects."""
    messages = []
    for message in request.messages:
        item: Dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            item["tool_calls"] = message.tool_calls
        messages.append(item)
    return messages

