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

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from engine.errors import EngineRequestError
from engine.io_struct import TokenizedGenerateReqInput
from engine.sampling.sampling_params import check_parallel_sample_num

logger = logging.getLogger(__name__)

# return_hidden_states: false, true (every position's) or SGLang's "last" (the last position's only);
# the same type as TokenizedGenerateReqInput's field.
HiddenStatesMode = Union[bool, Literal["last"]]
# token_ids_logprob: logprobs of at most this many ids per position (bounds the work one request asks).
MAX_TOKEN_IDS_LOGPROB = 1024
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
# routing_key: one string a request (it is counted against the running requests at every prefill).
MAX_ROUTING_KEY_LEN = 256


@dataclass
class SubRequest:
    """One sub-request of a normalized GenerateReqInput (a prompt, or one of its n samples), typed."""

    rid: str
    text: Optional[str]
    input_ids: Optional[list[int]]
    sampling_params: dict
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    token_ids_logprob: Optional[list[int]]
    return_hidden_states: HiddenStatesMode
    custom_logit_processor: Optional[str]
    extra_key: Optional[str]
    cache_salt: Optional[str]
    bootstrap_host: Optional[str]
    bootstrap_port: Optional[int]
    bootstrap_room: Optional[int]


@dataclass
class GenerateReqInput:
    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[int], list[list[int]]]] = None
    sampling_params: Optional[Union[dict, list[dict]]] = None
    rid: Optional[Union[str, list[str]]] = None
    stream: bool = False
    # None (as in SGLang's clients' JSON) means the default, here as in every per-prompt field.
    return_logprob: Optional[Union[bool, list[bool]]] = False
    logprob_start_len: Optional[Union[int, list[int]]] = -1  # -1: no input logprobs
    top_logprobs_num: Optional[Union[int, list[int]]] = 0
    return_text_in_logprobs: bool = False
    # False: not counted in /metrics (health probes). True no_logs: --log-requests skips its text.
    log_metrics: bool = True
    no_logs: bool = False
    # SGLang's per-request extras (docs/api.md): a list gives one value per prompt.
    token_ids_logprob: Optional[Union[list[int], list[list[int]]]] = None
    # true / "last" (SGLang's mode: only the last position's vector), or one per prompt.
    return_hidden_states: Union[HiddenStatesMode, list[HiddenStatesMode]] = False
    custom_logit_processor: Optional[Union[str, list[Optional[str]]]] = None
    priority: Optional[int] = None  # one value for the whole request, as in SGLang
    extra_key: Optional[Union[str, list[Optional[str]]]] = None
    cache_salt: Optional[Union[str, list[Optional[str]]]] = None
    # The output starts inside the model's reasoning: its constraint (grammar) applies only after the
    # reasoning ends (SGLang's require_reasoning; one value for the whole request, as in SGLang).
    require_reasoning: bool = False
    # PD disaggregation (SGLang's router adds them): one value, or one per prompt of a batch.
    bootstrap_host: Optional[Union[str, list[Optional[str]]]] = None
    bootstrap_port: Optional[Union[int, list[Optional[int]]]] = None
    bootstrap_room: Optional[Union[int, list[Optional[int]]]] = None
    # DP-aware routing (SGLang's gateway): the replica of the whole request; data_parallel_rank is
    # SGLang's older name. normalize() keeps the one in effect in routed_dp_rank.
    routed_dp_rank: Optional[int] = None
    data_parallel_rank: Optional[int] = None
    # SGLang's routing key (--schedule-policy routing-key) and metric labels (kept by the
    # TokenizerManager to --tokenizer-metrics-allowed-custom-labels); one value for the request.
    routing_key: Optional[str] = None
    custom_labels: Optional[dict] = None

    # Filled by normalize(): one entry per sub-request.
    is_single: bool = field(default=True, init=False)
    batch_size: int = field(default=1, init=False)
    # The prompt each sub-request samples from: the n copies of a prompt share its tokenization.
    prompt_index: list[int] = field(default_factory=list, init=False)
    # The same entries per sub-request, typed (the fields above hold them as lists, for callers
    # that index a field; the fields' types must also admit what a client sends).
    subs: list[SubRequest] = field(default_factory=list, init=False, repr=False)
    _normalized: bool = field(default=False, init=False, repr=False)

    def normalize(self) -> None:
        """Validate shapes and turn every field into a list with one entry per sub-request."""
        if self._normalized:
            return
        prompts_text, prompts_ids, is_batch = split_prompts(self.text, self.input_ids)
        prompts = prompts_text if prompts_text is not None else prompts_ids
        assert prompts is not None  # split_prompts returns one of the two
        num_prompts = len(prompts)
        if num_prompts == 0:
            raise EngineRequestError("The batch of prompts is empty.")

        sampling_params = self._per_prompt(self.sampling_params, num_prompts, "sampling_params", dict, None)
        sampling_params = [dict(sp) if sp is not None else {} for sp in sampling_params]
        rids = normalize_rids(self.rid, num_prompts, is_batch)
        return_logprob = self._per_prompt(self.return_logprob, num_prompts, "return_logprob", bool, False)
        start_lens = self._per_prompt(self.logprob_start_len, num_prompts, "logprob_start_len", int, -1)
        top_nums = self._per_prompt(self.top_logprobs_num, num_prompts, "top_logprobs_num", int, 0)
        token_ids = self._token_ids_per_prompt(num_prompts)
        hidden = self._hidden_states_per_prompt(num_prompts)
        processors = self._per_prompt(self.custom_logit_processor, num_prompts, "custom_logit_processor", str, None)
        extra_keys = self._per_prompt(self.extra_key, num_prompts, "extra_key", str, None)
        salts = self._per_prompt(self.cache_salt, num_prompts, "cache_salt", str, None)
        if self.priority is not None and not _is_int64(self.priority):
            raise EngineRequestError(f"priority must be a 64-bit integer or null, got {self.priority!r}.")
        if not isinstance(self.require_reasoning, bool):
            raise EngineRequestError(f"require_reasoning must be a boolean, got {self.require_reasoning!r}.")
        self.routed_dp_rank = self._checked_dp_rank()
        if self.routing_key is not None and (not isinstance(self.routing_key, str)
                                             or len(self.routing_key) > MAX_ROUTING_KEY_LEN):
            raise EngineRequestError(f"routing_key must be a string of at most {MAX_ROUTING_KEY_LEN} characters "
                                     "or null.")

        out_text: list[str] = []
        out_ids: list[list[int]] = []
        out_sp: list[dict] = []
        out_rid: list[str] = []
        out_lp: list[bool] = []
        out_start: list[int] = []
        out_top: list[int] = []
        out_prompt: list[int] = []
        per_sub: dict[str, list] = {"token_ids_logprob": [], "return_hidden_states": [], "custom_logit_processor": [],
                                    "extra_key": [], "cache_salt": []}
        # Every n is checked before any fan-out: a huge n must not build a huge list first.
        fan_outs = [_parallel_sample_num(sp) for sp in sampling_params]
        bootstrap = self._bootstrap_per_request(num_prompts, fan_outs)
        for i, n in enumerate(fan_outs):
            sub_params = {k: v for k, v in sampling_params[i].items() if k != "n"}
            for j in range(n):
                out_prompt.append(i)
                if prompts_text is not None:
                    out_text.append(prompts_text[i])
                else:
                    assert prompts_ids is not None  # split_prompts returns one of the two
                    out_ids.append(prompts_ids[i])
                out_sp.append(dict(sub_params))
                out_rid.append(sub_rid(self.rid, rids[i], len(out_rid), j, n))
                out_lp.append(bool(return_logprob[i]))
                out_start.append(int(start_lens[i]))
                out_top.append(int(top_nums[i]))
                per_sub["token_ids_logprob"].append(token_ids[i])
                per_sub["return_hidden_states"].append(hidden[i])
                per_sub["custom_logit_processor"].append(processors[i])
                # "" means no namespace, as in SGLang.
                per_sub["extra_key"].append(extra_keys[i] or None)
                per_sub["cache_salt"].append(salts[i] or None)

        self.text = out_text if prompts_text is not None else None
        self.input_ids = out_ids if prompts_ids is not None else None
        self.sampling_params = out_sp
        self.rid = out_rid
        self.return_logprob = out_lp
        self.logprob_start_len = out_start
        self.top_logprobs_num = out_top
        self.prompt_index = out_prompt
        self.token_ids_logprob = per_sub["token_ids_logprob"]
        self.return_hidden_states = per_sub["return_hidden_states"]
        self.custom_logit_processor = per_sub["custom_logit_processor"]
        self.extra_key = per_sub["extra_key"]
        self.cache_salt = per_sub["cache_salt"]
        self.bootstrap_host = [b[0] for b in bootstrap]
        self.bootstrap_port = [b[1] for b in bootstrap]
        self.bootstrap_room = [b[2] for b in bootstrap]
        self.subs = [
            SubRequest(rid=out_rid[k], text=out_text[k] if prompts_text is not None else None,
                       input_ids=out_ids[k] if prompts_ids is not None else None, sampling_params=out_sp[k],
                       return_logprob=out_lp[k], logprob_start_len=out_start[k], top_logprobs_num=out_top[k],
                       token_ids_logprob=per_sub["token_ids_logprob"][k],
                       return_hidden_states=per_sub["return_hidden_states"][k],
                       custom_logit_processor=per_sub["custom_logit_processor"][k],
                       extra_key=per_sub["extra_key"][k], cache_salt=per_sub["cache_salt"][k],
                       bootstrap_host=bootstrap[k][0], bootstrap_port=bootstrap[k][1], bootstrap_room=bootstrap[k][2])
            for k in range(len(out_rid))
        ]
        self.batch_size = len(out_rid)
        self.is_single = not is_batch and self.batch_size == 1
        self._normalized = True

    # ------------------------------------------------------------------ helpers
    def _bootstrap_per_request(self, num_prompts: int, fan_outs: list[int]
                               ) -> list[tuple[Optional[str], Optional[int], Optional[int]]]:
        """(bootstrap_host, bootstrap_port, bootstrap_room) of each sub-request, in fan-out order.

        As SGLang: one room given for several sub-requests becomes room, room + 1, ... (both
        servers of a PD pair expand it the same way); a list gives each prompt its own room.
        """
        hosts = self._per_prompt(self.bootstrap_host, num_prompts, "bootstrap_host", str, None)
        ports = self._per_prompt(self.bootstrap_port, num_prompts, "bootstrap_port", int, None)
        rooms = self._per_prompt(self.bootstrap_room, num_prompts, "bootstrap_room", int, None)
        # One room for every sub-request (an int: _per_prompt checked its type), or None.
        scalar_room = None if isinstance(self.bootstrap_room, list) else self.bootstrap_room
        out: list[tuple[Optional[str], Optional[int], Optional[int]]] = []
        for i, n in enumerate(fan_outs):
            if rooms[i] is not None and n > 1 and scalar_room is None:
                raise EngineRequestError("n > 1 needs a single bootstrap_room (it becomes one room per sample), "
                                         "not a list of rooms.")
            for _ in range(n):
                room = scalar_room + len(out) if scalar_room is not None else rooms[i]
                out.append((hosts[i], ports[i], room))
        return out

    def _hidden_states_per_prompt(self, num_prompts: int) -> list[HiddenStatesMode]:
        """return_hidden_states: false, true or "last" for every prompt, or a list of them."""
        value: Any = self.return_hidden_states  # as the client sent it: its shape is checked here
        values = value if isinstance(value, list) else [value] * num_prompts
        if len(values) != num_prompts:
            raise EngineRequestError(f"return_hidden_states has {len(values)} entries but there are {num_prompts} "
                                     "prompts.")
        modes: list[HiddenStatesMode] = []
        for item in values:
            if item is not None and not isinstance(item, bool) and item != "last":
                raise EngineRequestError(f'return_hidden_states must be true, false or "last" (or a list of them), '
                                         f"got {item!r}.")
            modes.append(False if item is None else item)
        return modes

    def _checked_dp_rank(self) -> Optional[int]:
        """routed_dp_rank, or data_parallel_rank when only that one is given (both must agree)."""
        for name, value in (("routed_dp_rank", self.routed_dp_rank), ("data_parallel_rank", self.data_parallel_rank)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise EngineRequestError(f"{name} must be a non-negative integer or null, got {value!r}.")
        if self.routed_dp_rank is not None and self.data_parallel_rank is not None \
                and self.routed_dp_rank != self.data_parallel_rank:
            raise EngineRequestError(f"routed_dp_rank ({self.routed_dp_rank}) and data_parallel_rank "
                                     f"({self.data_parallel_rank}) name different ranks; send one of them.")
        return self.routed_dp_rank if self.routed_dp_rank is not None else self.data_parallel_rank

    def _token_ids_per_prompt(self, num_prompts: int) -> list[Optional[list[int]]]:
        """token_ids_logprob: one list of ids for every prompt, or a list of such lists."""
        value: Any = self.token_ids_logprob  # as the client sent it: its shape is checked here
        if value is None or value == []:
            return [None] * num_prompts
        if isinstance(value, list) and all(_is_token_id(t) for t in value):
            return [list(value)] * num_prompts
        if (isinstance(value, list) and len(value) == num_prompts
                and all(v is None or (isinstance(v, list) and all(_is_token_id(t) for t in v)) for v in value)):
            return [list(v) if v else None for v in value]
        raise EngineRequestError("token_ids_logprob must be a list of token ids, or one such list per prompt "
                                 f"({num_prompts}).")

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


def _is_int64(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(1 << 63) <= value < (1 << 63)


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

        return_logprob = sub.return_logprob
        logprob_start_len = sub.logprob_start_len
        top_logprobs_num = sub.top_logprobs_num
        if top_logprobs_num < 0:
            raise EngineRequestError(f"top_logprobs_num must be >= 0, got {top_logprobs_num}.")
        if return_logprob and self.vocab_size is not None and top_logprobs_num > self.vocab_size:
            raise EngineRequestError(
                f"top_logprobs_num must be at most the vocabulary size ({self.vocab_size}), got {top_logprobs_num}.")
        if logprob_start_len < -1:
            raise EngineRequestError(f"logprob_start_len must be >= -1, got {logprob_start_len}.")
        # As SGLang: a start at the prompt length is allowed (no input logprobs), beyond it is not.
        if return_logprob and logprob_start_len > input_len:
            raise EngineRequestError(
                f"logprob_start_len ({logprob_start_len}) must not exceed the input length ({input_len}).")
        processor = sub.custom_logit_processor
        if processor is not None and not self.enable_custom_logit_processor:
            raise EngineRequestError(
                "The server is not configured to enable custom logit processor. Please set "
                "`--enable-custom-logit-processor` to enable this feature.")
        if obj.routed_dp_rank is not None and obj.routed_dp_rank >= self.dp_size:
            raise EngineRequestError(f"routed_dp_rank must be in [0, {self.dp_size}) (--dp-size {self.dp_size}), "
                                     f"got {obj.routed_dp_rank}.")
        return TokenizedGenerateReqInput(
            rid=sub.rid,
            input_ids=input_ids,  # shared by the n samples of a prompt: encoded, never mutated
            sampling_params=sampling_params,
            input_text=input_text,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len if return_logprob else -1,
            top_logprobs_num=top_logprobs_num if return_logprob else 0,
            stream=obj.stream,
            # Like SGLang, asked-for token ids matter only with return_logprob.
            token_ids_logprob=self._checked_token_ids(sub.token_ids_logprob) if return_logprob else None,
            return_hidden_states=sub.return_hidden_states,
            custom_logit_processor=processor,
            priority=obj.priority,
            require_reasoning=obj.require_reasoning,
            extra_key=sub.extra_key,
            cache_salt=sub.cache_salt,
            bootstrap_host=sub.bootstrap_host,
            bootstrap_port=sub.bootstrap_port,
            bootstrap_room=sub.bootstrap_room,
            routed_dp_rank=obj.routed_dp_rank,
            routing_key=obj.routing_key,
        )

    def _checked_token_ids(self, ids: Optional[list[int]]) -> Optional[list[int]]:
        if ids is None:
            return None
        if len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise EngineRequestError(f"token_ids_logprob may name at most {MAX_TOKEN_IDS_LOGPROB} token ids, "
                                     f"got {len(ids)}.")
        if self.vocab_size is not None and any(t >= self.vocab_size for t in ids):
            raise EngineRequestError(
                f"token_ids_logprob must be token ids in [0, {self.vocab_size}), got {max(ids)}.")
        return ids

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
        if not req.return_logprob or req.logprob_start_len < 0:
            continue
        count = max(len(req.input_ids) - req.logprob_start_len, 0)
        positions += count
        values += count * (1 + req.top_logprobs_num + len(req.token_ids_logprob or ()))
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
