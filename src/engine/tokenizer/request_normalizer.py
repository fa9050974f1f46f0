"""Request normalisation: what the TokenizerManager does to a request before sending it.

`GenerateReqInput` is the /generate (and offline Engine) request; `normalize()` turns it into one
entry per sub-request (a batch of prompts, each fanned out into its `n` samples).
`RequestNormalizer` validates and tokenizes the sub-requests against the model's limits, and
renders chat messages through the chat template. The TokenizerManager runs both on a thread of
its own, off the event loop.

What one request may cost here is bounded before it is spent (docs/security.md): a text far longer
than the context is refused before it is tokenized (`bound_text`), and the input logprobs a request
asks are bounded in positions and values (`check_input_logprob_cost`).
"""

from __future__ import annotations

import inspect
import logging
import os
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

import msgspec

from engine.errors import EngineRequestError
from engine.io_struct import TokenizedGenerateReqInput
from engine.request_options import (
    OPTION_FIELDS,
    OptionError,
    RequestOptions,
    convert_options,
    is_per_prompt_list,
    per_prompt_values,
)
from engine.sampling.sampling_params import check_parallel_sample_num

logger = logging.getLogger(__name__)

# A text of more than context_len * MAX_CHARS_PER_TOKEN characters is refused before it is tokenized
# (with --allow-auto-truncate, cut to that length first): tokens average 3-5 characters on real text,
# so such a text is far past the context, and encoding it costs ~3 us a character (29 MB took 88 s).
MAX_CHARS_PER_TOKEN = 32
# Input logprobs (logprob_start_len >= 0) compute the whole vocabulary's logits at every position from
# the start (no cached prefix), again for each of the n samples, and return 1 + top_logprobs_num +
# len(token_ids_logprob) values a position. Summed over a request's sub-requests, the positions may be
# at most max(MAX_INPUT_LOGPROB_TOKENS, context length) and the values MAX_INPUT_LOGPROB_VALUES (~20 MB
# of JSON); n=128 x a long prompt x top 20 took 20 s of scheduler time and returned 21 MB.
MAX_INPUT_LOGPROB_TOKENS = 65536
MAX_INPUT_LOGPROB_VALUES = 1 << 20


@dataclass
class SubRequest:
    """One sub-request of a normalized GenerateReqInput (a prompt, or one of its n samples), typed."""

    rid: str
    text: Optional[str]
    input_ids: Optional[list[int]]
    sampling_params: dict
    options: RequestOptions


class GenerateReqInput:
    """The /generate (and offline Engine) request: the prompt(s), their sampling params, a few fields of
    the TokenizerManager's own, and every option of `RequestOptions` by name (request_options.py): one
    value, or for a per-prompt option one per prompt of a batch. None means the default everywhere.

    SGLang's callers read and set the options as attributes (`obj.return_logprob`): they hold what the
    client sent until `normalize()`, then one entry per sub-request (per-prompt options) or the value in
    effect (whole-request options); `subs` holds every sub-request with its `RequestOptions`.
    """

    def __init__(
        self,
        text: Optional[Union[str, list[str]]] = None,
        input_ids: Optional[Union[list[int], list[list[int]]]] = None,
        sampling_params: Optional[Union[dict, list[dict]]] = None,
        rid: Optional[Union[str, list[str]]] = None,
        stream: bool = False,
        return_text_in_logprobs: bool = False,
        # False: not counted in /metrics (health probes). True no_logs: --log-requests skips its text.
        log_metrics: bool = True,
        no_logs: bool = False,
        # SGLang's older name of the routed_dp_rank option; normalize() keeps the one in effect.
        data_parallel_rank: Optional[int] = None,
        # Metric labels, kept by the TokenizerManager to --tokenizer-metrics-allowed-custom-labels.
        custom_labels: Optional[dict] = None,
        **options: Any,
    ) -> None:
        unknown = sorted(set(options) - OPTION_FIELDS.keys())
        if unknown:
            raise TypeError(f"GenerateReqInput got unexpected keyword argument(s) {', '.join(unknown)}")
        self.text = text
        self.input_ids = input_ids
        self.sampling_params = sampling_params
        self.rid = rid
        self.stream = stream
        self.return_text_in_logprobs = return_text_in_logprobs
        self.log_metrics = log_metrics
        self.no_logs = no_logs
        self.data_parallel_rank = data_parallel_rank
        self.custom_labels = custom_labels
        for name, spec in OPTION_FIELDS.items():
            setattr(self, name, options.get(name, spec.default))
        # Filled by normalize(): one entry per sub-request.
        self.is_single = True
        self.batch_size = 1
        # The prompt each sub-request samples from: the n copies of a prompt share its tokenization.
        self.prompt_index: list[int] = []
        self.subs: list[SubRequest] = []
        self._normalized = False

    def __repr__(self) -> str:
        return f"GenerateReqInput(rid={self.rid!r}, batch_size={self.batch_size}, stream={self.stream})"

    def option_value(self, name: str) -> Any:
        """The value of option `name` as it stands (as sent before normalize(), normalized after)."""
        if name not in OPTION_FIELDS:
            raise KeyError(name)
        return getattr(self, name)

    def normalize(self) -> None:
        """Validate shapes and options; one SubRequest per sub-request (prompts fanned out into n)."""
        if self._normalized:
            return
        prompts_text, prompts_ids, is_batch = split_prompts(self.text, self.input_ids)
        prompts = prompts_text if prompts_text is not None else prompts_ids
        assert prompts is not None  # split_prompts returns one of the two
        num_prompts = len(prompts)
        if num_prompts == 0:
            raise EngineRequestError("The batch of prompts is empty.")

        sampling_params = _per_prompt_params(self.sampling_params, num_prompts)
        rids = normalize_rids(self.rid, num_prompts, is_batch)
        options = self._options_per_prompt(num_prompts)
        # Every n is checked before any fan-out: a huge n must not build a huge list first.
        fan_outs = [_parallel_sample_num(sp) for sp in sampling_params]
        rooms = self._bootstrap_rooms(options, fan_outs)
        subs: list[SubRequest] = []
        for i, n in enumerate(fan_outs):
            sub_params = {k: v for k, v in sampling_params[i].items() if k != "n"}
            for j in range(n):
                k = len(subs)
                self.prompt_index.append(i)
                sub_options = options[i]
                if rooms[k] != sub_options.bootstrap_room:
                    sub_options = msgspec.structs.replace(sub_options, bootstrap_room=rooms[k])
                subs.append(SubRequest(
                    rid=sub_rid(self.rid, rids[i], k, j, n),
                    text=prompts_text[i] if prompts_text is not None else None,
                    input_ids=prompts_ids[i] if prompts_ids is not None else None,
                    sampling_params=dict(sub_params), options=sub_options))

        self.subs = subs
        self.text = [s.text for s in subs if s.text is not None] if prompts_text is not None else None
        self.input_ids = [s.input_ids for s in subs if s.input_ids is not None] if prompts_ids is not None else None
        self.sampling_params = [s.sampling_params for s in subs]
        self.rid = [s.rid for s in subs]
        for name, spec in OPTION_FIELDS.items():
            # Per-prompt options become one entry per sub-request (for callers that index them).
            value = [getattr(s.options, name) for s in subs] if spec.per_prompt else getattr(options[0], name)
            setattr(self, name, value)
        self.batch_size = len(subs)
        self.is_single = not is_batch and self.batch_size == 1
        self._normalized = True

    # ------------------------------------------------------------------ helpers
    def _options_per_prompt(self, num_prompts: int) -> list[RequestOptions]:
        """Each prompt's RequestOptions, checked against the declaration (400 naming the option)."""
        raw = {name: getattr(self, name) for name in OPTION_FIELDS}
        raw["routed_dp_rank"] = self._checked_dp_rank()
        try:
            if not any(is_per_prompt_list(spec, raw[name]) for name, spec in OPTION_FIELDS.items()):
                # The common case: one set of options for every prompt, converted once.
                options = [_cleaned(convert_options(raw))] * num_prompts
            else:
                columns = {name: per_prompt_values(spec, raw[name], num_prompts)
                           for name, spec in OPTION_FIELDS.items()}
                options = [_cleaned(convert_options({name: column[i] for name, column in columns.items()}))
                           for i in range(num_prompts)]
        except OptionError as e:
            raise EngineRequestError(str(e)) from None
        return options

    def _bootstrap_rooms(self, options: list[RequestOptions], fan_outs: list[int]) -> list[Optional[int]]:
        """The bootstrap_room of each sub-request, in fan-out order.

        As SGLang: one room given for several sub-requests becomes room, room + 1, ... (both
        servers of a PD pair expand it the same way); a list gives each prompt its own room.
        """
        listed = is_per_prompt_list(OPTION_FIELDS["bootstrap_room"], self.option_value("bootstrap_room"))
        scalar_room = None if listed else options[0].bootstrap_room
        rooms: list[Optional[int]] = []
        for i, n in enumerate(fan_outs):
            if options[i].bootstrap_room is not None and n > 1 and scalar_room is None:
                raise EngineRequestError("n > 1 needs a single bootstrap_room (it becomes one room per sample), "
                                         "not a list of rooms.")
            for _ in range(n):
                rooms.append(scalar_room + len(rooms) if scalar_room is not None else options[i].bootstrap_room)
        return rooms

    def _checked_dp_rank(self) -> Optional[int]:
        """routed_dp_rank, or data_parallel_rank when only that one is given (both must agree)."""
        routed = self.option_value("routed_dp_rank")
        for name, value in (("routed_dp_rank", routed), ("data_parallel_rank", self.data_parallel_rank)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise EngineRequestError(f"{name} must be a non-negative integer or null, got {value!r}.")
        if routed is not None and self.data_parallel_rank is not None and routed != self.data_parallel_rank:
            raise EngineRequestError(f"routed_dp_rank ({routed}) and data_parallel_rank "
                                     f"({self.data_parallel_rank}) name different ranks; send one of them.")
        return routed if routed is not None else self.data_parallel_rank


# Every keyword GenerateReqInput takes: its own fields and the options.
GENERATE_FIELDS = frozenset(
    name for name in inspect.signature(GenerateReqInput.__init__).parameters if name not in ("self", "options")
) | OPTION_FIELDS.keys()


def _cleaned(options: RequestOptions) -> RequestOptions:
    """As SGLang: "" means no cache namespace, and no token ids ([]) means none asked."""
    options.extra_key = options.extra_key or None
    options.cache_salt = options.cache_salt or None
    options.token_ids_logprob = options.token_ids_logprob or None
    return options


def _per_prompt_params(value: Any, num_prompts: int) -> list[dict]:
    """sampling_params: one dict for every prompt (None: {}), or a list with one per prompt."""
    items = value if isinstance(value, list) else [value] * num_prompts
    if len(items) != num_prompts:
        raise EngineRequestError(f"sampling_params has {len(items)} entries but there are {num_prompts} prompts.")
    for item in items:
        if item is not None and not isinstance(item, dict):
            raise EngineRequestError(f"sampling_params must be of type dict (or a list of them), got {item!r}.")
    return [dict(item) if item is not None else {} for item in items]


def split_prompts(text: Any, input_ids: Any) -> tuple[Optional[list[str]], Optional[list[list[int]]], bool]:
    """(texts, token-id lists, is_batch) of a request's prompt field(s); shared by /generate and /encode."""
    if (text is None) == (input_ids is None):
        raise EngineRequestError("Exactly one of text or input_ids must be provided.")
    if text is not None:
        if isinstance(text, str):
            return [text], None, False
        if isinstance(text, list) and all(isinstance(t, str) for t in text):
            return list(text), None, True
        raise EngineRequestError("text must be a string or a list of strings.")
    ids = input_ids
    if not isinstance(ids, list) or not ids:
        raise EngineRequestError("input_ids must be a non-empty list of token ids or a list of such lists.")
    if all(_is_token_id(t) for t in ids):
        return None, [list(ids)], False
    if all(isinstance(seq, list) and seq and all(_is_token_id(t) for t in seq) for seq in ids):
        return None, [list(seq) for seq in ids], True
    raise EngineRequestError("input_ids must be a non-empty list of non-negative integers or a list of such lists.")


def sub_rid(rid: Any, prompt_rid: str, k: int, j: int, n: int) -> str:
    """The id of sample j (of n) of a prompt, sub-request k of the whole request. As SGLang names
    them: one string rid over a request that fans out becomes "{rid}_{k}" for each sub-request k
    (prompts and samples counted together); a prompt's own rid (a list entry, or a random one) with
    n > 1 becomes "{rid}_{j}"."""
    if n == 1:
        return prompt_rid
    if isinstance(rid, str):
        return f"{rid}_{k}"
    return f"{prompt_rid}_{j}"


def normalize_rids(rid: Any, num_prompts: int, is_batch: bool) -> list[str]:
    """One request id per prompt: random, "{rid}_{i}" for one rid over a batch (SGLang), or the list."""
    if rid is None:
        return [uuid.uuid4().hex for _ in range(num_prompts)]
    if isinstance(rid, str):
        if not rid:
            raise EngineRequestError("rid must not be empty.")
        return [f"{rid}_{i}" for i in range(num_prompts)] if is_batch else [rid]
    if isinstance(rid, list) and len(rid) == num_prompts and all(isinstance(r, str) and r for r in rid):
        if len(set(rid)) != len(rid):
            raise EngineRequestError("rid values must be unique within a batch.")
        return list(rid)
    raise EngineRequestError(f"rid must be a list of {num_prompts} non-empty strings.")


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


class RequestNormalizer:
    """Checks sub-requests against the tokenizer, the vocabulary and the context length."""

    def __init__(self, tokenizer: Any, vocab_size: Optional[int], context_len: int,
                 max_req_input_len: Optional[int] = None, allow_auto_truncate: bool = False,
                 enable_custom_logit_processor: bool = False, dp_size: int = 1) -> None:
        self.tokenizer = tokenizer
        self.dp_size = dp_size  # a routed_dp_rank must name one of the replicas
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.max_req_input_len = max_req_input_len if max_req_input_len is not None else context_len - 1
        self.allow_auto_truncate = allow_auto_truncate
        self.enable_custom_logit_processor = enable_custom_logit_processor

    def tokenize_request(self, obj: GenerateReqInput) -> list[TokenizedGenerateReqInput]:
        """Every sub-request of a normalized `obj`, tokenized and checked; nothing is sent before all
        pass, so a bad batch has no side effects. A prompt is tokenized, and its sampling params
        verified, once however many samples (n) it fans out into."""
        prompt_ids: dict[int, list[int]] = {}
        verified: dict[int, dict] = {}
        tokenized = []
        for i in range(obj.batch_size):
            prompt = obj.prompt_index[i]
            if prompt not in prompt_ids:
                prompt_ids[prompt] = self.prompt_input_ids(obj, i)
                verified[prompt] = self.verify_sampling_params(obj.subs[i].sampling_params)
            tokenized.append(self.tokenize_one(obj, i, prompt_ids[prompt], dict(verified[prompt])))
        check_input_logprob_cost(tokenized, self.context_len)
        return tokenized

    def prompt_input_ids(self, obj: GenerateReqInput, i: int) -> list[int]:
        """The token ids of sub-request i's prompt, checked against the vocabulary and context."""
        sub = obj.subs[i]
        if sub.input_ids is not None:
            input_ids = list(sub.input_ids)
        else:
            if self.tokenizer is None:
                raise EngineRequestError("This server has no tokenizer (--skip-tokenizer-init): send input_ids.")
            assert sub.text is not None  # split_prompts keeps the text or the ids
            input_ids = list(self.tokenizer.encode(bound_text(sub.text, self.context_len, self.allow_auto_truncate)))
        input_len = len(input_ids)
        if input_len == 0:
            raise EngineRequestError("The input is empty.")
        if input_len >= self.context_len and not self.allow_auto_truncate:
            # Before the vocabulary scan: a list far over the context is refused without reading it all.
            raise EngineRequestError(
                f"The input ({input_len} tokens) is longer than the model's context length "
                f"({self.context_len} tokens).")
        if self.vocab_size is not None:
            bad = [t for t in input_ids if t >= self.vocab_size]
            if bad:
                raise EngineRequestError(
                    f"Token id {bad[0]} in input_ids is out of range for the vocabulary of size {self.vocab_size}.")
        if self.allow_auto_truncate and input_len >= self.max_req_input_len:
            # SGLang's --allow-auto-truncate: keep the first tokens that fit, instead of a 400.
            logger.warning("The input (%d tokens) is longer than the maximum input length (%d tokens); "
                           "truncated (--allow-auto-truncate).", input_len, self.max_req_input_len)
            return input_ids[: self.max_req_input_len]
        return input_ids

    def tokenize_one(self, obj: GenerateReqInput, i: int, input_ids: list[int],
                     sampling_params: Optional[dict] = None) -> TokenizedGenerateReqInput:
        """Sub-request i with its prompt's ids; `sampling_params` verified already (else verified here)."""
        sub = obj.subs[i]
        input_text = sub.text
        input_len = len(input_ids)
        if sampling_params is None:
            sampling_params = self.verify_sampling_params(sub.sampling_params)
        # Only a budget the client asked for is checked: the default (SamplingParams') would
        # reject every long prompt, and the scheduler clamps it to the context anyway.
        max_new_tokens = sub.sampling_params.get("max_new_tokens")
        # With --allow-auto-truncate the scheduler clamps the budget to the context instead.
        if (isinstance(max_new_tokens, int) and input_len + max_new_tokens > self.context_len
                and not self.allow_auto_truncate):
            raise EngineRequestError(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                f"tokens. You requested a total of {input_len + max_new_tokens} tokens: {input_len} tokens "
                f"from the input messages and {max_new_tokens} tokens for the completion. Please reduce the "
                f"number of tokens in the input messages or the completion to fit within the limit.")

        # The declaration's checks passed in normalize(); these need the server's limits. Like SGLang,
        # the logprob options matter only with return_logprob (effective() clears them otherwise).
        options = sub.options.effective()
        if options.return_logprob and self.vocab_size is not None and options.top_logprobs_num > self.vocab_size:
            raise EngineRequestError(f"top_logprobs_num must be at most the vocabulary size ({self.vocab_size}), "
                                     f"got {options.top_logprobs_num}.")
        # As SGLang: a start at the prompt length is allowed (no input logprobs), beyond it is not.
        if options.return_logprob and options.logprob_start_len > input_len:
            raise EngineRequestError(
                f"logprob_start_len ({options.logprob_start_len}) must not exceed the input length ({input_len}).")
        if options.custom_logit_processor is not None and not self.enable_custom_logit_processor:
            raise EngineRequestError(
                "The server is not configured to enable custom logit processor. Please set "
                "`--enable-custom-logit-processor` to enable this feature.")
        if options.routed_dp_rank is not None and options.routed_dp_rank >= self.dp_size:
            raise EngineRequestError(f"routed_dp_rank must be in [0, {self.dp_size}) (--dp-size {self.dp_size}), "
                                     f"got {options.routed_dp_rank}.")
        ids = options.token_ids_logprob
        if ids is not None and self.vocab_size is not None and any(t >= self.vocab_size for t in ids):
            raise EngineRequestError(f"token_ids_logprob must be token ids in [0, {self.vocab_size}), got {max(ids)}.")
        return TokenizedGenerateReqInput(
            rid=sub.rid,
            input_ids=input_ids,  # shared by the n samples of a prompt: encoded, never mutated
            sampling_params=sampling_params,
            input_text=input_text,
            stream=obj.stream,
            options=options,
        )

    def verify_sampling_params(self, params: dict) -> dict:
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


def bound_text(text: str, context_len: int, allow_truncate: bool) -> str:
    """`text`, checked before it is tokenized: over context_len * MAX_CHARS_PER_TOKEN characters it is
    certainly longer than the context, so it is refused (400) or, with --allow-auto-truncate, cut to
    that length (the tokens kept after truncation lie well inside it)."""
    limit = context_len * MAX_CHARS_PER_TOKEN
    if len(text) <= limit:
        return text
    if allow_truncate:
        return text[:limit]
    raise EngineRequestError(
        f"The input ({len(text)} characters) is far longer than the model's context length ({context_len} "
        f"tokens): texts of more than {limit} characters ({MAX_CHARS_PER_TOKEN} per token of context) are "
        "refused before they are tokenized.")


def check_input_logprob_cost(reqs: list[TokenizedGenerateReqInput], context_len: int) -> None:
    """Refuse (400) a request whose input logprobs, over all its sub-requests, exceed the bounds."""
    positions = values = 0
    for req in reqs:
        options = req.options
        if not options.return_logprob or options.logprob_start_len < 0:
            continue
        count = max(len(req.input_ids) - options.logprob_start_len, 0)
        positions += count
        values += count * (1 + options.top_logprobs_num + len(options.token_ids_logprob or ()))
    position_limit = max(MAX_INPUT_LOGPROB_TOKENS, context_len)
    if positions > position_limit:
        raise EngineRequestError(
            f"The request asks input logprobs at {positions} prompt positions (summed over its prompts and "
            f"samples); at most {position_limit} are computed for one request. Raise logprob_start_len or "
            "lower n.")
    if values > MAX_INPUT_LOGPROB_VALUES:
        raise EngineRequestError(
            f"The request asks {values} input logprob values (positions x (1 + top_logprobs_num + "
            f"len(token_ids_logprob)), summed over its prompts and samples); at most {MAX_INPUT_LOGPROB_VALUES} "
            "are returned for one request.")


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


def apply_chat_template(
    tokenizer: Any, chat_template: Optional[str], messages: list[dict], add_generation_prompt: bool = True,
    tools: Optional[list] = None, continue_final_message: bool = False,
    template_kwargs: Optional[dict[str, Any]] = None, context_len: Optional[int] = None,
    allow_truncate: bool = False,
) -> list[int]:
    """Render `messages` with `chat_template` (the tokenizer's own when None) and tokenize them.

    `continue_final_message` leaves the last message open (no end-of-turn after it, no new turn);
    `template_kwargs` are extra variables of the template (a request's chat_template_kwargs). With
    `context_len`, the rendered prompt passes `bound_text` before it is tokenized.
    """
    if tokenizer is None:
        raise EngineRequestError("This server has no tokenizer, so chat templates are unavailable.")
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if tools:
        kwargs["tools"] = tools
    if continue_final_message:
        kwargs["continue_final_message"] = True
        add_generation_prompt = False
    try:
        # Render to text first: apply_chat_template(tokenize=True) changed its return type
        # across transformers versions, encode() has not.
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    except Exception as e:  # jinja errors, a missing template, malformed messages
        raise EngineRequestError(f"Failed to apply the chat template: {e}") from None
    if context_len is not None:
        prompt = bound_text(prompt, context_len, allow_truncate)
    return tokenizer.encode(prompt, add_special_tokens=False)
