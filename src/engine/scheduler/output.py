"""Turning forward results into request state, and request state into BatchTokenIDOutput.

`ResultProcessor` appends sampled tokens, runs finish checks, releases KV and gathers logprobs.
`OutputStreamer` decides which requests emit this iteration (stream_interval, hold-back of partial
stop strings, every 50 tokens for non-streaming requests, finish exactly once) and builds the one
message per iteration sent to the detokenizer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from engine.io_struct import BatchTokenIDOutput
from engine.scheduler.req import FAST_FINISH_UNKNOWN, FINISH_LENGTH, FINISH_MATCHED_REGEX, Req

if TYPE_CHECKING:
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.scheduler.tp_worker import GenerationBatchResult

# A non-streaming request still goes to the detokenizer every this many tokens (incremental decode).
DEFAULT_FORCE_STREAM_INTERVAL = 50
# Prompt ids sent as left context for detokenizing a request's first output ids.
DETOKENIZE_CONTEXT_TOKENS = 5


class ResultProcessor:
    def __init__(self, tree_cache: BasePrefixCache, prefill_handoff: Optional[Callable[[Req], None]] = None) -> None:
        self.tree_cache = tree_cache
        # PD prefill server: a request's first token goes to the transfer instead of decoding here.
        self.prefill_handoff = prefill_handoff

    def process_prefill(self, batch: "ScheduleBatch", result: "GenerationBatchResult") -> List[Req]:
        """Returns the requests that may emit output (mid-chunk requests are left out)."""
        assert result.next_token_ids is not None  # a result is processed after its sampling ran
        next_ids = result.next_token_ids.tolist()
        lp = LogprobLists(result.logits_output, batch)
        hidden = _hidden_states(result)
        decoding = {id(r) for r in batch.decoding_reqs}
        emit: List[Req] = []
        extend_offset = 0
        for i, req in enumerate(batch.reqs):
            row_start, extend_offset = extend_offset, extend_offset + batch.extend_lens[i]
            if id(req) in decoding:
                if req.finished() or req.is_retracted:
                    continue  # finished or retracted while this batch was in flight (overlap)
                self._append_token(req, next_ids[i], lp, i)
                emit.append(req)
                continue
            if req.finished():
                emit.append(req)
                continue
            if req.is_retracted:
                continue  # retracted while its prefill was in flight (overlap): re-prefilled later
            lp.collect_input(req, i)
            if req.return_hidden_states and hidden is not None:
                req.collect_prompt_hidden_states(hidden[row_start:extend_offset], last_chunk=req.is_chunked == 0)
            if req.is_chunked > 0:
                # A middle chunk: its sampled token is meaningless, nothing is streamed.
                req.is_chunked -= 1
                continue
            lp.finalize_input(req)
            if self.prefill_handoff is not None:
                req.output_ids.append(next_ids[i])
                if req.return_logprob:
                    lp.collect_output(req, i, next_ids[i])
                self.prefill_handoff(req)  # it streams the request when the transfer ends
                continue
            if req.max_new_tokens == 0:
                req.finished_reason = req.to_finish or FINISH_LENGTH(0)
                self.tree_cache.cache_finished_req(req)
            else:
                self._append_token(req, next_ids[i], lp, i)
                if not req.finished():
                    # Make the prompt's KV shareable at once; the request keeps a lock on it.
                    self.tree_cache.cache_unfinished_req(req)
            emit.append(req)
        return emit

    def process_decode(self, batch: "ScheduleBatch", result: "GenerationBatchResult") -> List[Req]:
        assert result.next_token_ids is not None  # a result is processed after its sampling ran
        next_ids = result.next_token_ids.tolist()
        lp = LogprobLists(result.logits_output, batch)
        hidden = _hidden_states(result)
        # An id outside the vocabulary (NaN logits) takes the full check of every request.
        fast = not next_ids or (min(next_ids) >= 0 and max(next_ids) < batch.vocab_size)
        emit: List[Req] = []
        allocator = batch.token_to_kv_pool_allocator
        allocator.free_group_begin()
        try:
            for i, (req, token) in enumerate(zip(batch.reqs, next_ids)):
                if req.finished_reason is not None or req.is_retracted:
                    continue
                emit.append(req)
                stop_ids = req.fast_finish_ids_cache
                if fast and stop_ids is not None and req.to_finish is None:
                    if stop_ids is FAST_FINISH_UNKNOWN:
                        stop_ids = req.fast_finish_ids()
                    if stop_ids is not None:
                        # Batched path: only a token that may end the request runs the full check.
                        out = req.output_ids
                        out.append(token)
                        if token in stop_ids or len(out) >= req.fast_finish_len:
                            self._check_finished(req)
                        continue
                if req.return_hidden_states and hidden is not None:
                    # The hidden state of the token fed at this step (the one sampled last step).
                    req.add_hidden_state(hidden[i].float().tolist())
                self._append_token(req, token, lp, i)
        finally:
            allocator.free_group_end()
        return emit

    def _append_token(self, req: Req, token: int, lp: "LogprobLists", row: int) -> None:
        req.output_ids.append(token)
        if req.return_logprob:
            lp.collect_output(req, row, token)
        req.accept_grammar_token(token)
        self._check_finished(req)

    def _check_finished(self, req: Req) -> None:
        req.check_finished()
        if req.finished():
            self.tree_cache.cache_finished_req(req)


def _hidden_states(result: "GenerationBatchResult") -> Optional[Any]:
    out = result.logits_output
    return None if out is None else out.hidden_states


class LogprobLists:
    """Python lists of one batch's logprob tensors, converted once."""

    def __init__(self, logits_output: Any, batch: "ScheduleBatch") -> None:
        self.batch = batch
        self.next_lp: Optional[List[float]] = None
        self.top_val = self.top_idx = None
        self.input_lp: Optional[List[float]] = None
        self.input_offsets: List[int] = []
        self.input_top_val = self.input_top_idx = None
        self.next_ids_lp: Optional[List[Optional[List[float]]]] = None
        self.input_ids_lp: Optional[List[Optional[List[List[float]]]]] = None
        if logits_output is None or not batch.return_logprob:
            return
        self.next_ids_lp = logits_output.next_token_token_ids_logprobs_val
        self.input_ids_lp = logits_output.input_token_ids_logprobs_val
        if logits_output.next_token_logprobs is not None:
            self.next_lp = logits_output.next_token_logprobs.tolist()
        self.top_val = logits_output.next_token_top_logprobs_val
        self.top_idx = logits_output.next_token_top_logprobs_idx
        if logits_output.input_token_logprobs is not None:
            self.input_lp = logits_output.input_token_logprobs.tolist()
            self.input_top_val = logits_output.input_top_logprobs_val
            self.input_top_idx = logits_output.input_top_logprobs_idx
            # Start of each request's slice in the flat input-logprob list.
            pos = 0
            for ext, start in zip(batch.extend_lens, batch.extend_logprob_start_lens):
                self.input_offsets.append(pos)
                pos += ext - start

    def collect_output(self, req: Req, row: int, token: int) -> None:
        if self.next_lp is None:
            return
        req.output_token_logprobs_val.append(self.next_lp[row])
        req.output_token_logprobs_idx.append(token)
        if req.top_logprobs_num > 0 and self.top_val is not None:
            assert self.top_idx is not None  # the sampler fills values and indices together
            req.output_top_logprobs_val.append(list(self.top_val[row]))
            req.output_top_logprobs_idx.append(list(self.top_idx[row]))
        ids_lp = self.next_ids_lp[row] if req.token_ids_logprob and self.next_ids_lp is not None else None
        if ids_lp is not None:
            req.output_token_ids_logprobs_val.append(ids_lp)

    def collect_input(self, req: Req, row: int) -> None:
        if self.input_lp is None or not req.needs_input_logprobs():
            return
        count = self.batch.extend_lens[row] - self.batch.extend_logprob_start_lens[row]
        if count <= 0:
            return
        off = self.input_offsets[row]
        req.input_token_logprobs.extend(self.input_lp[off:off + count])
        if req.top_logprobs_num > 0 and self.input_top_val is not None:
            assert self.input_top_idx is not None  # the logits processor fills values and indices together
            req.input_top_logprobs_val_acc.extend(self.input_top_val[row])
            req.input_top_logprobs_idx_acc.extend(self.input_top_idx[row])
        ids_lp = self.input_ids_lp[row] if req.token_ids_logprob and self.input_ids_lp is not None else None
        if ids_lp is not None:
            req.input_token_ids_logprobs_acc.extend(ids_lp)

    @staticmethod
    def finalize_input(req: Req) -> None:
        """At the last chunk: entry k is the logprob of origin[start + k]; the first is None."""
        if not req.needs_input_logprobs():
            return
        start = req.logprob_start_len
        values = req.input_token_logprobs
        if start >= len(req.origin_input_ids):
            # A start at the prompt length asks for no input position at all.
            req.input_token_logprobs_val, req.input_token_logprobs_idx = [], []
            if req.top_logprobs_num > 0:
                req.input_top_logprobs_val, req.input_top_logprobs_idx = [], []
            if req.token_ids_logprob:
                req.input_token_ids_logprobs_val = []
        else:
            req.input_token_logprobs_val = [None] + values[:-1]
            req.input_token_logprobs_idx = list(req.origin_input_ids[start:])
            if req.top_logprobs_num > 0:
                req.input_top_logprobs_val = [None] + req.input_top_logprobs_val_acc[:-1]
                req.input_top_logprobs_idx = [None] + req.input_top_logprobs_idx_acc[:-1]
            if req.token_ids_logprob:
                req.input_token_ids_logprobs_val = [None] + req.input_token_ids_logprobs_acc[:-1]
        req.input_token_ids_logprobs_acc = []
        req.input_token_logprobs = []
        req.input_top_logprobs_val_acc = []
        req.input_top_logprobs_idx_acc = []


class OutputStreamer:
    def __init__(self, stream_interval: int, speculative: bool = False) -> None:
        self.stream_interval = stream_interval
        # With speculative decoding every message carries each request's verify counters.
        self.speculative = speculative

    def build(self, reqs: List[Req]) -> Optional[BatchTokenIDOutput]:
        """One message with every request of `reqs` (each once) that is due to emit.

        Due: a finished request once; a streaming one every stream_interval tokens (its own or the
        server's), a non-streaming one every DEFAULT_FORCE_STREAM_INTERVAL tokens, and never while
        its tail may be the beginning of a stop string (sent text is final: the detokenizer cannot
        take it back when the stop string completes).

        One pass over the requests decides and fills every common column: with thousands of
        requests their objects do not stay in the CPU caches, and a pass per column (list
        comprehensions) fetched each of them again (4096 streaming requests, host alone,
        alternating runs on the shared machine: 9.2 -> 6.8 us per request and step on average;
        the spread between runs is as large). Optional columns stay empty when no request of the message
        needs them (the receivers read a missing entry as None): the prompt tails when none emits
        for the first time, the logprob columns when none asked for logprobs, the hidden states
        when none asked for them.
        """
        interval = self.stream_interval
        sel: List[Req] = []
        rids: List[str] = []
        finished_reasons: List[Optional[Dict[str, Any]]] = []
        output_ids: List[List[int]] = []
        skips: List[bool] = []
        spaces: List[bool] = []
        no_stop_trim: List[bool] = []
        prompt_tokens: List[int] = []
        completion_tokens: List[int] = []
        cached_tokens: List[int] = []
        http_workers: List[int] = []
        firsts: List[Req] = []
        want_logprobs = want_hidden = False
        for req in dict.fromkeys(reqs):  # dedupe, keep order
            reason = req.finished_reason
            out = req.output_ids
            offset = req.send_token_offset
            sp = req.sampling_params
            if reason is None:
                n = len(out)
                if n <= offset:
                    continue
                if req.stream:
                    k = sp.stream_interval or interval
                    if k > 1 and n % k != 1:
                        continue
                elif n % DEFAULT_FORCE_STREAM_INTERVAL:
                    continue
                if sp.stop and req.tail_may_start_stop_str():
                    continue
                finished_reasons.append(None)
                no_stop_trim.append(sp.no_stop_trim)
            else:
                if req.finished_output:
                    continue
                req.finished_output = True
                finished_reasons.append(reason.to_json())
                # A stop_regex match is not trimmed from the text (SGLang).
                no_stop_trim.append(sp.no_stop_trim or isinstance(reason, FINISH_MATCHED_REGEX))
            sel.append(req)
            if not req.sent_prompt_tail:
                req.sent_prompt_tail = True
                if offset == 0:
                    firsts.append(req)
            rids.append(req.rid)
            output_ids.append(out[offset:])
            n = req.send_token_offset = len(out)
            completion_tokens.append(n)
            skips.append(sp.skip_special_tokens)
            spaces.append(sp.spaces_between_special_tokens)
            prompt_tokens.append(len(req.origin_input_ids))
            cached_tokens.append(req.cached_tokens)
            http_workers.append(req.http_worker)
            if req.return_logprob:
                want_logprobs = True
            if req.return_hidden_states:
                want_hidden = True
        if not sel:
            return None
        msg = BatchTokenIDOutput(
            rids=rids,
            finished_reasons=finished_reasons,
            output_ids=output_ids,
            skip_special_tokens=skips,
            spaces_between_special_tokens=spaces,
            no_stop_trim=no_stop_trim,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            http_workers=http_workers,
        )
        if firsts:
            tails = {id(req): req.origin_input_ids[-DETOKENIZE_CONTEXT_TOKENS:] for req in firsts}
            msg.prompt_tail_ids = [tails.get(id(req)) for req in sel]
        if want_logprobs:
            _add_logprobs(msg, sel)
        if want_hidden:
            msg.output_hidden_states = [req.hidden_states_to_send() if req.return_hidden_states else None
                                        for req in sel]
        if self.speculative:
            msg.spec_verify_ct = [req.spec_verify_ct for req in sel]
            msg.spec_accepted_tokens = [req.spec_accepted_tokens for req in sel]
            msg.spec_draft_tokens = [req.spec_draft_tokens for req in sel]
        return msg


def _add_logprobs(msg: BatchTokenIDOutput, sel: List[Req]) -> None:
    """The logprob columns of a message (deltas since each request's previous emission)."""
    out: Dict[str, list] = {name: [] for name in _INPUT_LOGPROB_FIELDS + _OUTPUT_LOGPROB_FIELDS}
    for req in sel:
        if req.return_logprob and req.input_token_logprobs_val is not None and not req.input_logprob_sent:
            req.input_logprob_sent = True
            out["input_token_logprobs_val"].append(req.input_token_logprobs_val)
            out["input_token_logprobs_idx"].append(req.input_token_logprobs_idx)
            out["input_top_logprobs_val"].append(req.input_top_logprobs_val)
            out["input_top_logprobs_idx"].append(req.input_top_logprobs_idx)
            ids = req.token_ids_logprob
            vals = req.input_token_ids_logprobs_val if ids else None
            out["input_token_ids_logprobs_val"].append(vals)
            out["input_token_ids_logprobs_idx"].append(None if vals is None else [None if v is None else ids for v in vals])
        else:
            for name in _INPUT_LOGPROB_FIELDS:
                out[name].append(None)
        if req.return_logprob:
            o = req.send_output_logprobs_offset
            out["output_token_logprobs_val"].append(req.output_token_logprobs_val[o:])
            out["output_token_logprobs_idx"].append(req.output_token_logprobs_idx[o:])
            tops = req.top_logprobs_num > 0
            out["output_top_logprobs_val"].append(req.output_top_logprobs_val[o:] if tops else None)
            out["output_top_logprobs_idx"].append(req.output_top_logprobs_idx[o:] if tops else None)
            ids = req.token_ids_logprob
            out_vals = req.output_token_ids_logprobs_val[o:] if ids else None
            out["output_token_ids_logprobs_val"].append(out_vals)
            out["output_token_ids_logprobs_idx"].append(None if out_vals is None else [ids] * len(out_vals))
            req.send_output_logprobs_offset = len(req.output_token_logprobs_val)
        else:
            for name in _OUTPUT_LOGPROB_FIELDS:
                out[name].append(None)
    for name, values in out.items():
        setattr(msg, name, values)


_INPUT_LOGPROB_FIELDS = (
    "input_token_logprobs_val", "input_token_logprobs_idx", "input_top_logprobs_val", "input_top_logprobs_idx",
    "input_token_ids_logprobs_val", "input_token_ids_logprobs_idx",
)
_OUTPUT_LOGPROB_FIELDS = (
    "output_token_logprobs_val", "output_token_logprobs_idx", "output_top_logprobs_val", "output_top_logprobs_idx",
    "output_token_ids_logprobs_val", "output_token_ids_logprobs_idx",
)
