"""A simulated accelerator for benchmarks and tests of the host side (--simulated-device-forward-ms).

`SimulatedModelRunner` stands in for `ModelRunner`: its forward costs `a + b x tokens`
milliseconds of wall time and no CPU (the forward thread sleeps, as the host does while a GPU
computes), and its sampler returns deterministic tokens. Everything around it is the real engine:
the TpModelWorker with its overlap relay, the scheduler (batches, radix cache, KV accounting over a
real allocator), the detokenizer, the TokenizerManager and HTTP. What it leaves out is what a GPU
does: the model, the KV data (no K/V buffers are allocated; the allocator hands out slot indices
as usual), the sampler's arithmetic (temperature, penalties and seeds do not change the tokens).

The next token of a request is a function of its last input token and that token's position
(`simulated_next_tokens`), drawn from the vocabulary without the special tokens and the EOS ids,
so a request never stops on EOS and its text is made of ordinary tokens. A constrained request
(vocab mask) gets the first allowed token at or after that draw. Asked-for logprobs are 0 for the
chosen token (it is certain) and LOGPROB_OTHERS for the other top entries.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import List, Optional, Set, Tuple

import numpy as np
import torch

from engine.configs.model_config import ModelConfig
from engine.layers.logits_processor import LogitsProcessorOutput
from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.model_executor.forward_batch_info import ForwardBatch
from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Without --max-total-tokens: the KV slots the simulated device pretends to have (it stores no K/V,
# so this costs only the allocator's index tensors).
DEFAULT_SIMULATED_TOTAL_TOKENS = 1 << 20
# The logprob reported for top entries other than the chosen token.
LOGPROB_OTHERS = -30.0
# Multipliers of the token function (odd primes: consecutive positions give unrelated tokens).
_TOKEN_MUL, _POS_MUL, _OFFSET = 7919, 104729, 17


def special_token_ids(model_path: str) -> Set[int]:
    """The ids of special tokens in `tokenizer.json` (empty when the file or the list is absent)."""
    path = os.path.join(model_path, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            added = json.load(f).get("added_tokens") or []
    except (OSError, ValueError):
        return set()
    return {int(t["id"]) for t in added if t.get("special")}


def ordinary_token_ids(vocab_size: int, excluded: Set[int]) -> torch.Tensor:
    """The token ids the simulated sampler draws from, ascending."""
    keep = torch.ones(vocab_size, dtype=torch.bool)
    for token in excluded:
        if 0 <= token < vocab_size:
            keep[token] = False
    ids = torch.nonzero(keep).flatten()
    if ids.numel() == 0:
        raise ValueError("the simulated device has no ordinary token to emit (every id is special or EOS)")
    return ids


def simulated_next_tokens(last_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Token after `last_ids[i]` at `positions[i]`: a fixed function of both (int64, [bs])."""
    key = (last_ids.to(torch.int64) * _TOKEN_MUL + positions.to(torch.int64) * _POS_MUL + _OFFSET)
    return allowed[torch.remainder(key, allowed.numel())]


def _first_allowed_from(mask_row: np.ndarray, start: int, vocab_size: int) -> int:
    """The first token >= start (cyclically) that the int32 bitmask row allows; -1: none."""
    bits = np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab_size]
    allowed = np.flatnonzero(bits)
    if allowed.size == 0:
        return -1
    k = int(np.searchsorted(allowed, start))
    return int(allowed[k % allowed.size])


class SimulatedModelRunner:
    """ModelRunner's interface over a simulated device (see the module docstring)."""

    def __init__(self, model_config: ModelConfig, server_args: ServerArgs) -> None:
        cost = server_args.simulated_device_cost()
        assert cost is not None, "SimulatedModelRunner needs --simulated-device-forward-ms"
        self.base_ms, self.per_token_ms = cost
        self.model_config = model_config
        self.server_args = server_args
        self.device = "cpu"
        self.page_size = server_args.page_size
        self.dtype = model_config.dtype
        self.cuda_graph_runner = None
        self.attn_backend = None
        self.token_to_kv_pool = None  # no K/V data: a GPU would hold it
        excluded = set(model_config.eos_token_ids or ()) | special_token_ids(model_config.model_path)
        self.allowed_ids = ordinary_token_ids(model_config.vocab_size, excluded)
        self.num_forwards = 0
        # Simulated time asked for and wall time spent in forward(): the difference is how late the
        # forward thread woke up (a loaded host), which a real device would not add.
        self.requested_s = 0.0
        self.elapsed_s = 0.0
        self._init_memory_pool()

    def _init_memory_pool(self) -> None:
        args = self.server_args
        total = args.max_total_tokens if args.max_total_tokens is not None else DEFAULT_SIMULATED_TOTAL_TOKENS
        total = (total // self.page_size) * self.page_size
        self.max_total_num_tokens = total
        context_len = self.model_config.context_len
        # As on an accelerator: not capped at the CPU's default of 1024 running requests.
        self.max_running_requests = args.max_running_requests or min(max(total // context_len * 512, 2048), 4096)
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, context_len, self.device)
        if self.page_size == 1:
            self.token_to_kv_pool_allocator: PagedTokenToKVPoolAllocator = TokenToKVPoolAllocator(
                total, self.dtype, self.device)
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(total, self.page_size, self.dtype,
                                                                          self.device)
        logger.info("Simulated device: forward %.3f ms + %.5f ms per token; KV pool of %d tokens (indices "
                    "only), %d request slots", self.base_ms, self.per_token_ms, total, self.max_running_requests)

    # ------------------------------------------------------------------ forward
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        """Wait as long as the simulated forward takes; the 'logits' are the rows' last ids and positions."""
        start = time.perf_counter()
        mode = forward_batch.forward_mode
        if mode.is_extend():
            assert forward_batch.extend_start_loc is not None and forward_batch.extend_seq_lens is not None
            ends = forward_batch.extend_start_loc + forward_batch.extend_seq_lens - 1
            last_ids = forward_batch.input_ids[ends]
            positions = forward_batch.positions[ends]
            num_tokens = int(forward_batch.extend_num_tokens or 0)
        else:
            last_ids = forward_batch.input_ids
            positions = forward_batch.positions
            num_tokens = forward_batch.batch_size
        output = LogitsProcessorOutput(next_token_logits=torch.stack([last_ids, positions], dim=1))
        if mode.is_extend() and forward_batch.extend_input_logprob_token_ids is not None:
            self._fill_input_logprobs(output, forward_batch)
        self.num_forwards += 1
        duration = (self.base_ms + self.per_token_ms * num_tokens) / 1000
        remaining = duration - (time.perf_counter() - start)
        if remaining > 0:
            time.sleep(remaining)
        self.requested_s += duration
        self.elapsed_s += time.perf_counter() - start
        return output

    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> torch.Tensor:
        rows = logits_output.next_token_logits
        next_ids = simulated_next_tokens(rows[:, 0], rows[:, 1], self.allowed_ids)
        info = forward_batch.sampling_info
        if info is not None and info.vocab_mask is not None:
            next_ids = self._apply_mask(next_ids, info.vocab_mask)
        if forward_batch.return_logprob:
            self._fill_output_logprobs(logits_output, next_ids, forward_batch.top_logprobs_nums)
        return next_ids

    def _apply_mask(self, next_ids: torch.Tensor, vocab_mask: torch.Tensor) -> torch.Tensor:
        masks = vocab_mask.numpy()
        out = next_ids.clone()
        vocab = self.model_config.vocab_size
        for i in np.flatnonzero((masks != -1).any(axis=1)):
            token = _first_allowed_from(masks[i], int(next_ids[i]), vocab)
            if token >= 0:
                out[i] = token
        return out

    # ------------------------------------------------------------------ logprobs
    def _top_entries(self, token: int, k: int) -> Tuple[List[float], List[int]]:
        others = [t for t in range(k) if t != token][: max(k - 1, 0)]
        return ([0.0] + [LOGPROB_OTHERS] * len(others))[:k], ([token] + others)[:k]

    def _fill_output_logprobs(self, output: LogitsProcessorOutput, next_ids: torch.Tensor,
                              top_nums: Optional[List[int]]) -> None:
        output.next_token_logprobs = torch.zeros(next_ids.numel(), dtype=torch.float32)
        nums = top_nums or [0] * next_ids.numel()
        tops = [self._top_entries(int(t), k) for t, k in zip(next_ids.tolist(), nums)]
        output.next_token_top_logprobs_val = [v for v, _ in tops]
        output.next_token_top_logprobs_idx = [i for _, i in tops]

    def _fill_input_logprobs(self, output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> None:
        targets = forward_batch.extend_input_logprob_token_ids
        assert targets is not None  # forward() calls this only when they were asked for
        output.input_token_logprobs = torch.zeros(targets.numel(), dtype=torch.float32)
        nums = forward_batch.top_logprobs_nums or []
        if max(nums, default=0) == 0:
            return
        output.input_top_logprobs_val, output.input_top_logprobs_idx = [], []
        flat = targets.tolist()
        row = 0
        ext_lens, start_lens = forward_batch.extend_seq_lens_cpu, forward_batch.extend_logprob_start_lens_cpu
        assert ext_lens is not None and start_lens is not None  # set for every extend batch
        for ext, start, k in zip(ext_lens, start_lens,
                                 nums):
            count = max(ext - start, 0)
            entries = [self._top_entries(t, k) for t in flat[row:row + count]] if k > 0 else []
            output.input_top_logprobs_val.append([v for v, _ in entries])
            output.input_top_logprobs_idx.append([i for _, i in entries])
            row += count
