"""The FlashInfer attention backend: a thin wrapper over flashinfer's paged-KV batch wrappers.

Usable only where `flashinfer-python` imports and a CUDA GPU is present; importing this module
elsewhere raises ImportError with the reason (the backend factory turns it into a clear error).

Our pool is [slots, kv_heads, head_dim] per layer, which is flashinfer's "NHD" paged layout with
page size 1 once a unit page axis is added, so kv_indices are just the request's slots from
req_to_token (that holds for any engine page size). One plan per batch (made on the first layer,
which is when head counts, dtypes and the scale are known), one run per layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.layers.attention.base_attn_backend import AttentionBackend, AttentionRunner

try:
    import flashinfer
except ImportError as e:  # flashinfer-python is an optional, CUDA-only dependency
    raise ImportError(
        f"the flashinfer attention backend needs the flashinfer-python package ({e}); "
        "install it on a CUDA machine or use --attention-backend triton / torch_native"
    ) from e

if TYPE_CHECKING:
    from engine.layers.radix_attention import RadixAttention
    from engine.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class _FlashInferMetadata:
    kv_indptr: torch.Tensor  # [bs + 1] int32
    kv_indices: torch.Tensor  # [sum(seq_lens)] int32 pool slots (pages of size 1)
    kv_last_page_len: torch.Tensor  # [bs] int32, all ones with unit pages
    qo_indptr: torch.Tensor  # [bs + 1] int32 (extend only; arange for decode)
    planned: bool = False


def build_paged_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, max_len: int):
    """(kv_indptr, kv_indices): each request's first seq_len slots, concatenated in batch order."""
    rows = req_to_token[:, :max_len].index_select(0, req_pool_indices)
    valid = torch.arange(max_len, device=rows.device).unsqueeze(0) < seq_lens.unsqueeze(1)
    kv_indices = rows[valid].to(torch.int32)  # boolean indexing keeps row-major (batch, position) order
    kv_indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=rows.device)
    kv_indptr[1:] = torch.cumsum(seq_lens, 0)
    return kv_indptr, kv_indices


class FlashInferAttnBackend(AttentionBackend):
    def __init__(self, model_runner: AttentionRunner) -> None:
        if not torch.cuda.is_available() or not str(model_runner.device).startswith("cuda"):
            raise RuntimeError("the flashinfer attention backend needs a CUDA device")
        self.device = model_runner.device
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self.decode_wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        fb = forward_batch
        if not (fb.forward_mode.is_decode() or fb.forward_mode.is_extend()):
            fb.attn_metadata = None
            return
        assert fb.req_to_token_pool is not None  # ForwardBatch.init_new sets it
        kv_indptr, kv_indices = build_paged_kv_indices(
            fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, max(fb.seq_lens_cpu)
        )
        bs = fb.batch_size
        if fb.forward_mode.is_extend():
            qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=self.device)
            assert fb.extend_seq_lens is not None  # ForwardBatch.init_new sets it for extends
            qo_indptr[1:] = torch.cumsum(fb.extend_seq_lens, 0)
        else:
            qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=self.device)
        fb.attn_metadata = _FlashInferMetadata(
            kv_indptr=kv_indptr,
            kv_indices=kv_indices,
            kv_last_page_len=torch.ones(bs, dtype=torch.int32, device=self.device),
            qo_indptr=qo_indptr,
        )

    def _plan(self, meta: _FlashInferMetadata, layer: "RadixAttention", q_dtype: torch.dtype, kv_dtype: torch.dtype, decode: bool) -> None:
        common = dict(
            num_qo_heads=layer.tp_q_head_num,
            num_kv_heads=layer.tp_k_head_num,
            page_size=1,
            sm_scale=layer.scaling,
            q_data_type=q_dtype,
            kv_data_type=kv_dtype,
        )
        if decode:
            self.decode_wrapper.plan(
                meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len, head_dim=layer.head_dim, **common
            )
        else:
            # causal=True aligns the mask bottom-right: query i of an extend sits at kv position
            # prefix_len + i, exactly the prefix-plus-causal rule.
            self.prefill_wrapper.plan(
                meta.qo_indptr,
                meta.kv_indptr,
                meta.kv_indices,
                meta.kv_last_page_len,
                head_dim_qk=layer.head_dim,
                causal=True,
                **common,
            )
        meta.planned = True

    # ------------------------------------------------------------------ forward
    def _run(self, q, k, v, layer: "RadixAttention", fb: "ForwardBatch", save_kv_cache: bool, decode: bool):
        pool = fb.token_to_kv_pool
        assert pool is not None  # ForwardBatch.init_new sets it
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        meta: _FlashInferMetadata = fb.attn_metadata
        if not meta.planned:
            self._plan(meta, layer, q.dtype, k_buf.dtype, decode)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)
        # [slots, kv_heads, D] -> [pages, page_size=1, kv_heads, D] (NHD), a view.
        paged_kv = (k_buf.unsqueeze(1), v_buf.unsqueeze(1))
        wrapper = self.decode_wrapper if decode else self.prefill_wrapper
        out = wrapper.run(q3, paged_kv)
        return out.reshape(q3.shape[0], -1)

    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool = True):
        if not layer.is_causal:
            # Its plan is shared by every layer and fixed to causal; encoders need the other two.
            raise NotImplementedError("the flashinfer backend has no encoder (non-causal) attention; use "
                                      "--attention-backend triton or torch_native for encoder models")
        if forward_batch.spec_tree_mask is not None:  # ServerArgs refuses the combination at start-up
            raise NotImplementedError("the flashinfer backend has no tree mask (--speculative-eagle-topk > 1)")
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, decode=False)

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool = True):
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, decode=True)
