"""DetokenizerManager: its own process, turning the scheduler's token ids into text deltas.

Loop: receive a BatchTokenIDOutput from the scheduler, decode every request of the batch
incrementally (one tokenizer.batch_decode call per flag combination), and send a BatchStrOutput
with the new text of each request to the TokenizerManager (with several HTTP workers, to each
worker the rows of its own requests).
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import zmq

from engine.io_struct import BatchStrOutput, BatchTokenIDOutput, decode, encode, route_to_workers
from engine.port_args import PortArgs
from engine.server_args import ServerArgs
from engine.launch.children import exit_before_ready
from engine.utils.log_utils import configure_logging
from engine.utils.process_utils import freeze_startup_objects, set_process_title, start_parent_death_watcher
from engine.utils.tokenizer_utils import (
    REPLACEMENT_CHAR,
    BatchDecode,
    make_batch_decoder,
    settled_text_len,
    tokenizer_from_bytes,
)
from engine.utils.zmq_utils import get_zmq_socket

logger = logging.getLogger(__name__)


@dataclass
class DecodeStatus:
    """Incremental detokenization state of one request (schedule-batch.md §3.9).

    `decode_ids[surr_offset:read_offset]` is context already committed to `decoded_text`; it is
    decoded again with the new ids so that tokenizers whose rendering of a token depends on its
    left neighbour still produce the right text. `sent_offset` counts characters already sent.
    """

    decode_ids: list[int] = field(default_factory=list)
    decoded_text: str = ""
    surr_offset: int = 0
    read_offset: int = 0
    sent_offset: int = 0


def printable_prefix(text: str) -> str:
    """The part of pending text that can never change: everything before the first U+FFFD.

    A trailing U+FFFD is the decoder's stand-in for an incomplete UTF-8 sequence; the next token
    may complete it, so the text from there on is held back.
    """
    cut = text.find(REPLACEMENT_CHAR)
    return text if cut == -1 else text[:cut]


def stop_cut_position(text: str, stop: str, text_before_last_token: Optional[int]) -> int:
    """Where the occurrence of `stop` that ended the request starts in `text` (-1: none).

    The scheduler ends a request on the token that completes a stop string (Req.check_finished),
    so the ending occurrence is the first one that ends inside the last token's text (after
    `text_before_last_token` characters); the text then ends where the output ids do, even where
    the scheduler's view of the text differed from this one's. Without that length, or when no
    occurrence ends there (output sent past the stop string by another producer), the last
    occurrence.
    """
    if text_before_last_token is not None:
        pos = text.find(stop, max(text_before_last_token - len(stop) + 1, 0))
        if pos != -1:
            return pos
    return text.rfind(stop)


def trim_matched_stop(text: str, finished_reason: Optional[dict], no_stop_trim: bool,
                      text_before_last_token: Optional[int] = None) -> str:
    """Cut the matched stop string (and what follows it) off the final text."""
    if not finished_reason or no_stop_trim:
        return text
    matched = finished_reason.get("matched")
    if isinstance(matched, str) and matched:
        pos = stop_cut_position(text, matched, text_before_last_token)
        if pos != -1:
            return text[:pos]
    return text


class DetokenizerManager:
    """Keeps one DecodeStatus per running request and turns id deltas into text deltas."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decode_status: dict[str, DecodeStatus] = {}
        self._decode_batch: Optional[BatchDecode] = make_batch_decoder(tokenizer) if tokenizer is not None else None

    # ------------------------------------------------------------------ decoding
    def handle_batch_token_id_out(self, recv: BatchTokenIDOutput) -> BatchStrOutput:
        states, end_offsets = self._extend_states(recv)
        surr_texts, read_texts = self._batch_decode(recv, states, end_offsets)
        finished_reasons = recv.finished_reasons
        output_strs: list[str] = []
        for i, state in enumerate(states):
            new_text = read_texts[i][len(surr_texts[i]):]
            if finished_reasons[i] is None:
                output_strs.append(self._running_delta(state, new_text, end_offsets[i]))
            else:
                output_strs.append(self._final_delta(state, new_text, recv, i, end_offsets[i], surr_texts[i]))
                del self.decode_status[recv.rids[i]]

        return BatchStrOutput(
            rids=recv.rids,
            finished_reasons=recv.finished_reasons,
            output_strs=output_strs,
            output_ids=recv.output_ids,
            prompt_tokens=recv.prompt_tokens,
            completion_tokens=recv.completion_tokens,
            cached_tokens=recv.cached_tokens,
            input_token_logprobs_val=recv.input_token_logprobs_val,
            input_token_logprobs_idx=recv.input_token_logprobs_idx,
            input_top_logprobs_val=recv.input_top_logprobs_val,
            input_top_logprobs_idx=recv.input_top_logprobs_idx,
            output_token_logprobs_val=recv.output_token_logprobs_val,
            output_token_logprobs_idx=recv.output_token_logprobs_idx,
            output_top_logprobs_val=recv.output_top_logprobs_val,
            output_top_logprobs_idx=recv.output_top_logprobs_idx,
            input_token_ids_logprobs_val=recv.input_token_ids_logprobs_val,
            input_token_ids_logprobs_idx=recv.input_token_ids_logprobs_idx,
            output_token_ids_logprobs_val=recv.output_token_ids_logprobs_val,
            output_token_ids_logprobs_idx=recv.output_token_ids_logprobs_idx,
            output_hidden_states=recv.output_hidden_states,
            http_workers=recv.http_workers,
            spec_verify_ct=recv.spec_verify_ct,
            spec_accepted_tokens=recv.spec_accepted_tokens,
            spec_draft_tokens=recv.spec_draft_tokens,
        )

    def _extend_states(self, recv: BatchTokenIDOutput) -> tuple[list[DecodeStatus], list[int]]:
        """Each request's state with its new ids appended, and how many of its ids to decode."""
        statuses = self.decode_status
        tails = recv.prompt_tail_ids
        states: list[DecodeStatus] = []
        end_offsets: list[int] = []
        for i, (rid, ids, reason) in enumerate(zip(recv.rids, recv.output_ids, recv.finished_reasons)):
            state = statuses.get(rid)
            if state is None:
                # The prompt's last ids are left context only: decoded with the output, never sent.
                context = (tails[i] if tails else None) or []
                state = DecodeStatus(decode_ids=list(context), read_offset=len(context))
                statuses[rid] = state
            state.decode_ids.extend(ids)
            states.append(state)
            end_offsets.append(len(state.decode_ids) if reason is None
                               else self._decode_end(state, reason, recv.no_stop_trim[i]))
        return states, end_offsets

    @staticmethod
    def _running_delta(state: DecodeStatus, new_text: str, end: int) -> str:
        """The text of a running request to send now: committed text and the printable part of
        the pending text (held back from the first U+FFFD) not sent yet."""
        if new_text and not new_text.endswith(REPLACEMENT_CHAR):
            state.decoded_text += new_text
            state.surr_offset = state.read_offset
            state.read_offset = end
            new_text = ""
        else:
            new_text = printable_prefix(new_text)
        # (decoded_text + new_text)[sent_offset:] without building the whole text.
        decoded, sent = state.decoded_text, state.sent_offset
        delta = new_text[sent - len(decoded):] if sent >= len(decoded) else decoded[sent:] + new_text
        state.sent_offset = max(sent, len(decoded) + len(new_text))
        return delta

    def _final_delta(self, state: DecodeStatus, new_text: str, recv: BatchTokenIDOutput, i: int, end: int,
                     surr_text: str) -> str:
        """The rest of a finished request's text: pending text flushed as is (no later token can
        complete it), a matched stop string trimmed."""
        finished_reason, no_stop_trim = recv.finished_reasons[i], recv.no_stop_trim[i]
        before_last = None
        if self._matched_stop_str(finished_reason, no_stop_trim):
            before_last = self._text_len_before_last_token(state, end, surr_text, recv, i)
        full_text = trim_matched_stop(state.decoded_text + new_text, finished_reason, no_stop_trim, before_last)
        delta = full_text[state.sent_offset:]
        state.sent_offset = max(state.sent_offset, len(full_text))
        return delta

    @staticmethod
    def _decode_end(state: DecodeStatus, finished_reason: Optional[dict], no_stop_trim: bool) -> int:
        """How many ids to decode: all, except a matched stop token at finish (trimmed from text)."""
        end = len(state.decode_ids)
        if finished_reason and not no_stop_trim:
            matched = finished_reason.get("matched")
            if (isinstance(matched, int) and not isinstance(matched, bool) and end > state.read_offset
                    and state.decode_ids[-1] == matched):
                end -= 1
        return end

    @staticmethod
    def _matched_stop_str(finished_reason: Optional[dict], no_stop_trim: bool) -> bool:
        return bool(finished_reason and not no_stop_trim and isinstance(finished_reason.get("matched"), str))

    def _text_len_before_last_token(self, state: DecodeStatus, end: int, surr_text: str,
                                    recv: BatchTokenIDOutput, i: int) -> Optional[int]:
        """Length of the request's text without its last token (None if that token is not new).

        One extra decode per request that ends on a stop string: the window that was just decoded,
        less its last id.
        """
        if self.tokenizer is None or end - 1 < state.read_offset:
            return None
        before = self.tokenizer.decode(
            state.decode_ids[state.surr_offset:end - 1],
            skip_special_tokens=bool(recv.skip_special_tokens[i]),
            spaces_between_special_tokens=bool(recv.spaces_between_special_tokens[i]),
        )
        return len(state.decoded_text) + settled_text_len(before[len(surr_text):])

    def _batch_decode(
        self, recv: BatchTokenIDOutput, states: list[DecodeStatus], end_offsets: list[int]
    ) -> tuple[list[str], list[str]]:
        """Decode the surrounding and the read windows of every request.

        Requests are grouped by their decode flags so that a batch whose requests agree (the
        usual case) costs a single batch_decode call.
        """
        n = len(states)
        decode = self._decode_batch
        if decode is None or n == 0:
            return [""] * n, [""] * n
        skips, spaces = recv.skip_special_tokens, recv.spaces_between_special_tokens
        if len(set(skips)) == 1 and len(set(spaces)) == 1:
            # The usual case: one call for the whole batch, no per-request grouping.
            groups = {(bool(skips[0]), bool(spaces[0])): list(range(n))}
        else:
            groups = {}
            for i in range(n):
                groups.setdefault((bool(skips[i]), bool(spaces[i])), []).append(i)
        surr_texts = [""] * n
        read_texts = [""] * n
        for (skip_special, spaces_between), indices in groups.items():
            picked = [states[i] for i in indices]
            sequences = [s.decode_ids[s.surr_offset:s.read_offset] for s in picked]
            sequences += [s.decode_ids[s.surr_offset:end_offsets[i]] for s, i in zip(picked, indices)]
            # Fast tokenizers ignore spaces_between_special_tokens; slow ones honour it.
            texts = decode(sequences, skip_special, spaces_between)
            if len(indices) == n:
                return texts[:n], texts[n:]
            for j, i in enumerate(indices):
                surr_texts[i] = texts[j]
                read_texts[i] = texts[len(indices) + j]
        return surr_texts, read_texts

    # ------------------------------------------------------------------ event loop
    def event_loop(self, recv_socket: zmq.Socket, send_sockets: list[zmq.Socket]) -> None:
        """`send_sockets`: one per HTTP worker; each gets the rows of its own requests."""
        while True:
            msg = decode(recv_socket.recv())
            if isinstance(msg, BatchTokenIDOutput):
                out = self.handle_batch_token_id_out(msg)
                for worker, part in route_to_workers(out, len(send_sockets)):
                    send_sockets[worker].send(encode(part))
            else:
                logger.warning("Detokenizer ignores unexpected message %s", type(msg).__name__)


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, tokenizer_bytes: Optional[bytes],
                            pipe_writer) -> None:
    """Entry point of the detokenizer process (multiprocessing 'spawn' target).

    `tokenizer_bytes`: the launcher's tokenizer (tokenizer_to_bytes), so that this process does not
    load it again (and import torch for it); None: load it from the model directory."""
    set_process_title("engine::detokenizer")
    configure_logging(server_args.log_level, prefix="DETOKENIZER")
    start_parent_death_watcher()
    ready = False
    try:
        tokenizer = None
        if not server_args.skip_tokenizer_init:
            path = server_args.tokenizer_path or server_args.model_path
            assert path is not None  # children get the resolved model path (resolve_model_path)
            tokenizer = tokenizer_from_bytes(tokenizer_bytes, path, server_args.trust_remote_code)
        manager = DetokenizerManager(tokenizer)
        context = zmq.Context(2)
        recv_socket = get_zmq_socket(context, zmq.PULL, port_args.detokenizer_ipc_name, bind=True)
        send_sockets = [get_zmq_socket(context, zmq.PUSH, endpoint, bind=False)
                        for endpoint in port_args.tokenizer_ipc_names()]
        freeze_startup_objects()
        pipe_writer.send({"status": "ready"})
        ready = True
        manager.event_loop(recv_socket, send_sockets)
    except Exception:
        message = traceback.format_exc()
        logger.error("Detokenizer hit an exception: %s", message)
        if not ready:
            exit_before_ready(pipe_writer, message)
        sys.stderr.flush()
        os._exit(1)
