"""Attention over an MLA pool (mem_cache/mla_pool.py) in torch: the torch_native backend's path for
DeepSeek-V2/V3 models.

The model hands each layer queries already absorbed into the latent space: q [T, heads, D] with
D = kv_lora_rank + qk_rope_head_dim, and one shared K/V "head" per token. Every query head attends
over the same keys, the pool rows [slots, 1, D]; the values are the first kv_lora_rank values of
those rows (the pool's v_buffer is a view of them), so the output is [T, heads, kv_lora_rank] and
K's size differs from V's. This is multi-query attention: a decode step's heads become query rows
of the one K/V head, an extend's go through SDPA's grouped-query broadcast. No native C kernel
computes it (they assume K and V of one size), so MLA always runs here, in the model's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Union

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.layers.radix_attention import RadixAttention
    from engine.model_executor.forward_batch_info import ForwardBatch


@dataclass
class _MLAExtendSeq:
    q_start: int  # first row of its new tokens in q
    extend_len: int
    kv_indices: torch.Tensor  # [seq_len] pool slots of prefix + new tokens
    mask: Optional[torch.Tensor]  # [extend_len, seq_len] bool where a prefix precedes; None: plain causal


@dataclass
class MLAExtendMetadata:
    seqs: List[_MLAExtendSeq]


@dataclass
class MLADecodeMetadata:
    kv_indices: torch.Tensor  # [bs, max_len] slots, 0 past a request's length
    mask: Optional[torch.Tensor]  # [bs, 1, 1, max_len] True at real keys; None when no row is padded


def mla_metadata(fb: "ForwardBatch") -> Union[MLAExtendMetadata, MLADecodeMetadata, None]:
    """The per-batch tables every MLA layer of this forward shares (None for an idle batch)."""
    assert fb.req_to_token_pool is not None  # ForwardBatch.init_new sets it
    table = fb.req_to_token_pool.req_to_token
    if fb.forward_mode.is_decode():
        max_len = max(fb.seq_lens_cpu)
        rows = table[:, :max_len].index_select(0, fb.req_pool_indices).long()
        if min(fb.seq_lens_cpu) == max_len:
            return MLADecodeMetadata(rows, None)
        valid = torch.arange(max_len, device=rows.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        # Stale table entries past a request's length may point anywhere: read slot 0 there, masked.
        return MLADecodeMetadata(torch.where(valid, rows, torch.zeros_like(rows)), valid[:, None, None, :])
    if not fb.forward_mode.is_extend():
        return None
    assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None  # set for extends
    seqs: List[_MLAExtendSeq] = []
    q_start = 0
    for i, (row, seq_len, ext_len, prefix_len) in enumerate(zip(fb.req_pool_indices.tolist(), fb.seq_lens_cpu,
                                                                fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)):
        mask = None
        tree = fb.tree_mask_block(i)
        if tree is not None:
            # Speculative tree drafts (a verify forward, a draft's fed nodes): every key before the
            # tree's block is visible, inside it the tree mask says which ancestors each node sees.
            visible = torch.ones(ext_len, seq_len - tree.shape[1], dtype=torch.bool, device=tree.device)
            mask = torch.cat([visible, tree], dim=1)
        elif prefix_len > 0 and ext_len > 1:
            # New token i sits at position prefix_len + i and sees keys 0..prefix_len + i.
            q_pos = torch.arange(ext_len, device=table.device).unsqueeze(1) + prefix_len
            mask = torch.arange(seq_len, device=table.device).unsqueeze(0) <= q_pos
        seqs.append(_MLAExtendSeq(q_start, ext_len, table[row, :seq_len].long(), mask))
        q_start += ext_len
    return MLAExtendMetadata(seqs)


def mla_forward(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor], layer: "RadixAttention",
                fb: "ForwardBatch", save_kv_cache: bool) -> torch.Tensor:
    """[T, heads * kv_lora_rank]: the attention of every query row over its request's latent K/V."""
    pool = fb.token_to_kv_pool
    assert pool is not None  # ForwardBatch.init_new sets it
    if save_kv_cache and k is not None and v is not None:
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
    # V is the latent part of the same rows (the pool's v_buffer views it): read once, sliced.
    k_buf = pool.get_key_buffer(layer.layer_id)
    heads, dim, v_dim = layer.tp_q_head_num, layer.head_dim, layer.v_head_dim
    meta = fb.attn_metadata
    if isinstance(meta, MLADecodeMetadata):
        bs, max_len = meta.kv_indices.shape
        rows = pool.read_k(layer.layer_id, k_buf.index_select(0, meta.kv_indices.view(-1)), q.dtype)
        rows = rows.view(bs, 1, max_len, dim)
        # One decode token per request needs no causal mask: its heads are query rows of the one K/V head.
        o = F.scaled_dot_product_attention(q.view(bs, 1, heads, dim), rows, rows[..., :v_dim],
                                           attn_mask=meta.mask, scale=layer.scaling)
        return o.reshape(bs, heads * v_dim)
    assert isinstance(meta, MLAExtendMetadata), "the torch_native backend builds MLA metadata for an MLA pool"
    q3 = q.view(-1, heads, dim)
    out = q3.new_empty(q3.shape[0], heads, v_dim)
    for seq in meta.seqs:
        if seq.extend_len == 0:
            continue
        span = slice(seq.q_start, seq.q_start + seq.extend_len)
        kv = pool.read_k(layer.layer_id, k_buf.index_select(0, seq.kv_indices), q.dtype)
        kv = kv.transpose(0, 1).unsqueeze(0)  # [1, 1, S, D]
        o = F.scaled_dot_product_attention(
            q3[span].transpose(0, 1).unsqueeze(0), kv, kv[..., :v_dim], attn_mask=seq.mask,
            # No prefix: the plain causal square; one new token after a prefix sees every key.
            is_causal=seq.mask is None and seq.extend_len > 1 and seq.extend_len == seq.kv_indices.numel(),
            scale=layer.scaling, enable_gqa=heads > 1)
        out[span] = o.squeeze(0).transpose(0, 1)
    return out.view(-1, heads * v_dim)
