"""Pydantic models of the HTTP edge: the OpenAI-compatible API and the native /generate body.

Range checks live here so that a bad value is rejected with HTTP 400 before anything reaches the
TokenizerManager; the limits (n <= 128, <= 32 stop strings, top_logprobs <= 20) bound the work one
request can ask for.
"""

from __future__ import annotations

import time
import uuid
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, Dict, List, Literal, Optional, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from engine.entrypoints.openai.protocol_tools import DeltaToolCall, ResponseFormat, Tool, ToolCall, ToolChoice
from engine.entrypoints.openai.sglang_fields import GENERATE_UNSUPPORTED, OPENAI_UNSUPPORTED, refuse_unsupported
from engine.request_options import OPENAI_OPTION_NAMES, OPTION_FIELDS, OptionError, OptionField, check_client_value
# The engine's bounds of fan-out (n) and stop lists, checked again by SamplingParams for every route.
from engine.sampling.sampling_params import MAX_N, MAX_STOP_STRINGS

MAX_TOP_LOGPROBS = 20


def random_uuid() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------- errors and usage
class ErrorResponse(BaseModel):
    object: str = "error"
    message: str
    type: str
    param: Optional[str] = None
    code: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False


# ---------------------------------------------------------------------------- models
class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "engine"
    root: Optional[str] = None
    parent: Optional[str] = None  # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: str = "list"
    data: List[ModelCard] = Field(default_factory=list)


# ---------------------------------------------------------------------------- request options
def _option_fields_model(name: str, native: bool) -> type[BaseModel]:
    """A model whose fields are the request options (request_options.py), each checked against its
    declaration. `native` (/generate): every option, a per-prompt one also as a list with one value
    per prompt, null meaning the default. Otherwise (the OpenAI routes): the options marked for them,
    one value each, with the declared default."""
    fields: Dict[str, Any] = {}
    for option in OPTION_FIELDS.values():
        if native or option.openai:
            check = BeforeValidator(partial(_check_option, option, native))
            fields[option.name] = (Annotated[Any, check], None if native else option.default)
    return create_model(name, **fields)


def _check_option(option: OptionField, native: bool, value: Any) -> Any:
    try:
        return check_client_value(option, value, batch=native)
    except OptionError as e:
        # A ValueError is a 400 naming the field already: keep only what is wrong with the value.
        raise ValueError(str(e).removeprefix(f"{option.name}: ")) from None


# The option fields' models, the bases of the request models below (to a type checker, plain models:
# their fields are read by name, generically).
if TYPE_CHECKING:
    _NativeOptionFields = BaseModel
    _OpenAIOptionFields = BaseModel
else:
    _NativeOptionFields = _option_fields_model("NativeOptionFields", native=True)
    _OpenAIOptionFields = _option_fields_model("OpenAIOptionFields", native=False)


# ---------------------------------------------------------------------------- sampling fields
class SamplingFields(_OpenAIOptionFields):
    """Sampling fields shared by completions and chat (OpenAI names plus SGLang's extras)."""

    # Unknown fields are ignored like OpenAI and SGLang do, so newer clients keep working. Strict
    # types: `true` or `"2"` where a number belongs is a client bug to report, not to coerce.
    model_config = ConfigDict(extra="ignore", strict=True)

    model: Optional[str] = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = None
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0, le=2.0)
    # A torch generator seed is an unsigned 64-bit value; bound it here, not in the scheduler.
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    logit_bias: Optional[Dict[str, float]] = None
    # SGLang extras
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: Optional[str] = None
    response_format: Optional[ResponseFormat] = None
    # SGLang's constraint extras: the output matches the regex / EBNF grammar / JSON schema text.
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    json_schema: Optional[str] = None
    # SGLang's per-request extras (docs/api.md); the request options among them (priority,
    # return_hidden_states, extra_key, cache_salt, PD bootstrap_*, routed_dp_rank, ...) are the fields
    # of the base model, from request_options.py.
    stop_regex: Optional[Union[str, List[str]]] = None
    custom_params: Optional[Dict[str, Any]] = None
    data_parallel_rank: Optional[int] = None  # SGLang's older name of routed_dp_rank

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, OPENAI_UNSUPPORTED)

    def generate_extras(self, lora_adapters: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
        """The fields that go to GenerateReqInput as they are: the options and data_parallel_rank;
        `lora_adapters` (the loaded LoRA adapters) let `model` name one."""
        extras = {name: getattr(self, name) for name in OPENAI_OPTION_NAMES}
        extras["data_parallel_rank"] = self.data_parallel_rank
        if self.model is not None and ":" in self.model:
            # SGLang's "base:adapter": the adapter named after the colon (it wins over lora_path).
            extras["lora_path"] = self.model.split(":", 1)[1]
        elif self.model is not None and extras["lora_path"] is None and lora_adapters and self.model in lora_adapters:
            extras["lora_path"] = self.model  # the adapter's name alone, as /v1/models lists it
        return extras

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: Optional[Union[str, List[str]]]) -> Optional[Union[str, List[str]]]:
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: Optional[List[int]]) -> Optional[List[int]]:
        if value is not None and any(t < 0 for t in value):
            raise ValueError("stop_token_ids must be non-negative token ids")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: Optional[int]) -> Optional[int]:
        # -1 is SGLang's "no top-k"; 0 means the same for clients written for vLLM and HF.
        if value is not None and not -1 <= value < 2**31:
            raise ValueError("top_k must be -1 or 0 (disabled) or a positive 32-bit integer")
        return value

    @model_validator(mode="after")
    def _check_stream_options(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        constraints = [name for name in ("regex", "ebnf", "json_schema") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            constraints.append("response_format")
        if len(constraints) > 1:
            raise ValueError(f"give at most one output constraint, got {', '.join(constraints)}")
        return self

    def has_constraint(self) -> bool:
        return any(getattr(self, name) is not None for name in ("regex", "ebnf", "json_schema")) or (
            self.response_format is not None and self.response_format.type != "text")


# ---------------------------------------------------------------------------- completions
class CompletionRequest(SamplingFields):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: int = Field(default=16, ge=1)
    logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("prompt must not be an empty list")
            if any(isinstance(p, list) and not p for p in value):
                raise ValueError("a token-id prompt must not be empty")
            if any(isinstance(t, int) and t < 0 for t in value):
                raise ValueError("token ids must be non-negative")
            if any(isinstance(p, list) and any(t < 0 for t in p) for p in value):
                raise ValueError("token ids must be non-negative")
        return value

    @field_validator("suffix")
    @classmethod
    def _check_suffix(cls, value: Optional[str]) -> Optional[str]:
        if value:
            raise ValueError("suffix is not supported")
        return value

    @model_validator(mode="after")
    def _check_best_of(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be unset or equal to n)")
        return self


class CompletionLogProbs(BaseModel):
    tokens: List[str] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    # A value is null where the alternative's logprob is unknown, as in token_logprobs.
    top_logprobs: List[Optional[Dict[str, Optional[float]]]] = Field(default_factory=list)
    text_offset: List[int] = Field(default_factory=list)


class _HiddenStatesChoice(BaseModel):
    """A choice that carries `hidden_states` (SGLang: the last token's) only when asked."""

    hidden_states: Optional[List[float]] = None

    @model_serializer(mode="wrap")
    def _drop_unset_hidden_states(self, handler: Any) -> Dict[str, Any]:
        data = handler(self)
        if self.hidden_states is None:
            data.pop("hidden_states", None)
        return data


class CompletionResponseChoice(_HiddenStatesChoice):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: List[CompletionResponseChoice]
    usage: UsageInfo


class CompletionResponseStreamChoice(_HiddenStatesChoice):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class CompletionStreamResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: List[CompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------------- chat
class ChatMessageContentTextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatCompletionMessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[Union[str, List[ChatMessageContentTextPart]]] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[List[Dict[str, Any]]] = None

    @model_validator(mode="after")
    def _check_content(self) -> "ChatCompletionMessageParam":
        # Only an assistant turn that carries tool calls may come without content.
        if self.content is None and not (self.role == "assistant"):
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


# Arguments of the chat template call that the request itself decides.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "return_dict"})


class ChatCompletionRequest(SamplingFields):
    messages: List[ChatCompletionMessageParam]
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Optional[List[Tool]] = None
    # Default: "auto" when tools are given, else "none" (OpenAI's rule).
    tool_choice: Optional[Union[Literal["none", "auto", "required"], ToolChoice]] = None
    parallel_tool_calls: bool = True
    # SGLang's reasoning fields: return the reasoning apart (reasoning_content), and stream it.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # Extra variables for the chat template (e.g. {"enable_thinking": false}), and SGLang's / vLLM's
    # continue_final_message: the last (assistant) message is continued instead of a new turn begun.
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    continue_final_message: bool = False

    @field_validator("messages")
    @classmethod
    def _check_messages(cls, value: List[ChatCompletionMessageParam]) -> List[ChatCompletionMessageParam]:
        if not value:
            raise ValueError("messages must not be empty")
        return value

    @model_validator(mode="after")
    def _check_chat_fields(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant message")
        reserved = sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (fields of the request)")
        self._check_tools()
        return self

    def _check_tools(self) -> None:
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError(f"tool_choice {self.resolved_tool_choice_name()!r} needs tools")
        names = [tool.function.name for tool in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools must have distinct function names")
        if isinstance(self.tool_choice, ToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names the function {self.tool_choice.function.name!r}, which is not "
                             f"among the tools ({', '.join(names)})")
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, ToolChoice)
        if forced and self.has_constraint():
            raise ValueError("response_format (or regex, ebnf, json_schema) cannot be combined with tool_choice "
                             "'required' or a named function: the tools' schemas already constrain the output")

    def resolved_tool_choice(self) -> Union[str, ToolChoice]:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def resolved_tool_choice_name(self) -> str:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, ToolChoice) else str(choice)

    def resolved_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TopLogprob(BaseModel):
    token: str
    bytes: Optional[List[int]] = None
    logprob: float


class ChatCompletionTokenLogprob(BaseModel):
    token: str
    bytes: Optional[List[int]] = None
    logprob: float
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: List[ChatCompletionTokenLogprob] = Field(default_factory=list)


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[ToolCall]] = None


class ChatCompletionResponseChoice(_HiddenStatesChoice):
    index: int
    message: ChatMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: List[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[List[DeltaToolCall]] = None


class ChatCompletionResponseStreamChoice(_HiddenStatesChoice):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    matched_stop: Union[None, int, str] = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: List[ChatCompletionResponseStreamChoice]
    usage: Optional[UsageInfo] = None


# ---------------------------------------------------------------------------- native SGLang API
class GenerateRequest(_NativeOptionFields):
    """Body of the native POST /generate; shapes are checked again by GenerateReqInput.normalize().

    Every field of SGLang's GenerateReqInput is accepted: the ones below are implemented or only
    informational; the others (sglang_fields.GENERATE_UNSUPPORTED) pass when unset and are a 400
    naming the field when used. A name SGLang does not know either is a 400 (a typo must not be
    ignored), except `model`, which SGLang's router adds to every request it forwards.
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    sampling_params: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]] = None
    rid: Optional[Union[str, List[str]]] = None
    stream: bool = False
    return_text_in_logprobs: bool = False
    # false: the request is left out of /metrics (SGLang's health probes send it).
    log_metrics: bool = True
    # true: --log-requests does not log this request's text (zero data retention).
    no_logs: bool = False
    # Informational: they label or route a request but do not change what is generated.
    model: Optional[str] = None
    session_id: Optional[str] = None
    conversation_id: Optional[str] = None
    custom_labels: Optional[Dict[str, str]] = None
    external_trace_header: Optional[Dict[str, Any]] = None
    kv_router_hint: Optional[Dict[str, Any]] = None
    received_time: Optional[float] = None
    http_worker_ipc: Optional[str] = None
    # The request options (return_logprob, ..., priority, PD bootstrap_*, routed_dp_rank, ...) are the
    # fields of the base model, from request_options.py: per-prompt ones take a list too.
    data_parallel_rank: Optional[int] = None  # SGLang's older name of routed_dp_rank

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        data = refuse_unsupported(data, GENERATE_UNSUPPORTED)
        if not isinstance(data, dict):
            return data
        # null means "the default" for every field (SGLang's clients send unset fields as null).
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].default is None}

    @model_validator(mode="after")
    def _check_prompt(self) -> "GenerateRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids must be given")
        if isinstance(self.text, list) and not self.text:
            raise ValueError("text must not be an empty list")
        if self.input_ids is not None:
            if not self.input_ids:
                raise ValueError("input_ids must not be empty")
            rows = self.input_ids if isinstance(self.input_ids[0], list) else [self.input_ids]
            if any(not row for row in rows):
                raise ValueError("input_ids must not contain an empty prompt")
            if any(t < 0 for row in rows for t in row):
                raise ValueError("input_ids must be non-negative token ids")
        params = self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params or {}]
        for one in params:
            _check_native_sampling_params(one)
        # A bound of the HTTP edge, like OpenAI's top_logprobs (the offline Engine goes up to the vocabulary).
        top_logprobs_num = getattr(self, "top_logprobs_num")  # an option field: its type was checked
        tops = top_logprobs_num if isinstance(top_logprobs_num, list) else [top_logprobs_num]
        if any(k is not None and k > MAX_TOP_LOGPROBS for k in tops):
            raise ValueError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]")
        return self


def _check_native_sampling_params(params: Dict[str, Any]) -> None:
    """Edge limits on a native sampling_params dict; the engine checks the rest (`n` included,
    before fanning out, for the offline Engine too): integers must fit the 64-bit fields they
    travel in, or encoding the request would fail deep in the server.
    """

    def check(value: Any, name: str) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, int) and not -(2**63) <= value < 2**63:
            raise ValueError(f"sampling_params.{name} is out of the 64-bit integer range")
        if isinstance(value, list):
            for item in value:
                check(item, name)
        if isinstance(value, dict):
            for key, item in value.items():
                check(item, f"{name}.{key}")

    for key, value in params.items():
        check(value, key)


class AbortRequestBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rid: str = ""
    abort_all: bool = False

    @model_validator(mode="after")
    def _check_target(self) -> "AbortRequestBody":
        # An empty rid is a prefix of every rid, so it would silently abort everything.
        if not self.rid and not self.abort_all:
            raise ValueError("give a rid or set abort_all to true")
        return self
