"""SamplingParams: one request's sampling knobs, with SGLang's names, defaults and checks.

Lifecycle: the TokenizerManager builds it from the user's dict (`SamplingParams(**d)`: null means
the default, SGLang's parameters this engine lacks (`regex`, ...) pass only when null, any other
key raises), calls `verify(vocab_size)` (bad values raise `ValueError`, which the HTTP layer turns
into a 400), and ships `to_dict()` to the scheduler. The scheduler rebuilds it with `from_dict()`
and calls `normalize(tokenizer)` before the request is scheduled.

Choices where SGLang is loose:
- `top_k = 0` is accepted and means "off", exactly like `-1` (clients written for vLLM and HF send 0
  to disable top-k); the constructor rewrites it to -1 so the rest of the engine sees one spelling.
- Type errors are `ValueError` too, so one `except ValueError` at the edge answers every bad field.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import msgspec

from engine.sampling.stop_regex import (
    MAX_STOP_REGEX,
    MAX_STOP_REGEX_LEN,
    STOP_REGEX_MAX_WINDOW,
    CompiledStopRegex,
    compile_stop_regex,
    max_match_len,
)

logger = logging.getLogger(__name__)

# Below this temperature a request is greedy; SGLang uses the same threshold.
SAMPLING_EPS = 1e-6
# logit_bias values outside OpenAI's documented range are refused (SGLang has no bound): +-100
# already forces or bans a token, and a larger bias overflows half-precision logits to inf (NaN
# after softmax).
LOGIT_BIAS_LIMIT = 100.0

_PARAM_NAMES = (
    "max_new_tokens",
    "min_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "n",
    "sampling_seed",
    "logit_bias",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "stop_regex",
    "stream_interval",
    "custom_params",
)

# The structured-output constraints (SGLang's names); a request may carry at most one.
CONSTRAINT_NAMES = ("json_schema", "regex", "ebnf", "structural_tag")


# SGLang sampling parameters this engine does not implement, with what they would need. A client
# that sends one as null (or empty) gets the default behaviour; a real value is a clear 400 rather
# than a silently different generation.
UNSUPPORTED_PARAMS: Dict[str, str] = {}

# Fan-out limit of one request (n sub-requests share the prompt).
MAX_N = 128
# Stop strings, for every route: the scheduler looks for each in the decoded output tail at every
# step, and while streaming holds back a tail that may start one, so their count and length set
# the per-token cost (docs/security.md). The OpenAI routes had the same count limit already.
MAX_STOP_STRINGS = 32
MAX_STOP_STR_LEN = 256  # characters, each
MAX_STOP_STRS_TOTAL_LEN = 1024  # characters, all of a request's together
# stop_token_ids: each is checked on every token through a set; the list is shipped to the scheduler.
MAX_STOP_TOKEN_IDS = 4096
_INT32_MAX = (1 << 31) - 1


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _check_others(others: Dict[str, Any]) -> None:
    """Keys beyond the implemented ones: SGLang's unimplemented parameters pass only when unset."""
    unknown = sorted(k for k in others if k not in UNSUPPORTED_PARAMS)
    if unknown:
        raise ValueError(f"Unknown sampling parameter(s): {', '.join(unknown)}")
    for name, value in others.items():
        if value is not None and value != [] and value != {}:
            raise ValueError(f"sampling_params.{name} is not supported by this server "
                             f"({UNSUPPORTED_PARAMS[name]}); leave it out or send null")


def _crosses_processes(value: Any) -> bool:
    """Whether msgpack (the scheduler's wire format) encodes it: JSON's integers are unbounded, msgpack's
    fit 64 bits."""
    try:
        msgspec.msgpack.encode(value)
    except (OverflowError, TypeError):
        return False
    return True


def _range_error(name: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"{name} must be {allowed}, got {_clip(value)}")


def check_parallel_sample_num(n: Any) -> int:
    """`n` (the sub-requests one request fans out into), bounded: the one check of the HTTP and
    the offline paths, made before any fan-out (ValueError otherwise)."""
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise _range_error("n", f"an integer in [1, {MAX_N}]", n)
    return n


def _is_number(value: Any) -> bool:
    # bool is an int subclass; `temperature: true` is a client bug, not 1.0.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(init=False, eq=True, repr=True)
class SamplingParams:
    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[Union[List[int], Set[int]]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None
    logit_bias: Optional[Dict[Union[str, int], float]] = None
    # Constrained decoding: a JSON schema (as JSON text), a regular expression or an EBNF grammar
    # the output must match. The scheduler compiles it (constrained/) and masks the vocabulary.
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    # SGLang's structural tag (JSON text): free text, in which each trigger starts a tagged part that
    # follows its schema (constrained/xgrammar_backend.py has both SGLang shapes).
    structural_tag: Optional[str] = None
    stop_regex: Optional[Union[str, List[str]]] = None
    # Emit a streaming request's output every this many tokens (None: the server's --stream-interval).
    stream_interval: Optional[int] = None
    # Handed to the request's custom logit processor (JSON values only).
    custom_params: Optional[Dict[str, Any]] = None
    # Derived by normalize(): the longest stop string, in tokens when a tokenizer was given
    # (else in characters, an over-estimate), so the scheduler knows how much tail to decode;
    # and the longest text a stop regex can match (stop_regex.UNBOUNDED: the whole output).
    stop_str_max_len: int = field(default=0, compare=False)
    stop_regex_max_len: int = field(default=0, compare=False)
    # The stop regexes compiled (by verify(), or normalize()), one per stop_regex_strs entry: they
    # belong to this request only (stop_regex.py keeps user patterns out of process-wide caches).
    stop_regex_compiled: List[CompiledStopRegex] = field(default_factory=list, compare=False, repr=False)

    def __init__(
        self,
        *,
        max_new_tokens: Optional[int] = 128,
        min_new_tokens: Optional[int] = None,
        temperature: Optional[float] = None,
        top_p: Optional[float] = None,
        top_k: Optional[int] = None,
        min_p: Optional[float] = None,
        frequency_penalty: Optional[float] = None,
        presence_penalty: Optional[float] = None,
        repetition_penalty: Optional[float] = None,
        stop: Optional[Union[str, List[str]]] = None,
        stop_token_ids: Optional[Union[List[int], Set[int]]] = None,
        ignore_eos: Optional[bool] = None,
        skip_special_tokens: Optional[bool] = None,
        spaces_between_special_tokens: Optional[bool] = None,
        no_stop_trim: Optional[bool] = None,
        n: Optional[int] = None,
        sampling_seed: Optional[int] = None,
        logit_bias: Optional[Dict[Union[str, int], float]] = None,
        json_schema: Optional[str] = None,
        regex: Optional[str] = None,
        ebnf: Optional[str] = None,
        structural_tag: Optional[str] = None,
        stop_regex: Optional[Union[str, List[str]]] = None,
        stream_interval: Optional[int] = None,
        custom_params: Optional[Dict[str, Any]] = None,
        **others: Any,
    ) -> None:
        # null means "the default" for every parameter, as in SGLang: its clients (the router,
        # sglang.RuntimeEndpoint) send unset knobs as null. max_new_tokens is the exception:
        # null there is a real value, "up to the context length".
        _check_others(others)
        self.max_new_tokens = max_new_tokens
        self.min_new_tokens = _or(min_new_tokens, 0)
        self.temperature = _or(temperature, 1.0)
        self.top_p = _or(top_p, 1.0)
        self.top_k = -1 if top_k is None or (_is_int(top_k) and top_k == 0) else top_k
        self.min_p = _or(min_p, 0.0)
        self.frequency_penalty = _or(frequency_penalty, 0.0)
        self.presence_penalty = _or(presence_penalty, 0.0)
        self.repetition_penalty = _or(repetition_penalty, 1.0)
        self.stop = stop
        self.stop_token_ids = stop_token_ids
        self.ignore_eos = _or(ignore_eos, False)
        self.skip_special_tokens = _or(skip_special_tokens, True)
        self.spaces_between_special_tokens = _or(spaces_between_special_tokens, True)
        self.no_stop_trim = _or(no_stop_trim, False)
        self.n = _or(n, 1)
        self.sampling_seed = sampling_seed
        self.logit_bias = logit_bias
        self.json_schema = json_schema
        self.regex = regex
        self.ebnf = ebnf
        self.structural_tag = structural_tag
        self.stop_regex = stop_regex
        self.stream_interval = stream_interval
        self.custom_params = custom_params
        self.stop_str_max_len = 0
        self.stop_regex_max_len = 0
        self.stop_regex_compiled = []

    # ------------------------------------------------------------------ validation

    def verify(self, vocab_size: Optional[int] = None,
               compile_regex: Callable[[Sequence[str]], List[CompiledStopRegex]] = compile_stop_regex) -> None:
        """Raise ValueError naming the first bad field and its allowed range.

        `compile_regex` checks and compiles the stop regexes (the scheduler passes one that shares the
        compilation between the n samples of a request: stop_regex.StopRegexCompiler).
        """
        self._verify_numbers()
        self._verify_lengths()
        self._verify_flags()
        self._verify_stops(vocab_size)
        self._verify_logit_bias(vocab_size)
        self._verify_constraint()
        self._verify_extras(compile_regex)

    def _verify_numbers(self) -> None:
        checks = (
            ("temperature", lambda v: v >= 0, ">= 0"),
            ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
            ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
            ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
            ("repetition_penalty", lambda v: 0 < v <= 2, "in (0, 2]"),
        )
        for name, ok, allowed in checks:
            value = getattr(self, name)
            # `v == v` rejects NaN, which every range comparison would otherwise let through oddly.
            if not _is_number(value) or value != value or not ok(value):
                raise _range_error(name, f"a number {allowed}", value)
        if not _is_int(self.top_k) or not (self.top_k == -1 or 1 <= self.top_k <= _INT32_MAX):
            raise _range_error("top_k", f"an integer, -1 or 0 (disabled) or in [1, {_INT32_MAX}]", self.top_k)
        check_parallel_sample_num(self.n)
        # Seeds cross the process boundary as msgpack integers: keep them in the int64 range.
        if self.sampling_seed is not None and (not _is_int(self.sampling_seed)
                                               or not -(1 << 63) <= self.sampling_seed < (1 << 63)):
            raise _range_error("sampling_seed", "a 64-bit integer or null", self.sampling_seed)

    def _verify_lengths(self) -> None:
        if self.max_new_tokens is not None and (not _is_int(self.max_new_tokens)
                                                or not 0 <= self.max_new_tokens <= _INT32_MAX):
            raise _range_error("max_new_tokens", f"an integer in [0, {_INT32_MAX}] or null", self.max_new_tokens)
        if not _is_int(self.min_new_tokens) or not 0 <= self.min_new_tokens <= _INT32_MAX:
            raise _range_error("min_new_tokens", f"an integer in [0, {_INT32_MAX}]", self.min_new_tokens)
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise _range_error(
                "min_new_tokens", f"<= max_new_tokens ({self.max_new_tokens})", self.min_new_tokens
            )

    def _verify_flags(self) -> None:
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise _range_error(name, "a boolean", getattr(self, name))

    def _verify_stops(self, vocab_size: Optional[int]) -> None:
        stop = self.stop
        if stop is not None:
            strs = [stop] if isinstance(stop, str) else stop
            if not isinstance(strs, (list, tuple)) or not all(isinstance(s, str) for s in strs):
                raise _range_error("stop", "a string or a list of strings", stop)
            if any(len(s) == 0 for s in strs):
                raise _range_error("stop", "non-empty strings", stop)
            _check_stop_sizes(strs)
        ids = self.stop_token_ids
        if ids is not None:
            upper = f" < vocab_size ({vocab_size})" if vocab_size is not None else ""
            allowed = f"a list of at most {MAX_STOP_TOKEN_IDS} integer token ids >= 0{upper}"
            if (not isinstance(ids, (list, tuple, set, frozenset)) or len(ids) > MAX_STOP_TOKEN_IDS
                    or not all(_is_int(i) for i in ids)):
                raise _range_error("stop_token_ids", allowed, ids)
            if any(i < 0 or (vocab_size is not None and i >= vocab_size) for i in ids):
                raise _range_error("stop_token_ids", allowed, ids)

    def _verify_logit_bias(self, vocab_size: Optional[int]) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        upper = f" < vocab_size ({vocab_size})" if vocab_size is not None else ""
        if not isinstance(bias, dict):
            raise _range_error("logit_bias", "a mapping token id -> bias", bias)
        for key, value in bias.items():
            token_id = _parse_token_id(key)
            if token_id is None or token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
                raise _range_error("logit_bias key", f"a token id >= 0{upper}", key)
            if not _is_number(value) or value != value or not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise _range_error(
                    f"logit_bias[{key!r}]", f"a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]", value
                )

    def _verify_constraint(self) -> None:
        given = [name for name in CONSTRAINT_NAMES if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"Only one of json_schema, regex, ebnf and structural_tag may be given, got "
                             f"{', '.join(given)}")
        for name in given:
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise _range_error(name, "a non-empty string", value)

    @property
    def constraint(self) -> Optional[Tuple[str, str]]:
        """(kind, text) of the output constraint, kind one of CONSTRAINT_NAMES; or None."""
        for name in CONSTRAINT_NAMES:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None
    def _verify_extras(self, compile_regex: Callable[[Sequence[str]], List[CompiledStopRegex]]) -> None:
        if self.stop_regex is not None:
            patterns = [self.stop_regex] if isinstance(self.stop_regex, str) else self.stop_regex
            allowed = f"a string or a list of at most {MAX_STOP_REGEX} non-empty strings"
            if (not isinstance(patterns, (list, tuple)) or len(patterns) > MAX_STOP_REGEX
                    or not all(isinstance(p, str) and 0 < len(p) <= MAX_STOP_REGEX_LEN for p in patterns)):
                raise _range_error("stop_regex", allowed + f" of at most {MAX_STOP_REGEX_LEN} characters",
                                   self.stop_regex)
            self.stop_regex_compiled = compile_regex(list(patterns))
        if self.stream_interval is not None and (not _is_int(self.stream_interval)
                                                 or not 1 <= self.stream_interval <= _INT32_MAX):
            raise _range_error("stream_interval", "an integer >= 1 or null", self.stream_interval)
        if self.custom_params is not None and (not isinstance(self.custom_params, dict)
                                               or not all(isinstance(k, str) for k in self.custom_params)
                                               or not _crosses_processes(self.custom_params)):
            raise _range_error("custom_params", "an object with string keys or null, of JSON values whose integers "
                               "fit 64 bits", self.custom_params)

    # ------------------------------------------------------------------ normalisation

    def normalize(self, tokenizer: Any = None) -> None:
        """Canonical forms the scheduler relies on. Idempotent; call after verify()."""
        if self.temperature < SAMPLING_EPS:
            # Greedy is expressed as top_k 1 so the sampler needs one test (top_k == 1), as in SGLang.
            self.temperature = 1.0
            self.top_k = 1
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_str_max_len = max((_stop_len(s, tokenizer) for s in self.stop), default=0)
        self.stop_token_ids = set(self.stop_token_ids) if self.stop_token_ids else set()
        self.stop_regex = self.stop_regex_strs
        if len(self.stop_regex_compiled) != len(self.stop_regex):
            self.stop_regex_compiled = compile_stop_regex(self.stop_regex)
        # A match longer than the window (or without bound) is looked for in the window only, so the
        # per-token search never grows with the output (stop_regex.py).
        self.stop_regex_max_len = min(max((max_match_len(p) for p in self.stop_regex), default=0),
                                      STOP_REGEX_MAX_WINDOW)
        if self.logit_bias:
            self.logit_bias = {_verified_token_id(k): float(v) for k, v in self.logit_bias.items()}

    @property
    def stop_strs(self) -> List[str]:
        """The stop strings as a list, whatever form `stop` has (SGLang's name)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def stop_regex_strs(self) -> List[str]:
        """The stop regexes as a list, whatever form `stop_regex` has (SGLang's name)."""
        if self.stop_regex is None:
            return []
        return [self.stop_regex] if isinstance(self.stop_regex, str) else list(self.stop_regex)

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1 or self.temperature < SAMPLING_EPS

    # ------------------------------------------------------------------ IPC

    def to_dict(self) -> Dict[str, Any]:
        """Plain builtin types only (msgspec/JSON friendly): sets become sorted lists, and
        logit_bias keys become strings because JSON objects cannot have integer keys."""
        out: Dict[str, Any] = {name: getattr(self, name) for name in _PARAM_NAMES}
        for name in ("stop", "stop_regex"):
            if isinstance(out[name], (list, tuple)):
                out[name] = list(out[name])
        if out["stop_token_ids"] is not None:
            out["stop_token_ids"] = sorted(out["stop_token_ids"])
        if out["logit_bias"] is not None:
            out["logit_bias"] = {str(k): float(v) for k, v in out["logit_bias"].items()}
        return out

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "SamplingParams":
        return cls(**data)


def _parse_token_id(key: Any) -> Optional[int]:
    if _is_int(key):
        return key
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            return None
    return None


def _verified_token_id(key: Any) -> int:
    token_id = _parse_token_id(key)
    assert token_id is not None  # verify() refused keys that do not parse
    return int(token_id)


def _check_stop_sizes(stops: Sequence[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_STR_LEN:
        raise ValueError(f"each stop string may be at most {MAX_STOP_STR_LEN} characters long, got one of {longest}")
    total = sum(len(s) for s in stops)
    if total > MAX_STOP_STRS_TOTAL_LEN:
        raise ValueError(f"the stop strings may be at most {MAX_STOP_STRS_TOTAL_LEN} characters long together, "
                         f"got {total}")


def _clip(value: Any, limit: int = 200) -> str:
    """A bad value for an error message: its repr, cut (a refused value may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _stop_len(stop_str: str, tokenizer: Any) -> int:
    if tokenizer is None:
        return len(stop_str)
    return len(tokenizer.encode(stop_str, add_special_tokens=False))
