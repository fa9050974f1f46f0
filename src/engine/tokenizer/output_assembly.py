"""Output assembly: the per-request state the TokenizerManager accumulates from BatchStrOutput.

Each detokenizer message carries, per request, a text delta, the new token ids, token counts,
logprobs and (once) a finish reason. `OutputAssembler.apply` folds one entry into a `ReqState`;
`build_output` turns the state into the dict that /generate and the Engine return.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from engine.io_struct import BatchStrOutput
from engine.tokenizer.metrics import RequestTimer


class ClientProbe(Protocol):
    """Whoever sent a request, as far as the TokenizerManager cares: is it still there?"""

    async def is_disconnected(self) -> bool: ...


@dataclass
class ReqState:
    """What the TokenizerManager knows about one in-flight (sub-)request."""

    rid: str
    stream: bool
    return_logprob: bool
    return_text_in_logprobs: bool
    created_time: float
    return_hidden_states: bool = False
    # return_hidden_states "last": each output replaces the one vector instead of adding entries.
    hidden_states_last: bool = False
    no_logs: bool = False
    # return_prompt_token_ids: the prompt as tokenized, in every output (SGLang's "prompt_token_ids").
    prompt_token_ids: Optional[list[int]] = None
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finished_reason: Optional[dict] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Speculative decoding: verify steps, accepted and proposed drafts (None: speculation is off).
    spec_verify_ct: Optional[int] = None
    spec_accepted_tokens: int = 0
    spec_draft_tokens: int = 0
    input_token_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_ids_logprobs: list = field(default_factory=list)
    output_token_ids_logprobs: list = field(default_factory=list)
    hidden_states: list = field(default_factory=list)
    # Set when metrics are enabled and the request is not a health probe.
    timer: Optional[RequestTimer] = None
    embedding: Optional[bytes] = None  # an embedding request's float32 vector
    # --incremental-streaming-output on a stream: each output carries only what is new since the
    # previous one; these count what was handed out (text characters, output tokens).
    incremental: bool = False
    sent_text: int = 0
    sent_ids: int = 0
    # Waking the waiter (event): new output to yield, or the disconnect sweeper's turn to have
    # the client checked (`client`: what the waiter polls, while it waits).
    has_update: bool = False
    check_client: bool = False
    client: Optional[ClientProbe] = None

    def notify_update(self) -> None:
        """Wake the waiter for new output (or a terminal state) to hand out."""
        self.has_update = True
        self.event.set()


def build_output(state: ReqState) -> dict:
    """The SGLang-shaped output dict of a request so far (text, output_ids, meta_info); for an
    incremental stream, only the text, output ids and output logprobs since the previous call."""
    meta: dict[str, Any] = {
        "id": state.rid,
        "prompt_tokens": state.prompt_tokens,
        "completion_tokens": state.completion_tokens,
        "cached_tokens": state.cached_tokens,
        # Copied so a consumer cannot alter the state (deepcopy of None costs as much as a small dict).
        "finish_reason": None if state.finished_reason is None else copy.deepcopy(state.finished_reason),
        "e2e_latency": time.time() - state.created_time,
    }
    if state.spec_verify_ct is not None:
        meta.update(spec_meta_info(state.spec_verify_ct, state.spec_accepted_tokens, state.spec_draft_tokens,
                                   state.completion_tokens))
    text, ids = state.text, list(state.output_ids)
    done = 0  # output positions already handed out (output logprobs are per output position)
    if state.incremental:
        text, ids, done = text[state.sent_text:], ids[state.sent_ids:], state.sent_ids
        state.sent_text, state.sent_ids = len(state.text), len(state.output_ids)
    if state.return_logprob:
        meta["input_token_logprobs"] = list(state.input_token_logprobs)
        meta["input_top_logprobs"] = list(state.input_top_logprobs)
        meta["output_token_logprobs"] = state.output_token_logprobs[done:]
        meta["output_top_logprobs"] = state.output_top_logprobs[done:]
        meta["input_token_ids_logprobs"] = list(state.input_token_ids_logprobs)
        meta["output_token_ids_logprobs"] = state.output_token_ids_logprobs[done:]
    if state.return_hidden_states:
        meta["hidden_states"] = list(state.hidden_states)
    out: dict[str, Any] = {"text": text, "output_ids": ids, "meta_info": meta}
    if state.prompt_token_ids is not None:
        out["prompt_token_ids"] = list(state.prompt_token_ids)
    return out


def spec_meta_info(verify_ct: int, accepted: int, drafts: int, completion_tokens: int) -> dict[str, Any]:
    """SGLang's speculative meta_info: spec_verify_ct always; spec_accept_length (completion tokens
    per verify step, its first prefill token included, as SGLang counts it) and spec_accept_rate
    (accepted / proposed drafts) 0 until a verify step ran. spec_draft_token_num counts the drafts
    really proposed (SGLang multiplies the steps by --speculative-num-draft-tokens - 1: its NGRAM
    pads every step to that many; ours proposes fewer when the request's text offers fewer)."""
    meta: dict[str, Any] = {"spec_verify_ct": verify_ct, "spec_accept_rate": 0.0, "spec_accept_length": 0}
    if verify_ct > 0:
        meta["spec_accept_length"] = completion_tokens / verify_ct
        meta["spec_accept_rate"] = accepted / drafts if drafts else 0.0
        meta["spec_accept_token_num"] = accepted
        meta["spec_draft_token_num"] = drafts
    return meta


class OutputAssembler:
    """Folds BatchStrOutput entries into request states (with token texts for logprobs)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def apply(self, state: ReqState, batch: BatchStrOutput, i: int) -> None:
        """Add entry `i` of `batch` to `state` (the caller wakes the state's waiter)."""
        state.text += batch.output_strs[i]
        state.output_ids.extend(batch.output_ids[i])
        state.prompt_tokens = batch.prompt_tokens[i]
        state.completion_tokens = batch.completion_tokens[i]
        state.cached_tokens = batch.cached_tokens[i]
        if batch.spec_verify_ct:
            state.spec_verify_ct = batch.spec_verify_ct[i]
            state.spec_accepted_tokens = batch.spec_accepted_tokens[i]
            state.spec_draft_tokens = batch.spec_draft_tokens[i]
        if state.return_logprob:
            self._append_logprobs(state, batch, i)
        hidden = _at(batch.output_hidden_states, i)
        if hidden:
            if state.hidden_states_last:
                state.hidden_states = list(hidden)
            else:
                state.hidden_states.extend(hidden)
        reason = batch.finished_reasons[i]
        if reason is not None:
            state.finished = True
            state.finished_reason = dict(reason)

    def _append_logprobs(self, state: ReqState, batch: BatchStrOutput, i: int) -> None:
        text = state.return_text_in_logprobs
        for target, val_name, idx_name, per_position in _LOGPROB_FIELDS:
            vals = _at(getattr(batch, val_name), i)
            if vals is None:
                continue
            ids = _at(getattr(batch, idx_name), i)
            entries = self._top_logprobs(vals, ids, text) if per_position else self._token_logprobs(vals, ids, text)
            getattr(state, target).extend(entries)

    def _token_logprobs(self, vals: list, ids: Optional[list], with_text: bool) -> list[list]:
        ids = ids or []
        texts = self._token_texts(ids) if with_text else [None] * len(ids)
        return [[v, t, s] for v, t, s in zip(vals, ids, texts)]

    def _top_logprobs(self, vals: list, ids: Optional[list], with_text: bool) -> list:
        out: list = []
        for pos_vals, pos_ids in zip(vals, ids or []):
            if pos_vals is None or pos_ids is None:
                out.append(None)
            else:
                out.append(self._token_logprobs(pos_vals, pos_ids, with_text))
        return out

    def _token_texts(self, ids: list[int]) -> list[Optional[str]]:
        if self.tokenizer is None or not ids:
            return [None] * len(ids)
        return self.tokenizer.batch_decode([[t] for t in ids])


# ReqState list <- BatchStrOutput value and id fields; per_position: one list of entries per
# position (top logprobs, token_ids_logprob), else one entry per position.
_LOGPROB_FIELDS = (
    ("input_token_logprobs", "input_token_logprobs_val", "input_token_logprobs_idx", False),
    ("input_top_logprobs", "input_top_logprobs_val", "input_top_logprobs_idx", True),
    ("output_token_logprobs", "output_token_logprobs_val", "output_token_logprobs_idx", False),
    ("output_top_logprobs", "output_top_logprobs_val", "output_top_logprobs_idx", True),
    ("input_token_ids_logprobs", "input_token_ids_logprobs_val", "input_token_ids_logprobs_idx", True),
    ("output_token_ids_logprobs", "output_token_ids_logprobs_val", "output_token_ids_logprobs_idx", True),
)


def _at(values: list, i: int) -> Any:
    return values[i] if i < len(values) else None
