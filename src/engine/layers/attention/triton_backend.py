"""The Triton attention backend (the default on CUDA): paged-KV kernels from triton_ops.

Decode uses split-K flash-decoding; extend (and MIXED, whose decode rows are one-token extends)
reads the cached prefix through req_to_token and the new tokens from this forward's k/v. Both
kernels read the pool through req_to_token, so any page size works unchanged. A layer's sliding
window, logit cap and sinks (RadixAttention) go to both kernels.

Per-batch metadata is built once in `init_forward_metadata`; the decode scratch buffers
(partial outputs and their log-sum-exps) are allocated on the first layer and reused by the rest.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, Optional, Tuple

import torch

from engine.layers.attention.base_attn_backend import AttentionBackend, AttentionRunner
from engine.layers.attention.triton_ops import compute_num_kv_splits, decode_attention_fwd, extend_attention_fwd

if TYPE_CHECKING:
    from engine.layers.radix_attention import RadixAttention
    from engine.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

DEFAULT_MAX_KV_SPLITS = 8


@dataclass
class _DecodeMetadata:
    num_kv_splits: torch.Tensor  # [bs] int32, chunks each request's keys are split into
    # (q_heads, v_head_dim) -> (mid_o [bs, H, S, DV], mid_lse [bs, H, S]); shared by the layers.
    scratch: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class _ExtendMetadata:
    max_extend_len: int
    # Tree drafts: ForwardBatch.spec_tree_mask as bytes (the kernel loads one per query/key pair).
    tree_mask: Optional[torch.Tensor] = None


def extend_block_sizes(head_dim: int, dtype: torch.dtype) -> Tuple[int, int]:
    """(BLOCK_M, BLOCK_N) that keep the q, k, v tiles of one program within shared memory."""
    if head_dim > 128 or dtype == torch.float32:
        return 32, 32
    return 64, 64


def kernels_interpreted() -> bool:
    """Whether our kernels were decorated under TRITON_INTERPRET=1 (they then run on CPU tensors)."""
    from engine.layers.attention.triton_ops import decode_attention

    return type(decode_attention._decode_stage1_kernel).__name__ == "InterpretedFunction"


class TritonAttnBackend(AttentionBackend):
    # Decode needs no host-side data: the grid depends on the batch size only, and the per-request
    # split counts are computed on the device from seq_lens (cuda_graph_runner.py).
    supports_cuda_graph = True
    # The extend kernel takes a window (bounded by each tree row's position), a cap and sinks with a tree mask.
    tree_mask_on_every_layer = True

    def __init__(
        self,
        model_runner: AttentionRunner,
        max_kv_splits: int = DEFAULT_MAX_KV_SPLITS,
        decode_block_n: int = 64,
        extend_blocks: Optional[Tuple[int, int]] = None,
    ) -> None:
        """extend_blocks overrides extend_block_sizes (tests use tiny blocks to cross block edges)."""
        self.device = model_runner.device
        if not str(self.device).startswith("cuda") and not kernels_interpreted():
            raise RuntimeError(
                "the triton attention backend runs on CUDA (or on the CPU only under TRITON_INTERPRET=1, "
                "set before triton is imported); use --attention-backend torch_native on the CPU"
            )
        self.max_kv_splits = max_kv_splits
        self.decode_block_n = decode_block_n
        self.extend_blocks = extend_blocks
        # (q heads, v head dim) of this rank's layers, known up front only with a real ModelRunner;
        # the CUDA-graph scratch is pre-sized for it (other shapes fall back to lazy allocation).
        from engine.model_executor.model_runner import ModelRunner

        self.layer_heads: Optional[Tuple[int, int]] = None
        if isinstance(model_runner, ModelRunner):
            config = model_runner.model_config
            self.layer_heads = (config.get_num_attention_heads(model_runner.tp_size), config.head_dim)
        self.cuda_graph_num_kv_splits: Optional[torch.Tensor] = None
        self.cuda_graph_scratch: Dict[Tuple[int, int], Tuple[torch.Tensor, torch.Tensor]] = {}

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        if fb.forward_mode.is_decode():
            fb.attn_metadata = _DecodeMetadata(num_kv_splits=compute_num_kv_splits(fb.seq_lens, self.max_kv_splits))
        elif fb.forward_mode.is_extend():
            assert fb.extend_seq_lens_cpu is not None  # ForwardBatch.init_new sets it for extends
            tree = fb.spec_tree_mask.to(torch.uint8) if fb.spec_tree_mask is not None else None
            fb.attn_metadata = _ExtendMetadata(max_extend_len=max(fb.extend_seq_lens_cpu, default=0), tree_mask=tree)
        else:
            fb.attn_metadata = None

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Static decode metadata for batches of up to max_bs rows, shared by every captured size."""
        self.cuda_graph_num_kv_splits = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self.cuda_graph_scratch = {}
        if self.layer_heads is not None:
            num_heads, v_head_dim = self.layer_heads
            self.cuda_graph_scratch[self.layer_heads] = (
                torch.empty(max_bs, num_heads, self.max_kv_splits, v_head_dim, dtype=torch.float32, device=self.device),
                torch.empty(max_bs, num_heads, self.max_kv_splits, dtype=torch.float32, device=self.device),
            )

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        bs = forward_batch.batch_size
        if self.cuda_graph_num_kv_splits is None or bs > self.cuda_graph_num_kv_splits.shape[0]:
            raise RuntimeError(f"init_cuda_graph_state(max_bs >= {bs}) must run before capturing batch size {bs}")
        # Views of the shared static buffers; a layer shape not pre-sized gets its own scratch on
        # the first (warm-up) run, kept by this metadata object for the graph's lifetime.
        scratch = {key: (mid_o[:bs], mid_lse[:bs]) for key, (mid_o, mid_lse) in self.cuda_graph_scratch.items()}
        forward_batch.attn_metadata = _DecodeMetadata(num_kv_splits=self.cuda_graph_num_kv_splits[:bs], scratch=scratch)

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        """forward_batch is the captured one: its seq_lens already hold this replay's values."""
        meta: _DecodeMetadata = forward_batch.attn_metadata
        meta.num_kv_splits.copy_(compute_num_kv_splits(forward_batch.seq_lens, self.max_kv_splits))

    # ------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool = True):
        fb = forward_batch
        pool = fb.token_to_kv_pool
        # ForwardBatch.init_new sets the pools, and the extend fields for extends.
        assert pool is not None and fb.req_to_token_pool is not None
        assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if k is None:
            # Nothing new was computed (K/V shared from another layer): the new tokens' K/V are in the pool.
            k = pool.read_k(layer.layer_id, k_buf[fb.out_cache_loc], q.dtype)
            v = pool.read_v(layer.layer_id, v_buf[fb.out_cache_loc], q.dtype)
        else:  # an fp8 pool: the new tokens' K/V as stored, as the prefix's (torch_native does the same)
            k, v = pool.as_stored(layer.layer_id, k, v)
        k_scale, v_scale = pool.kv_scales(layer.layer_id)

        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        # Views, not copies: the kernel follows strides and only needs a contiguous last dim.
        q3 = q.reshape(-1, num_heads, head_dim)
        k3 = k.reshape(-1, layer.tp_k_head_num, head_dim)
        v3 = v.reshape(-1, layer.tp_v_head_num, v_buf.shape[-1])
        out = torch.empty(q3.shape[0], num_heads, v3.shape[-1], dtype=q.dtype, device=q.device)
        block_m, block_n = self.extend_blocks or extend_block_sizes(head_dim, q.dtype)
        extend_attention_fwd(
            q3,
            k3,
            v3,
            out,
            k_buf,
            v_buf,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.extend_start_loc,
            fb.extend_seq_lens,
            fb.extend_prefix_lens,
            fb.attn_metadata.max_extend_len,
            layer.scaling,
            block_m=block_m,
            block_n=block_n,
            is_causal=layer.is_causal,
            sliding_window=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
            sinks=layer.sinks,
            slot_map=pool.slot_map(layer.layer_id),
            k_scale=k_scale,
            v_scale=v_scale,
            tree_mask=fb.attn_metadata.tree_mask,
            tree_mask_starts=fb.spec_tree_mask_starts,
            tree_widths=fb.spec_tree_widths,
            tree_positions=fb.positions if fb.spec_tree_mask is not None else None,
        )
        return out.view(-1, num_heads * out.shape[-1])

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool = True):
        fb = forward_batch
        pool = fb.token_to_kv_pool
        assert pool is not None and fb.req_to_token_pool is not None  # ForwardBatch.init_new sets them
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)

        meta: _DecodeMetadata = fb.attn_metadata
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        v_head_dim = v_buf.shape[-1]
        q3 = q.reshape(-1, num_heads, head_dim)
        bs = q3.shape[0]
        key = (num_heads, v_head_dim)
        if key not in meta.scratch:
            meta.scratch[key] = (
                torch.empty(bs, num_heads, self.max_kv_splits, v_head_dim, dtype=torch.float32, device=q.device),
                torch.empty(bs, num_heads, self.max_kv_splits, dtype=torch.float32, device=q.device),
            )
        mid_o, mid_lse = meta.scratch[key]
        out = torch.empty(bs, num_heads, v_head_dim, dtype=q.dtype, device=q.device)
        decode_attention_fwd(
            q3,
            k_buf,
            v_buf,
            out,
            fb.req_to_token_pool.req_to_token,
            fb.req_pool_indices,
            fb.seq_lens,
            meta.num_kv_splits,
            mid_o,
            mid_lse,
            layer.scaling,
            block_n=self.decode_block_n,
            sliding_window=layer.sliding_window_size,
            logit_cap=layer.logit_cap,
            sinks=layer.sinks,
            slot_map=pool.slot_map(layer.layer_id),
            k_scale=pool.kv_scales(layer.layer_id)[0],
            v_scale=pool.kv_scales(layer.layer_id)[1],
        )
        return out.view(bs, num_heads * v_head_dim)
