"""LogitsProcessor: hidden states -> next-token logits (and input logprobs when asked)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

import torch
from torch import nn

from engine.distributed.parallel_state import tensor_model_parallel_all_gather

if TYPE_CHECKING:
    from engine.layers.vocab_parallel_embedding import ParallelLMHead
    from engine.model_executor.forward_batch_info import ForwardBatch


@dataclass
class LogitsProcessorOutput:
    # [bs, vocab] float32: logits of the last position of each request (extend) or of each token (decode)
    next_token_logits: torch.Tensor
    # Filled by the Sampler when logprobs are asked for:
    next_token_logprobs: Optional[torch.Tensor] = None  # [bs] logprob of the chosen token
    next_token_top_logprobs_val: Optional[List[List[float]]] = None  # per request, top_logprobs_nums[i] values
    next_token_top_logprobs_idx: Optional[List[List[int]]] = None
    # Extend with input logprobs: flat over requests, one entry per position whose logprob was asked
    # (positions extend_logprob_start_len .. extend_len-1 of each request): the logprob of the
    # token that follows the position (ForwardBatch.extend_input_logprob_token_ids).
    input_token_logprobs: Optional[torch.Tensor] = None
    input_top_logprobs_val: Optional[List[List[List[float]]]] = None  # per request, per position
    input_top_logprobs_idx: Optional[List[List[List[int]]]] = None
    # token_ids_logprob: per request the asked ids' logprobs (None for a request that asked none),
    # at its next token (filled by the Sampler) and, per position, at its input-logprob positions.
    next_token_token_ids_logprobs_val: Optional[List[Optional[List[float]]]] = None
    input_token_ids_logprobs_val: Optional[List[Optional[List[List[float]]]]] = None
    # return_hidden_states: the final (normed) hidden states of every extend position, or of every
    # decode row, [tokens, hidden]; None when no request of the batch asked for them.
    hidden_states: Optional[torch.Tensor] = None
    # An EAGLE3 target's auxiliary hidden states (LlamaModel.set_aux_layers_to_capture), captured
    # with hidden_states: [tokens, 3 * hidden]; None otherwise.
    aux_hidden_states: Optional[torch.Tensor] = None


# Input logprobs are computed this many positions at a time: one [positions, vocab] float32
# matrix for a long prompt would be gigabytes (8192 positions x 152k vocab = 5 GB, twice over
# with the log-softmax); a chunk of 1024 bounds it to about 0.6 GB per matrix.
INPUT_LOGPROB_CHUNK_SIZE = 1024


class LogitsProcessor(nn.Module):
    """Projects hidden states to float32 logits over the real vocabulary.

    Only the rows that are needed are projected: the last position of each request for extend
    (and MIXED), every row for decode, plus the positions whose input logprobs were asked for
    (in chunks of `input_logprob_chunk_size` positions).
    """

    def __init__(self, config: Any, logit_softcap: float = 0.0) -> None:
        """logit_softcap: logits become cap * tanh(logits / cap) (Gemma's final_logit_softcapping); 0: none."""
        super().__init__()
        self.vocab_size = int(config.vocab_size)
        self.logit_softcap = logit_softcap
        self.input_logprob_chunk_size = INPUT_LOGPROB_CHUNK_SIZE

    @staticmethod
    def last_rows_suffice(forward_batch: "ForwardBatch") -> bool:
        """Whether forward needs the final hidden states of each request's last row only: an extend
        batch asking neither input logprobs nor hidden states. A model may then run its last layer past
        the K/V (attention from those rows, output projection, MLP) on those rows alone and pass
        `pruned=True`: the other rows' outputs feed nothing (their K/V, which later tokens read, come
        from the layer's input)."""
        mode = forward_batch.forward_mode
        if not mode.is_extend() or mode.is_target_verify() or forward_batch.capture_hidden_states:
            return False
        return not (forward_batch.return_logprob and _wants_input_logprobs(forward_batch))

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden_states: torch.Tensor,
        lm_head: ParallelLMHead,
        forward_batch: "ForwardBatch",
        pruned: bool = False,
    ) -> LogitsProcessorOutput:
        """pruned: hidden_states holds each request's last row only (last_rows_suffice)."""
        mode = forward_batch.forward_mode
        if mode.is_extend() and not pruned and not mode.is_target_verify():
            # A verify forward keeps every position: each one checks a draft token.
            pruned_states = hidden_states.index_select(0, forward_batch.last_positions())
        else:
            pruned_states = hidden_states
        output = LogitsProcessorOutput(next_token_logits=self.compute_logits(pruned_states, lm_head))
        if forward_batch.capture_hidden_states:
            output.hidden_states = hidden_states
        if mode.is_extend() and forward_batch.return_logprob and _wants_input_logprobs(forward_batch):
            self._add_input_logprobs(output, hidden_states, lm_head, forward_batch)
        return output

    def compute_logits(self, hidden_states: torch.Tensor, lm_head: ParallelLMHead) -> torch.Tensor:
        """[n, hidden] -> [n, vocab_size] float32 (all-gathered across TP ranks)."""
        from engine.layers.linear import linear_forward

        weight = lm_head.weight
        hidden_states = hidden_states.to(weight.dtype)
        logits = linear_forward(hidden_states, weight, None, lm_head.packed_weight)
        logits = tensor_model_parallel_all_gather(logits, dim=-1)
        logits = logits[:, : self.vocab_size].float()
        if self.logit_softcap > 0:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def _add_input_logprobs(
        self,
        output: LogitsProcessorOutput,
        hidden_states: torch.Tensor,
        lm_head: ParallelLMHead,
        forward_batch: "ForwardBatch",
    ) -> None:
        ext_lens = forward_batch.extend_seq_lens_cpu
        start_lens = forward_batch.extend_logprob_start_lens_cpu
        # An extend (init_new sets these) with input logprobs (_wants_input_logprobs saw the starts).
        assert ext_lens is not None and start_lens is not None and forward_batch.extend_start_loc is not None
        starts = forward_batch.extend_start_loc.tolist()
        index_parts: List[torch.Tensor] = []
        counts: List[int] = []
        for i, ext_len in enumerate(ext_lens):
            start = min(max(start_lens[i], 0), ext_len)
            counts.append(ext_len - start)
            if ext_len > start:
                index_parts.append(torch.arange(starts[i] + start, starts[i] + ext_len))
        index = torch.cat(index_parts).to(hidden_states.device)
        token_ids = forward_batch.extend_input_logprob_token_ids
        if token_ids is None or token_ids.numel() != index.numel():
            raise ValueError(
                "extend_input_logprob_token_ids must hold one id per input-logprob position "
                f"({index.numel()}), got {None if token_ids is None else token_ids.numel()}"
            )
        # The id after a prompt's last position is not known yet and arrives as a placeholder;
        # clamping keeps any placeholder in bounds (the caller ignores that entry).
        token_ids = token_ids.to(hidden_states.device).long().clamp(0, self.vocab_size - 1)
        top_nums = forward_batch.top_logprobs_nums or [0] * len(ext_lens)
        max_k = max(top_nums, default=0)
        asked_ids = forward_batch.token_ids_logprobs or [None] * len(ext_lens)
        ids_rows: List[Optional[List[List[float]]]] = [[] if ids else None for ids in asked_ids]
        offsets = [sum(counts[:i]) for i in range(len(counts))]

        chosen: List[torch.Tensor] = []
        values: List[List[float]] = []
        indices: List[List[int]] = []
        chunk = max(1, self.input_logprob_chunk_size)
        for start in range(0, index.numel(), chunk):
            rows = index[start : start + chunk]
            logprobs = torch.log_softmax(self.compute_logits(hidden_states.index_select(0, rows), lm_head), dim=-1)
            chosen.append(logprobs.gather(1, token_ids[start : start + chunk].unsqueeze(1)).squeeze(1))
            _collect_token_ids_logprobs(logprobs, start, asked_ids, offsets, counts, ids_rows)
            if max_k > 0:
                top = logprobs.topk(max_k, dim=-1)
                values.extend(top.values.tolist())
                indices.extend(top.indices.tolist())
        output.input_token_logprobs = torch.cat(chosen)
        if any(rows is not None for rows in ids_rows):
            output.input_token_ids_logprobs_val = ids_rows
        if max_k == 0:
            return
        output.input_top_logprobs_val, output.input_top_logprobs_idx = [], []
        row = 0
        for count, k in zip(counts, top_nums):
            if k > 0:
                output.input_top_logprobs_val.append([v[:k] for v in values[row : row + count]])
                output.input_top_logprobs_idx.append([x[:k] for x in indices[row : row + count]])
            else:
                output.input_top_logprobs_val.append([])
                output.input_top_logprobs_idx.append([])
            row += count


def _collect_token_ids_logprobs(logprobs: torch.Tensor, chunk_start: int, asked_ids: List[Optional[List[int]]],
                                offsets: List[int], counts: List[int],
                                out: List[Optional[List[List[float]]]]) -> None:
    """Append, for every request that asked token ids, the logprobs of those ids at its positions
    that fall in this chunk (rows chunk_start .. chunk_start + len(logprobs) of the flat list)."""
    chunk_end = chunk_start + logprobs.shape[0]
    for i, ids in enumerate(asked_ids):
        if not ids:
            continue
        lo, hi = max(offsets[i], chunk_start), min(offsets[i] + counts[i], chunk_end)
        if lo < hi:
            index = torch.tensor(ids, dtype=torch.long, device=logprobs.device)
            rows = out[i]
            assert rows is not None  # a list for every request that asked ids
            rows.extend(logprobs[lo - chunk_start:hi - chunk_start].index_select(1, index).tolist())


def _wants_input_logprobs(forward_batch: "ForwardBatch") -> bool:
    start_lens = forward_batch.extend_logprob_start_lens_cpu
    if start_lens is None:
        return False
    assert forward_batch.extend_seq_lens_cpu is not None  # set with the start lens (init_new, extends)
    return any(s < e for s, e in zip(start_lens, forward_batch.extend_seq_lens_cpu))
