"""The reference attention backend: plain torch SDPA over K/V gathered from the paged pool.

Extend runs one SDPA per request (its new tokens attend to prefix + new tokens, causally).
Decode runs ONE batched SDPA for the whole batch: every request's K/V are gathered into a
[bs, max_seq_len] block with a padding mask. All index tensors are built once per batch in
`init_forward_metadata` and shared by every layer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional

import torch
import torch.nn.functional as F

from engine.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from engine.layers.radix_attention import RadixAttention
    from engine.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)


@dataclass
class _ExtendSeq:
    """One request of an extend batch."""

    q_start: int  # first row of its tokens in q
    extend_len: int
    kv_indices: torch.Tensor  # [seq_len] pool slots of prefix + new tokens
    mask: Optional[torch.Tensor]  # [extend_len, seq_len] bool, None for a plain causal square
    prefix_len: int


@dataclass
class _PaddedExtend:
    """All requests without a cached prefix, right-padded into one batched causal SDPA.

    With right padding and a causal mask a real query never sees a padding key, so the padded
    rows only cost compute; they are dropped when the output is gathered back.
    """

    bs: int
    max_len: int
    gather_rows: torch.Tensor  # [bs * max_len] token rows of q/k/v (padding repeats a real row)
    output_rows: torch.Tensor  # [num_tokens] position of each real token in the padded layout


# Batch prefix-free extends into one padded SDPA only while padding wastes little compute.
MAX_PADDING_RATIO = 1.5


@dataclass
class _DecodeMetadata:
    kv_indices: torch.Tensor  # [bs, max_seq_len] pool slots (slot 0 where padded)
    mask: Optional[torch.Tensor]  # [bs, 1, 1, max_seq_len] bool; None when no row is padded


class TorchNativeAttnBackend(AttentionBackend):
    # Its decode metadata is shaped by the longest sequence of each batch, so it cannot be static.
    supports_cuda_graph = False

    def __init__(self, model_runner: Any) -> None:
        self.device = model_runner.device
        # Two growing scratch buffers (K and V) for the decode gathers, reused by every layer and
        # step. Only the forward thread uses them, one forward at a time.
        self._scratch: List[Optional[torch.Tensor]] = [None, None]

    def _gather(self, buf: torch.Tensor, flat: torch.Tensor, which: int) -> torch.Tensor:
        rows = buf.view(buf.shape[0], -1)
        need = flat.numel() * rows.shape[1]
        scratch = self._scratch[which]
        if scratch is None or scratch.numel() < need or scratch.dtype != buf.dtype:
            scratch = torch.empty(need, dtype=buf.dtype, device=buf.device)
            self._scratch[which] = scratch
        out = scratch[:need].view(flat.numel(), rows.shape[1])
        return torch.index_select(rows, 0, flat, out=out)

    # ------------------------------------------------------------------ metadata
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        if forward_batch.forward_mode.is_decode():
            forward_batch.attn_metadata = self._decode_metadata(forward_batch)
        elif forward_batch.forward_mode.is_extend():
            forward_batch.attn_metadata = self._extend_metadata(forward_batch)
        else:
            forward_batch.attn_metadata = None

    def _decode_metadata(self, fb: "ForwardBatch") -> _DecodeMetadata:
        max_len = max(fb.seq_lens_cpu)
        # Slice the columns first: the table is context_len wide and only max_len columns matter.
        rows = fb.req_to_token_pool.req_to_token[:, :max_len].index_select(0, fb.req_pool_indices)
        if min(fb.seq_lens_cpu) == max_len:
            return _DecodeMetadata(kv_indices=rows.long(), mask=None)
        valid = torch.arange(max_len, device=rows.device).unsqueeze(0) < fb.seq_lens.unsqueeze(1)
        # Stale table entries past a request's length may point anywhere; send them to slot 0.
        kv_indices = torch.where(valid, rows.long(), torch.zeros((), dtype=torch.long, device=rows.device))
        return _DecodeMetadata(kv_indices=kv_indices, mask=valid[:, None, None, :])

    def _extend_metadata(self, fb: "ForwardBatch"):
        padded = self._padded_extend_metadata(fb)
        return padded if padded is not None else self._extend_metadata_per_request(fb)

    def _extend_metadata_per_request(self, fb: "ForwardBatch") -> List[_ExtendSeq]:
        table = fb.req_to_token_pool.req_to_token
        pool_rows = fb.req_pool_indices.tolist()
        seqs: List[_ExtendSeq] = []
        q_start = 0
        for row, seq_len, ext_len, prefix_len in zip(
            pool_rows, fb.seq_lens_cpu, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        ):
            kv_indices = table[row, :seq_len].long()
            mask = None
            if prefix_len > 0 and ext_len > 1:
                # Query i sits at position prefix_len + i and sees keys 0..prefix_len + i.
                q_pos = torch.arange(ext_len, device=table.device).unsqueeze(1) + prefix_len
                mask = torch.arange(seq_len, device=table.device).unsqueeze(0) <= q_pos
            seqs.append(_ExtendSeq(q_start, ext_len, kv_indices, mask, prefix_len))
            q_start += ext_len
        return seqs

    def _padded_extend_metadata(self, fb: "ForwardBatch") -> Optional[_PaddedExtend]:
        ext_lens = fb.extend_seq_lens_cpu
        bs = len(ext_lens)
        if bs < 2 or any(fb.extend_prefix_lens_cpu) or min(ext_lens) == 0:
            return None
        max_len = max(ext_lens)
        total = sum(ext_lens)
        if bs * max_len > MAX_PADDING_RATIO * total:
            return None
        device = fb.extend_seq_lens.device
        offsets = torch.arange(max_len, device=device).unsqueeze(0)
        starts = fb.extend_start_loc.unsqueeze(1)
        # Padding positions point at the request's last real token: any in-range row will do.
        gather_rows = starts + torch.minimum(offsets, fb.extend_seq_lens.unsqueeze(1) - 1)
        owner = torch.repeat_interleave(torch.arange(bs, device=device), fb.extend_seq_lens)
        output_rows = owner * max_len + (torch.arange(total, device=device) - fb.extend_start_loc[owner])
        return _PaddedExtend(bs, max_len, gather_rows.reshape(-1), output_rows)

    # ------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool = True):
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        meta = forward_batch.attn_metadata
        if isinstance(meta, _PaddedExtend) and k is not None:
            return self._forward_padded_extend(q, k, v, layer, meta)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        q = q.view(-1, num_heads, head_dim)
        out = torch.empty_like(q)
        gqa = num_heads != layer.tp_k_head_num
        if isinstance(meta, _PaddedExtend):  # no fresh K/V given: fall back to the pool
            meta = self._extend_metadata_per_request(forward_batch)
        for seq in meta:
            if seq.extend_len == 0:
                continue
            rows = slice(seq.q_start, seq.q_start + seq.extend_len)
            q_seq = q[rows].transpose(0, 1)  # [H, ext, D]
            if seq.prefix_len == 0 and k is not None:
                # Nothing cached: the K/V just computed are the whole sequence; skip the gather.
                k_seq, v_seq = k[rows].transpose(0, 1), v[rows].transpose(0, 1)
            else:
                k_seq = k_buf.index_select(0, seq.kv_indices).transpose(0, 1).to(q.dtype)  # [KH, seq, D]
                v_seq = v_buf.index_select(0, seq.kv_indices).transpose(0, 1).to(q.dtype)
            # With no prefix the mask is the plain (square) causal one; a single new token on top
            # of a prefix sees everything.
            is_causal = seq.mask is None and seq.extend_len > 1
            o = F.scaled_dot_product_attention(
                q_seq.unsqueeze(0),
                k_seq.unsqueeze(0),
                v_seq.unsqueeze(0),
                attn_mask=seq.mask,
                is_causal=is_causal,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            out[seq.q_start : seq.q_start + seq.extend_len] = o.squeeze(0).transpose(0, 1)
        return out.view(-1, num_heads * head_dim)

    def _forward_padded_extend(self, q, k, v, layer: "RadixAttention", meta: _PaddedExtend) -> torch.Tensor:
        num_heads, kv_heads, head_dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim

        def pad(x: torch.Tensor, heads: int) -> torch.Tensor:  # [T, heads*D] -> [bs, heads, max_len, D]
            x = x.reshape(-1, heads * head_dim).index_select(0, meta.gather_rows)
            return x.view(meta.bs, meta.max_len, heads, head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(
            pad(q, num_heads), pad(k, kv_heads), pad(v, kv_heads),
            is_causal=True, scale=layer.scaling, enable_gqa=num_heads != kv_heads,
        )
        o = o.transpose(1, 2).reshape(meta.bs * meta.max_len, num_heads * head_dim)
        return o.index_select(0, meta.output_rows)

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool = True):
        pool = forward_batch.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        meta: _DecodeMetadata = forward_batch.attn_metadata
        bs = q.shape[0]
        num_heads, kv_heads, head_dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        group = num_heads // kv_heads
        # GQA without copying K/V per query head: the `group` query heads sharing one KV head
        # become `group` query rows of that head (one decode token needs no causal mask).
        q4 = q.view(bs, kv_heads, group, head_dim)
        # index_select over the flat slot list is several times faster on the CPU than advanced
        # indexing with the 2-D index, and gathering into reused scratch memory is ~5x faster
        # again than into a fresh tensor (a fresh multi-MB tensor is page-faulted in every time).
        flat = meta.kv_indices.view(-1)
        k4 = self._gather(k_buf, flat, 0).view(bs, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)  # [bs, KH, L, D]
        v4 = self._gather(v_buf, flat, 1).view(bs, -1, kv_heads, head_dim).transpose(1, 2).to(q.dtype)
        o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=meta.mask, scale=layer.scaling)
        return o.reshape(bs, num_heads * head_dim)
