"""What one forward needs: the worker batch snapshot and the device-side ForwardBatch.

ScheduleBatch (scheduler, mutable)  ->  ModelWorkerBatch (immutable snapshot, CPU data)
                                     ->  ForwardBatch (device tensors + attention metadata)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any, List, Optional, Protocol

import torch

if TYPE_CHECKING:
    from engine.layers.attention.base_attn_backend import AttentionBackend
    from engine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from engine.sampling.sampling_batch_info import SamplingBatchInfo


class ForwardRunner(Protocol):
    """What ForwardBatch.init_new reads of the runner it forwards on (ModelRunner, or the
    SimulatedModelRunner of --simulated-device-forward-ms, which holds no K/V and no backend)."""

    @property
    def device(self) -> str: ...
    @property
    def req_to_token_pool(self) -> ReqToTokenPool: ...
    @property
    def token_to_kv_pool(self) -> Optional[MHATokenToKVPool]: ...
    @property
    def attn_backend(self) -> Optional[AttentionBackend]: ...


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill, possibly on top of a cached prefix
    DECODE = auto()  # one new token per request
    MIXED = auto()  # extend requests followed by decode requests (chunked prefill + decode)
    # Speculative verify: each request extends by its last token plus its drafts (a chain, or a
    # tree under `spec_tree_mask`), and the logits of every position are kept (engine/speculative/).
    TARGET_VERIFY = auto()

    def is_extend(self) -> bool:
        """True for modes that attention treats as extend (MIXED and TARGET_VERIFY included)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED


@dataclass(frozen=True)
class ModelWorkerBatch:
    """An immutable snapshot of what the forward of one batch needs.

    For DECODE the `extend_*` lists are None. For MIXED the decode rows appear after the
    extend rows with `extend_prefix_lens = seq_len - 1` and `extend_seq_lens = 1`.
    Decode rows carry the placeholder id -1 and name their request-pool row in `relay_rows`: the
    worker gathers the real id from the overlap relay (scheduler/overlap_utils.py).
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, length after this forward
    seq_lens_cpu: List[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    sampling_info: Optional["SamplingBatchInfo"] = None
    return_logprob: bool = False
    top_logprobs_nums: Optional[List[int]] = None
    # Per row the token ids whose logprobs are asked (token_ids_logprob), or None.
    token_ids_logprobs: Optional[List[Optional[List[int]]]] = None
    # Return the final hidden states (every extend position, every decode row) in the output.
    capture_hidden_states: bool = False
    extend_num_tokens: Optional[int] = None
    extend_seq_lens: Optional[List[int]] = None
    extend_prefix_lens: Optional[List[int]] = None
    # Per request: the first position (relative to the extend start) whose input logprob is asked.
    extend_logprob_start_lens: Optional[List[int]] = None
    # Flat: for every position whose input logprob is computed, the id of the token that follows it.
    extend_input_logprob_token_ids: Optional[torch.Tensor] = None
    # Overlap relay: ids equal to -1 in input_ids are read, in order, from output_tokens_buf[relay_rows].
    relay_rows: Optional[torch.Tensor] = None
    # Embedding batches: per request the embedding dimensions asked for (None: all of them).
    dimensions: Optional[List[Optional[int]]] = None
    # With LoRA: per request its adapter's uid (None: the base model); None when no request has one.
    lora_ids: Optional[List[Optional[str]]] = None
    # Tree drafts (speculative/tree.py): each token's position when not its extend offset (a tree
    # node's is prefix + depth), and the flat tree mask: each request's [extend, width] bool block,
    # row-major in batch order, over its last `width` keys (True: row attends to key); the keys
    # before them are visible to every row. Widths: spec_tree_widths, None: each extend length (the
    # block covers the new tokens only).
    positions: Optional[torch.Tensor] = None
    spec_tree_mask: Optional[torch.Tensor] = None
    spec_tree_widths: Optional[List[int]] = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64
    seq_lens_cpu: List[int]
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    seq_lens_sum: int = 0

    # Extend (and MIXED) only
    extend_num_tokens: Optional[int] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_start_loc: Optional[torch.Tensor] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    extend_logprob_start_lens_cpu: Optional[List[int]] = None
    extend_input_logprob_token_ids: Optional[torch.Tensor] = None

    # Sampling and logprobs
    sampling_info: Optional["SamplingBatchInfo"] = None
    return_logprob: bool = False
    top_logprobs_nums: Optional[List[int]] = None
    token_ids_logprobs: Optional[List[Optional[List[int]]]] = None
    capture_hidden_states: bool = False
    # Embedding batches: per request the Matryoshka dimensions to keep (None: all).
    dimensions: Optional[List[Optional[int]]] = None
    # Per request its LoRA adapter's uid, or None (engine/lora/: the LoRAManager reads it).
    lora_ids: Optional[List[Optional[str]]] = None
    # An EAGLE draft forward: the feature each token is read with (speculative/eagle.py), [tokens, hidden].
    spec_hidden_states: Optional[torch.Tensor] = None
    # Tree drafts: ModelWorkerBatch.spec_tree_mask, each request's block width (the keys it covers,
    # the last of the request's) and where its block starts in it.
    spec_tree_mask: Optional[torch.Tensor] = None
    spec_tree_widths: Optional[torch.Tensor] = None
    spec_tree_widths_cpu: Optional[List[int]] = None
    spec_tree_mask_starts: Optional[torch.Tensor] = None

    # Memory and attention
    req_to_token_pool: Optional["ReqToTokenPool"] = None
    token_to_kv_pool: Optional["MHATokenToKVPool"] = None
    attn_backend: Optional["AttentionBackend"] = None
    # Free-form per-backend metadata built by attn_backend.init_forward_metadata.
    attn_metadata: Any = None

    def last_positions(self) -> torch.Tensor:
        """[bs] each request's last row of an extend batch."""
        assert self.extend_start_loc is not None and self.extend_seq_lens is not None  # init_new sets them
        return self.extend_start_loc + self.extend_seq_lens - 1

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch, model_runner: ForwardRunner) -> "ForwardBatch":
        device = model_runner.device
        mode = batch.forward_mode
        seq_lens = batch.seq_lens.to(device, non_blocking=True)
        ret = cls(
            forward_mode=mode,
            batch_size=batch.batch_size,
            input_ids=batch.input_ids.to(device, non_blocking=True),
            positions=_positions(batch, seq_lens, device),
            req_pool_indices=batch.req_pool_indices.to(device, non_blocking=True),
            seq_lens=seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu,
            out_cache_loc=batch.out_cache_loc.to(device, non_blocking=True),
            seq_lens_sum=sum(batch.seq_lens_cpu),
            sampling_info=batch.sampling_info,
            return_logprob=batch.return_logprob,
            top_logprobs_nums=batch.top_logprobs_nums,
            token_ids_logprobs=batch.token_ids_logprobs,
            capture_hidden_states=batch.capture_hidden_states,
            dimensions=batch.dimensions,
            lora_ids=batch.lora_ids,
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
        )
        if mode.is_extend():
            ext = batch.extend_seq_lens
            pre = batch.extend_prefix_lens
            assert ext is not None and pre is not None  # get_model_worker_batch sets them for extends
            ret.extend_num_tokens = batch.extend_num_tokens if batch.extend_num_tokens is not None else sum(ext)
            ret.extend_seq_lens_cpu = list(ext)
            ret.extend_prefix_lens_cpu = list(pre)
            ret.extend_seq_lens = torch.tensor(ext, dtype=torch.int64, device=device)
            ret.extend_prefix_lens = torch.tensor(pre, dtype=torch.int64, device=device)
            ret.extend_start_loc = torch.cumsum(ret.extend_seq_lens, 0) - ret.extend_seq_lens
            ret.extend_logprob_start_lens_cpu = (
                list(batch.extend_logprob_start_lens) if batch.extend_logprob_start_lens is not None else None
            )
            if batch.extend_input_logprob_token_ids is not None:
                ret.extend_input_logprob_token_ids = batch.extend_input_logprob_token_ids.to(device)
            if batch.spec_tree_mask is not None:
                ret.set_tree_mask(batch.spec_tree_mask.to(device), batch.spec_tree_widths)
        return ret

    def set_tree_mask(self, mask: torch.Tensor, widths: Optional[List[int]] = None) -> None:
        """The tree mask of an extend batch (ModelWorkerBatch.spec_tree_mask; widths None: each
        request's extend length)."""
        assert self.extend_seq_lens_cpu is not None and self.extend_seq_lens is not None  # an extend batch
        self.spec_tree_mask = mask
        self.spec_tree_widths_cpu = list(widths) if widths is not None else list(self.extend_seq_lens_cpu)
        self.spec_tree_widths = torch.tensor(self.spec_tree_widths_cpu, dtype=torch.int64, device=mask.device)
        blocks = self.extend_seq_lens * self.spec_tree_widths
        self.spec_tree_mask_starts = torch.cumsum(blocks, 0) - blocks

    def tree_mask_block(self, i: int) -> Optional[torch.Tensor]:
        """Request i's [extend, width] tree mask over its last `width` keys, None without tree drafts."""
        if self.spec_tree_mask is None:
            return None
        # set_tree_mask sets them together.
        assert self.spec_tree_mask_starts is not None and self.spec_tree_widths_cpu is not None
        assert self.extend_seq_lens_cpu is not None
        n, width = self.extend_seq_lens_cpu[i], self.spec_tree_widths_cpu[i]
        start = int(self.spec_tree_mask_starts[i])
        return self.spec_tree_mask[start:start + n * width].view(n, width)


def _positions(batch: ModelWorkerBatch, seq_lens: torch.Tensor, device: str) -> torch.Tensor:
    """Each token's position: after its request's prefix (extend), the last slot (decode); tree
    drafts give theirs."""
    if batch.positions is not None:
        return batch.positions.to(device, non_blocking=True)
    if batch.forward_mode.is_extend():
        assert batch.extend_prefix_lens is not None and batch.extend_seq_lens is not None  # set for extends
        return compute_extend_positions(batch.extend_prefix_lens, batch.extend_seq_lens, device)
    if batch.forward_mode.is_decode():
        return torch.clamp(seq_lens - 1, min=0)
    return torch.empty(0, dtype=torch.int64, device=device)


def compute_extend_positions(prefix_lens: List[int], extend_lens: List[int], device) -> torch.Tensor:
    """Positions prefix_len .. prefix_len + extend_len - 1 of each request, concatenated."""
    if not extend_lens:
        return torch.empty(0, dtype=torch.int64, device=device)
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    pre = torch.tensor(prefix_lens, dtype=torch.int64)
    starts = torch.cumsum(ext, 0) - ext
    total = int(ext.sum())
    # position = (flat index - start of its request) + prefix of its request
    owner = torch.repeat_interleave(torch.arange(len(extend_lens)), ext)
    positions = torch.arange(total, dtype=torch.int64) - starts[owner] + pre[owner]
    return positions.to(device)
