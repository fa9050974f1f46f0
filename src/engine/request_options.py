"""A generation request's options, each declared once: from the HTTP body to the scheduler's `Req`.

`RequestOptions` holds what a client may ask of one sub-request besides its prompt and sampling
parameters (SGLang's field names and defaults). Each field's declaration is the whole contract:

- its name, type and default (None from a client always means the default, as in SGLang);
- its bounds, as `msgspec.Meta` constraints, checked when client values are converted;
- its scope: `PER_PROMPT` fields take one value for the request or, in a batch, a list with one
  value per prompt; `WHOLE_REQUEST` fields take one value for the whole request (a list is refused);
  the `_OPENAI` variants are also request fields of the OpenAI routes, passed through as they are.

Every layer is generic over it: /generate's body (`entrypoints/openai/protocol.py`), the OpenAI
routes' extras, `Engine.generate`'s keywords and `GenerateReqInput` (`tokenizer/request_normalizer.py`)
take every field by name and check it here; the sub-requests, `TokenizedGenerateReqInput` and the
scheduler's `Req` carry one `RequestOptions` value. A new option is one declaration below plus the
code that uses it. What only a server knows (the vocabulary, --dp-size, a server flag) is checked where
it is known (`RequestNormalizer.tokenize_one`, the scheduler's admission).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Annotated, Any, Dict, List, Literal, Mapping, Optional, Union

import msgspec
from msgspec import Meta

# token_ids_logprob: logprobs of at most this many ids per position (bounds the work one request asks).
MAX_TOKEN_IDS_LOGPROB = 1024
# routing_key: one string a request (it is counted against the running requests at every prefill).
MAX_ROUTING_KEY_LEN = 256
# lora_path: an adapter's name (engine/lora/lora_config.MAX_LORA_NAME_LEN).
MAX_LORA_PATH_LEN = 256


def _scope(per_prompt: bool, openai: bool) -> Meta:
    return Meta(extra={"per_prompt": per_prompt, "openai": openai})


PER_PROMPT = _scope(per_prompt=True, openai=False)
PER_PROMPT_OPENAI = _scope(per_prompt=True, openai=True)
WHOLE_REQUEST = _scope(per_prompt=False, openai=False)
WHOLE_REQUEST_OPENAI = _scope(per_prompt=False, openai=True)

Int64 = Annotated[int, Meta(ge=-(1 << 63), le=(1 << 63) - 1)]
TokenId = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
# return_hidden_states: false, true (every position's) or SGLang's "last" (the last position's only).
HiddenStatesMode = Union[bool, Literal["last"]]


class RequestOptions(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One sub-request's options (see the module docstring); the scheduler's Req owns its copy."""

    # Logprobs: of the output tokens; of the prompt from logprob_start_len (-1: none); the top
    # top_logprobs_num at each position; and those of the token_ids_logprob ids. Without
    # return_logprob the other three mean nothing (`effective()` clears them).
    return_logprob: Annotated[bool, PER_PROMPT] = False
    logprob_start_len: Annotated[int, Meta(ge=-1, le=(1 << 63) - 1), PER_PROMPT] = -1
    top_logprobs_num: Annotated[int, Meta(ge=0, le=(1 << 63) - 1), PER_PROMPT] = 0
    token_ids_logprob: Annotated[Optional[Annotated[List[TokenId], Meta(max_length=MAX_TOKEN_IDS_LOGPROB)]],
                                 PER_PROMPT] = None
    return_hidden_states: Annotated[HiddenStatesMode, PER_PROMPT_OPENAI] = False
    # A CustomLogitProcessor serialized by its to_str() (only with --enable-custom-logit-processor).
    custom_logit_processor: Annotated[Optional[str], PER_PROMPT_OPENAI] = None
    # Cache namespace: requests share cached prefixes only when both are equal ("" means none).
    extra_key: Annotated[Optional[str], PER_PROMPT_OPENAI] = None
    cache_salt: Annotated[Optional[str], PER_PROMPT_OPENAI] = None
    # PD disaggregation (SGLang's router adds them): the prefill's bootstrap server and the room
    # both halves of the request share; unused by a server in --disaggregation-mode null.
    bootstrap_host: Annotated[Optional[str], PER_PROMPT_OPENAI] = None
    bootstrap_port: Annotated[Optional[Annotated[int, Meta(ge=1, le=65535)]], PER_PROMPT_OPENAI] = None
    bootstrap_room: Annotated[Optional[Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]], PER_PROMPT_OPENAI] = None
    # Scheduling priority (with --enable-priority-scheduling).
    priority: Annotated[Optional[Int64], WHOLE_REQUEST_OPENAI] = None
    # The output starts inside the model's reasoning: its constraint (grammar) applies only after
    # the reasoning ends (the chat route decides it itself).
    require_reasoning: Annotated[bool, WHOLE_REQUEST] = False
    # DP-aware routing (SGLang's gateway): the replica that runs the request; None: the DP
    # controller's load balancer picks one. Checked against --dp-size by the TokenizerManager.
    routed_dp_rank: Annotated[Optional[Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]], WHOLE_REQUEST_OPENAI] = None
    # SGLang's routing key: --schedule-policy routing-key runs requests of the keys most frequent
    # among the running ones first (the OpenAI routes read it from a header).
    routing_key: Annotated[Optional[Annotated[str, Meta(max_length=MAX_ROUTING_KEY_LEN)]], WHOLE_REQUEST] = None
    # The LoRA adapter (its name, as loaded) this prompt runs with; None: the base model. The OpenAI
    # routes also take it from `model` ("base:adapter").
    lora_path: Annotated[Optional[Annotated[str, Meta(max_length=MAX_LORA_PATH_LEN)]], PER_PROMPT_OPENAI] = None
    # Every output also carries the prompt's token ids ("prompt_token_ids"), as tokenized.
    return_prompt_token_ids: Annotated[bool, WHOLE_REQUEST] = False

    def effective(self) -> "RequestOptions":
        """These options as they take effect: the logprob options cleared without return_logprob."""
        if self.return_logprob or (self.logprob_start_len == -1 and self.top_logprobs_num == 0
                                   and self.token_ids_logprob is None):
            return self
        return msgspec.structs.replace(self, logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None)


@dataclass(frozen=True)
class OptionField:
    """What the layers that take client values need to know of one RequestOptions field."""

    name: str
    default: Any
    per_prompt: bool  # a batch may give a list with one value per prompt
    openai: bool  # a request field of the OpenAI routes too
    list_valued: bool  # the value itself is a list: a per-prompt list is then a list of lists


def _is_list_type(tp: Any) -> bool:
    """True when `tp` (Annotated and Optional stripped) is a list type."""
    while typing.get_origin(tp) is Annotated:
        tp = typing.get_args(tp)[0]
    if typing.get_origin(tp) is Union:
        return any(_is_list_type(arg) for arg in typing.get_args(tp) if arg is not type(None))
    return typing.get_origin(tp) in (list, List)


def _option_fields() -> Dict[str, OptionField]:
    fields: Dict[str, OptionField] = {}
    for info in msgspec.structs.fields(RequestOptions):
        scopes = [m.extra for m in getattr(info.type, "__metadata__", ()) if isinstance(m, Meta) and m.extra]
        if len(scopes) != 1:
            raise TypeError(f"RequestOptions.{info.name} must declare its scope (PER_PROMPT, WHOLE_REQUEST, ...)")
        fields[info.name] = OptionField(name=info.name, default=info.default, per_prompt=scopes[0]["per_prompt"],
                                        openai=scopes[0]["openai"], list_valued=_is_list_type(info.type))
    return fields


# Every option by name, in declaration order.
OPTION_FIELDS: Dict[str, OptionField] = _option_fields()
OPENAI_OPTION_NAMES = tuple(name for name, f in OPTION_FIELDS.items() if f.openai)


class OptionError(ValueError):
    """A client value an option does not accept (the message names the option)."""


def convert_options(values: Mapping[str, Any]) -> RequestOptions:
    """RequestOptions from client values by option name (None: the default); OptionError if one is
    of the wrong type or out of its bounds."""
    try:
        return msgspec.convert({k: v for k, v in values.items() if v is not None}, RequestOptions)
    except msgspec.ValidationError as e:
        raise OptionError(_describe(e)) from None


def is_per_prompt_list(field: OptionField, value: Any) -> bool:
    """True when `value` gives `field` one value per prompt of a batch (rather than one for all)."""
    if not field.per_prompt or not isinstance(value, list):
        return False
    if not field.list_valued:
        return True
    # A list-valued option (token_ids_logprob) takes a list per prompt: [[1, 2], None, [3]].
    return bool(value) and all(item is None or isinstance(item, list) for item in value)


def per_prompt_values(field: OptionField, value: Any, num_prompts: int) -> List[Any]:
    """`field`'s client value for each of `num_prompts` prompts (None entries mean the default)."""
    if is_per_prompt_list(field, value):
        if len(value) != num_prompts:
            raise OptionError(f"{field.name} has {len(value)} entries but there are {num_prompts} prompts.")
        return list(value)
    return [value] * num_prompts


def check_client_value(field: OptionField, value: Any, batch: bool) -> Any:
    """`value` if `field` accepts it from a client, else OptionError. `batch`: a per-prompt list is
    allowed, and null means the default (the native API); otherwise one value of the field's type."""
    items = value if batch and is_per_prompt_list(field, value) else [value]
    for item in items:
        if item is None and batch:
            continue
        try:
            msgspec.convert({field.name: item}, RequestOptions)
        except msgspec.ValidationError as e:
            raise OptionError(_describe(e)) from None
    return value


def _describe(error: msgspec.ValidationError) -> str:
    """msgspec's "Expected `int` >= 0 - at `$.top_logprobs_num`" as "top_logprobs_num: expected ..."."""
    message = str(error)
    detail, sep, where = message.rpartition(" - at `$.")
    if not sep:
        return message
    name = where.rstrip("`").split("[", 1)[0].split(".", 1)[0]
    return f"{name}: {detail[:1].lower()}{detail[1:]}"
