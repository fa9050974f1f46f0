"""`Req`: one generation request as the scheduler sees it, and its finish reasons."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Dict, Hashable, List, Optional, Set

import torch

from engine.request_options import RequestOptions
from engine.sampling import stop_regex
from engine.utils.tokenizer_utils import REPLACEMENT_CHAR, settled_text_len

if TYPE_CHECKING:
    from engine.constrained.base_grammar_backend import BaseGrammarObject
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.sampling.sampling_params import SamplingParams

# Only the estimation of future decode room is clipped at this many tokens; stop conditions never are.
CLIP_MAX_NEW_TOKENS_ESTIMATION = 4096
_EMPTY_SLOTS = torch.empty((0,), dtype=torch.int64)
FAST_FINISH_UNKNOWN: Any = object()  # Req.fast_finish_ids() not computed yet


class BaseFinishReason(ABC):
    @abstractmethod
    def to_json(self) -> Dict[str, Any]:
        """The finish reason as sent to the client (SGLang's JSON shape)."""


class FINISH_MATCHED_TOKEN(BaseFinishReason):
    def __init__(self, matched: int) -> None:
        self.matched = matched

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FINISH_MATCHED_STR(BaseFinishReason):
    def __init__(self, matched: str) -> None:
        self.matched = matched

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FINISH_MATCHED_REGEX(BaseFinishReason):
    """A stop_regex matched; `matched` is the pattern (SGLang's FINISHED_MATCHED_REGEX). The text
    is not trimmed at the match, as in SGLang."""

    def __init__(self, matched: str) -> None:
        self.matched = matched

    def to_json(self) -> Dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


class FINISH_LENGTH(BaseFinishReason):
    def __init__(self, length: int) -> None:
        self.length = length

    def to_json(self) -> Dict[str, Any]:
        return {"type": "length", "length": self.length}


class FINISH_ABORT(BaseFinishReason):
    def __init__(self, message: str = "Aborted", status_code: Optional[int] = None,
                 err_type: Optional[str] = None) -> None:
        self.message = message
        self.status_code = status_code
        self.err_type = err_type

    def to_json(self) -> Dict[str, Any]:
        return {"type": "abort", "message": self.message, "status_code": self.status_code,
                "err_type": self.err_type}


def cache_namespace(extra_key: Optional[str], cache_salt: Optional[str]) -> Optional[Hashable]:
    """The radix-cache namespace of a request: requests share cached prefixes only when both
    their extra_key and their cache_salt are equal (None: the shared namespace)."""
    if extra_key is None and cache_salt is None:
        return None
    return (extra_key, cache_salt)


def lora_cache_namespace(namespace: Optional[Hashable], lora_uid: str) -> Hashable:
    """A LoRA request's namespace: KV computed with an adapter is only valid for that adapter."""
    return ("lora", lora_uid, namespace)


class Req:
    """A request's inputs, outputs and KV ownership record.

    KV ownership (one row of req_to_token): the tree owns positions [0, cache_protected_len),
    the request owns [cache_protected_len, kv_allocated_len).
    """

    def __init__(
        self,
        rid: str,
        origin_input_ids: List[int],
        sampling_params: "SamplingParams",
        origin_input_text: Optional[str] = None,
        stream: bool = False,
        eos_token_ids: Optional[Set[int]] = None,
        vocab_size: Optional[int] = None,
        options: Optional[RequestOptions] = None,
    ) -> None:
        self.rid = rid
        self.origin_input_text = origin_input_text
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.stream = stream
        self.eos_token_ids: Set[int] = set(eos_token_ids or ())
        self.vocab_size = vocab_size
        self.tokenizer: Any = None  # set by the scheduler; decodes tails for stop strings
        # Constrained decoding: this request's matcher, advanced with every accepted token.
        self.grammar: Optional["BaseGrammarObject"] = None
        # What the client asked besides the prompt and sampling (request_options.py), as it takes
        # effect; this Req owns it (the properties below read the options the scheduler uses).
        self.options = (options or RequestOptions()).effective()
        # The radix-cache namespace (extra_key and cache_salt together; with a LoRA adapter, its uid too).
        self.extra_key = cache_namespace(self.options.extra_key, self.options.cache_salt)
        # The uid of the LoRA adapter (options.lora_path) this request runs with, set at admission.
        self.lora_id: Optional[str] = None

        self.output_ids: List[int] = []
        # Speculative decoding (engine/speculative/): verify steps run, drafts accepted, drafts proposed.
        self.spec_verify_ct = 0
        self.spec_accepted_tokens = 0
        self.spec_draft_tokens = 0
        self.fill_ids: List[int] = []  # tokens that will be in the KV cache after this round
        self.extend_input_len = 0

        # KV ownership
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = _EMPTY_SLOTS
        self.last_node: Any = None
        self.cache_protected_len = 0
        self.kv_allocated_len = 0

        # Finish state
        self.finished_reason: Optional[BaseFinishReason] = None
        self.to_finish: Optional[BaseFinishReason] = None
        self.finished_output = False  # the finished output was streamed (exactly once)

        # Streaming offsets: what has been sent to the detokenizer so far
        self.send_token_offset = 0
        self.send_output_logprobs_offset = 0
        self.sent_prompt_tail = False

        # Logprobs
        self.input_token_logprobs: List[float] = []  # accumulated over chunks
        self.input_top_logprobs_val_acc: List[List[float]] = []
        self.input_top_logprobs_idx_acc: List[List[int]] = []
        self.input_token_logprobs_val: Optional[List[Optional[float]]] = None  # assembled at the last chunk
        self.input_token_logprobs_idx: Optional[List[int]] = None
        self.input_top_logprobs_val: Optional[List[Optional[List[float]]]] = None
        self.input_top_logprobs_idx: Optional[List[Optional[List[int]]]] = None
        self.input_logprob_sent = False
        self.output_token_logprobs_val: List[float] = []
        self.output_token_logprobs_idx: List[int] = []
        self.output_top_logprobs_val: List[List[float]] = []
        self.output_top_logprobs_idx: List[List[int]] = []
        # token_ids_logprob: the asked ids' logprobs at each output (and asked input) position.
        self.input_token_ids_logprobs_acc: List[List[float]] = []  # accumulated over chunks
        self.input_token_ids_logprobs_val: Optional[List[Optional[List[float]]]] = None
        self.output_token_ids_logprobs_val: List[List[float]] = []

        # Hidden states. Every position's: the prompt's [len, hidden] block (one entry, once complete),
        # then one vector per decode step; "last": the newest vector alone.
        self.hidden_states: List[Any] = []
        self.prompt_hidden_states_acc: List[List[float]] = []  # accumulated over chunks
        # Entries recorded / sent so far ("last" replaces its one entry, so both count).
        self.hidden_states_recorded = 0
        self.hidden_states_sent = 0

        # Chunked prefill / retraction
        self.is_chunked = 0  # non-final chunks in flight
        self.is_retracted = False
        self.retraction_count = 0
        self.cached_tokens = 0
        self.already_computed = 0

        # Embedding requests: prefill only; the pooled vector replaces output tokens.
        self.is_embedding = False
        self.dimensions: Optional[int] = None  # Matryoshka truncation asked for (None: all)
        self.embedding: Optional[torch.Tensor] = None
        # False when every token must be computed in one forward (encoder attention, mean
        # pooling): no cached prefix and no chunked prefill for this request.
        self.can_reuse_kv = True
        # The HTTP worker whose TokenizerManager waits for this request's outputs.
        self.http_worker = 0
        # Decode side: the committed KV of a retracted request (a Future of a CPU tensor: it is
        # read on the forward stream, in order), kept until the request resumes.
        self.kv_backup: Optional[Future] = None

        self.created_time = time.monotonic()
        self.queue_time = self.created_time
        # Cache of fast_finish_ids() (computed at the first decode, when everything it reads is final).
        self.fast_finish_ids_cache: Optional[frozenset] = FAST_FINISH_UNKNOWN
        self.fast_finish_len = 0  # max_new_tokens, set with the cache (a plain attribute: read per token)

    def use_lora(self, lora_uid: str) -> None:
        """Run with the LoRA adapter `lora_uid`: its KV lives in a cache namespace of the adapter's."""
        self.lora_id = lora_uid
        self.extra_key = lora_cache_namespace(self.extra_key, lora_uid)

    # ------------------------------------------------------------------ options
    # The options the scheduler reads, by their old attribute names (new code reads req.options).
    @property
    def return_logprob(self) -> bool:
        return self.options.return_logprob

    @property
    def logprob_start_len(self) -> int:
        return self.options.logprob_start_len

    @property
    def top_logprobs_num(self) -> int:
        return self.options.top_logprobs_num

    @property
    def token_ids_logprob(self) -> Optional[List[int]]:
        return self.options.token_ids_logprob

    @property
    def return_hidden_states(self) -> bool:
        """True (every position's) or SGLang's "last" (the last position's only)."""
        return bool(self.options.return_hidden_states)

    @property
    def hidden_states_last(self) -> bool:
        return self.options.return_hidden_states == "last"

    @property
    def custom_logit_processor(self) -> Optional[str]:
        return self.options.custom_logit_processor

    @property
    def require_reasoning(self) -> bool:
        """The output starts in the model's reasoning: the grammar applies after its end tag."""
        return self.options.require_reasoning

    @property
    def routing_key(self) -> Optional[str]:
        return self.options.routing_key

    @property
    def priority(self) -> Optional[int]:
        return self.options.priority

    @priority.setter
    def priority(self, value: Optional[int]) -> None:
        self.options.priority = value  # the priority policy's default, or None when it is off

    # PD disaggregation (None in a unified server).
    @property
    def bootstrap_host(self) -> Optional[str]:
        return self.options.bootstrap_host

    @property
    def bootstrap_port(self) -> Optional[int]:
        return self.options.bootstrap_port

    @bootstrap_port.setter
    def bootstrap_port(self, value: Optional[int]) -> None:
        self.options.bootstrap_port = value  # the server's default port when the router sent none

    @property
    def bootstrap_room(self) -> Optional[int]:
        return self.options.bootstrap_room

    # ------------------------------------------------------------------ basics
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def max_new_tokens(self) -> int:
        max_new_tokens = self.sampling_params.max_new_tokens
        assert max_new_tokens is not None  # the scheduler resolves null (up to the context) on arrival
        return max_new_tokens

    def remaining_new_tokens_estimate(self) -> int:
        return min(max(self.max_new_tokens - len(self.output_ids), 0), CLIP_MAX_NEW_TOKENS_ESTIMATION)

    # ------------------------------------------------------------------ admission
    def init_next_round_input(self, tree_cache: Optional[BasePrefixCache] = None) -> None:
        """Recompute fill ids and, for a fresh or retracted request, the cached prefix."""
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None and self.req_pool_idx is None:
            match = tree_cache.match_prefix(self.fill_ids[: self._max_prefix_len()], self.extra_key)
            self.prefix_indices = match.device_indices
            self.last_node = match.last_device_node
        # A request that already holds a row (the chunked one) keeps its own prefix.
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    def _max_prefix_len(self) -> int:
        # Leave at least one token to compute (its logits give the next token), and recompute
        # prompt positions whose input logprobs were asked for.
        if not self.can_reuse_kv:
            return 0
        limit = len(self.fill_ids) - 1
        if self.needs_input_logprobs():
            limit = min(limit, self.logprob_start_len)
        if self.return_hidden_states and not self.hidden_states_last:
            limit = 0  # the hidden states of every prompt position are returned: compute them all
        return max(limit, 0)

    def needs_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and self.input_token_logprobs_val is None

    def reset_for_retract(self) -> None:
        self.prefix_indices = _EMPTY_SLOTS
        self.last_node = None
        self.cache_protected_len = 0
        self.kv_allocated_len = 0
        self.fill_ids = []
        self.extend_input_len = 0
        self.is_chunked = 0
        self.is_retracted = True
        self.retraction_count += 1
        self.already_computed = 0
        self.input_token_logprobs = []
        self.input_top_logprobs_val_acc = []
        self.input_top_logprobs_idx_acc = []
        self.input_token_ids_logprobs_acc = []
        self.prompt_hidden_states_acc = []

    @property
    def has_prompt_hidden_states(self) -> bool:
        """True once the prompt's hidden-state block was recorded (a re-prefill adds none)."""
        return bool(self.hidden_states)

    def collect_prompt_hidden_states(self, rows: torch.Tensor, last_chunk: bool) -> None:
        """One extend chunk's hidden-state rows. The prompt's form one entry, gathered over its
        chunks; a re-prefill after retraction adds only its last position's (the one a decode step
        would have added), and so does every prefill in "last" mode."""
        if self.has_prompt_hidden_states or self.hidden_states_last:
            if last_chunk and rows.shape[0] > 0:
                self.add_hidden_state(rows[-1].float().tolist())
            return
        self.prompt_hidden_states_acc.extend(rows.float().tolist())
        if last_chunk:
            self.hidden_states.append(self.prompt_hidden_states_acc)
            self.hidden_states_recorded += 1
            self.prompt_hidden_states_acc = []

    def add_hidden_state(self, vector: List[float]) -> None:
        """The hidden state of the position just run ("last" keeps it alone)."""
        if self.hidden_states_last:
            self.hidden_states = [vector]
        else:
            self.hidden_states.append(vector)
        self.hidden_states_recorded += 1

    def hidden_states_to_send(self) -> List[Any]:
        """The entries recorded since the previous emission ("last": the newest vector, if new)."""
        new = self.hidden_states_recorded - self.hidden_states_sent
        self.hidden_states_sent = self.hidden_states_recorded
        return self.hidden_states[max(len(self.hidden_states) - new, 0):] if new else []

    def record_verify(self, accepted: int, proposed: int) -> None:
        """One speculative verify step: `accepted` of its `proposed` drafts ended in the output."""
        self.spec_verify_ct += 1
        self.spec_accepted_tokens += accepted
        self.spec_draft_tokens += proposed

    def set_finish_with_abort(self, message: str, status_code: int = 400,
                              err_type: str = "BadRequestError") -> None:
        self.finished_reason = FINISH_ABORT(message, status_code, err_type)

    # ------------------------------------------------------------------ finish checks
    def check_finished(self) -> None:
        """Finish test after one token was appended to output_ids (reference order)."""
        if self.finished():
            return
        if self.to_finish is not None:
            self.finished_reason, self.to_finish = self.to_finish, None
            return
        last = self.output_ids[-1]
        if self.vocab_size is not None and not 0 <= last < self.vocab_size:
            stop_ids = sorted(self.eos_token_ids) or sorted(self.sampling_params.stop_token_ids or [0])
            self.output_ids[-1] = stop_ids[0]
            self.finished_reason = FINISH_MATCHED_STR("NaN happened")
            return
        # min_new_tokens holds back stop *tokens* only (the sampler masks them until then, as
        # SGLang's penalizer): a stop string or a stop regex ends the request at any length.
        matched = self._check_stop_strings()
        if matched is not None:
            self.finished_reason = FINISH_MATCHED_STR(matched)
            return
        try:
            matched = self._check_stop_regex()
        except stop_regex.StopRegexTimeout as e:
            self.finished_reason = FINISH_ABORT(str(e), 400, "BadRequestError")
            return
        if matched is not None:
            self.finished_reason = FINISH_MATCHED_REGEX(matched)
            return
        if (len(self.output_ids) >= self.sampling_params.min_new_tokens and not self.sampling_params.ignore_eos
                and (last in self.eos_token_ids or last in (self.sampling_params.stop_token_ids or ()))):
            self.finished_reason = FINISH_MATCHED_TOKEN(last)
            return
        if len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = FINISH_LENGTH(self.max_new_tokens)
            return
        if self.grammar is not None and self.grammar.is_terminated():
            # The grammar accepted a stop token that ignore_eos kept from finishing the request.
            self.finished_reason = FINISH_MATCHED_TOKEN(last)

    def fast_finish_ids(self) -> Optional[frozenset]:
        """For batched result processing: the token ids on which `check_finished` may end this
        request when nothing but such a token, the length, an out-of-vocabulary id or `to_finish`
        can end it; None when the full check must run after every token (stop strings or regexes,
        a grammar, logprobs or hidden states to collect).

        The caller runs `check_finished` when `to_finish` is set, the token is in this set or out
        of the vocabulary, or the output reached max_new_tokens; otherwise check_finished would
        change nothing (min_new_tokens only delays what this set already covers). A new finish
        condition in check_finished must make this None for the requests it concerns.
        """
        cached = self.fast_finish_ids_cache
        if cached is not FAST_FINISH_UNKNOWN:
            return cached
        sp = self.sampling_params
        if (self.grammar is not None or self.return_logprob or self.return_hidden_states or sp.stop_strs
                or sp.stop_regex_strs):
            ids: Optional[frozenset] = None
        elif sp.ignore_eos:
            ids = frozenset()
        else:
            ids = frozenset(self.eos_token_ids) | frozenset(sp.stop_token_ids or ())
        self.fast_finish_ids_cache = ids
        self.fast_finish_len = self.max_new_tokens
        return ids

    def accept_grammar_token(self, token: int) -> None:
        """Advance the matcher by the token just appended; a token the grammar does not allow
        (no token could continue the output: a dead end) finishes the request with an abort."""
        if self.grammar is None or self.finished() or self.to_finish is not None:
            return
        if not self.grammar.accept_token(token):
            self.to_finish = FINISH_ABORT(
                f"Constrained decoding reached a dead end after {len(self.output_ids) - 1} output tokens: "
                "no token allowed by the grammar can continue the output (check that the constraint, "
                "min_tokens and the stop settings are compatible).", 400, "BadRequestError")

    def _stop_window(self) -> int:
        # A stop string may be produced in more tokens than it encodes to (" world" spelled letter
        # by letter, an emoji spelled byte by byte), so the window also covers one token per UTF-8
        # byte; the extra token is the one that may hold the occurrence's first bytes after others.
        # Its size depends on the stop strings only, never on the output's length.
        sp = self.sampling_params
        return max(sp.stop_str_max_len, max((len(s.encode("utf-8")) for s in sp.stop_strs), default=0)) + 1

    def tail_str(self) -> str:
        return self.decode(self.output_ids[-self._stop_window():])

    def decode(self, ids: List[int]) -> str:
        if self.tokenizer is None:
            raise RuntimeError("stop strings need a tokenizer in the scheduler")
        return self.tokenizer.decode(ids)

    def _check_stop_strings(self) -> Optional[str]:
        """The stop string that the newest token completes, if any.

        Only an occurrence that ends in the newest token's text counts: every token is checked, so
        one completed earlier ended the request then. The detokenizer cuts the text at the same
        occurrence (`detokenizer_manager.stop_cut_position`), so the text ends where the ids do.
        """
        stops = self.sampling_params.stop_strs
        if not stops:
            return None
        window = self.output_ids[-self._stop_window():]
        tail = self.decode(window)
        before: Optional[int] = None  # length of the window's text without the newest token
        for stop in stops:
            if stop not in tail:
                continue
            if before is None:
                before = settled_text_len(self.decode(window[:-1]))
            if tail.rfind(stop) + len(stop) > before:
                return stop
        return None

    def _check_stop_regex(self) -> Optional[str]:
        """The stop regex that matches the output's tail, if any (SGLang: re.search on the tail
        of max(stop_regex_max_len, stop_str_max_len) + 1 tokens; stop_regex_max_len is at most
        stop_regex.STOP_REGEX_MAX_WINDOW, where SGLang may search the whole output)."""
        sp = self.sampling_params
        patterns = sp.stop_regex_strs
        if not patterns:
            return None
        window = max(sp.stop_regex_max_len, sp.stop_str_max_len) + 1
        tail = self.decode(self.output_ids[-window:])
        for pattern, compiled in zip(patterns, sp.stop_regex_compiled):
            if stop_regex.search(compiled, tail):
                return pattern
        return None

    def tail_may_start_stop_str(self) -> bool:
        """True when the output tail could be the beginning of a stop string (hold back the stream)."""
        stops = self.sampling_params.stop_strs
        if not stops or not self.output_ids:
            return False
        tail = self.tail_str()
        # A trailing U+FFFD may be a character still incomplete: the text before it may start a
        # stop string that this character continues.
        tails = (tail, tail.rstrip(REPLACEMENT_CHAR)) if tail.endswith(REPLACEMENT_CHAR) else (tail,)
        for stop in stops:
            if stop in tail:
                return True
            for text in tails:
                for n in range(1, min(len(stop), len(text)) + 1):
                    if text.endswith(stop[:n]):
                        return True
        return False

    def __repr__(self) -> str:
        return (f"Req(rid={self.rid!r}, input_len={len(self.origin_input_ids)}, "
                f"output_len={len(self.output_ids)}, finished={self.finished()})")
