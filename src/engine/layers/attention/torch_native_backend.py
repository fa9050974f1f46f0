"""The reference attention backend: plain torch SDPA over K/V gathered from the paged pool.

Extend runs one SDPA per request (its new tokens attend to prefix + new tokens, causally; an
encoder layer, `RadixAttention.is_causal` False, attends over all of its request's tokens), or one
batched SDPA for prefix-free requests of similar lengths; causal bf16 prefills on a CPU with
AVX512-BF16 run the native extend kernel of `engine.kernels.attention` instead (one call per layer, K/V read from
the pool).
Decode on the CPU runs the native kernel of `engine.kernels.attention`, which reads every request's K/V in place
from the pool; elsewhere (or without a C compiler) ONE batched SDPA runs for the whole batch, over
K/V gathered into a [bs, max_seq_len] block with a padding mask. Requests whose KV starts with the same pool slots
(a prefix the radix cache shares) are decoded as a cascade: the shared prefix is read once per
group, all the group's queries attend to it in one SDPA, each request's own suffix goes through
the per-request path above, and the two halves are merged by their log-sum-exp. All index tensors are built
once per batch in `init_forward_metadata` and shared by every layer.
Layers that are not plain full attention (a sliding window, Gemma 2's logit cap, gpt-oss's sinks), and
tree drafts' verify forwards, run on the native decode kernel with one query row per token where it takes
the call (kernel_rows.py); otherwise windowed.py's torch path (those layers) or one SDPA per request under
its tree mask.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

import torch
import torch.nn.functional as F

from engine.kernels import attention as attention_kernels
from engine.kernels import library
from engine.layers.attention.kernel_rows import KernelRows, KernelTables, kernel_takes
from engine.layers.attention.windowed import windowed_decode, windowed_extend
from engine.layers.attention.base_attn_backend import AttentionBackend, AttentionRunner
from engine.layers.attention.prefix_panels import PrefixPanels
from engine.layers.attention.mla_torch import MLADecodeMetadata, MLAExtendMetadata, mla_forward, mla_metadata
from engine.mem_cache.mla_pool import MLATokenToKVPool

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
    # [bs, 1, 1, max_len] True at real keys: without the causal mask (encoders) padding keys
    # must be masked explicitly.
    key_valid: torch.Tensor


# Batch prefix-free extends into one padded SDPA only while padding wastes little compute.
MAX_PADDING_RATIO = 1.5


# A group of decoding requests is given a cascade only when they share at least this many
# leading KV slots: below it, reading the prefix per request costs less than the extra SDPA.
MIN_SHARED_PREFIX = 64


@dataclass
class _SharedPrefix:
    """Decoding requests whose KV begins with the same pool slots."""

    members: torch.Tensor  # [g] their rows in the batch
    kv_indices: torch.Tensor  # [prefix_len] the shared pool slots


@dataclass
class _DecodeMetadata:
    # Per request: the pool slots of its KV past its group's shared prefix (all of it when it
    # shares none), slot 0 where padded.
    kv_indices: torch.Tensor  # [bs, max_len]
    lens: torch.Tensor  # [bs] how many of each row's slots are real
    mask: Optional[torch.Tensor]  # [bs, 1, 1, max_len] bool; None when no row is padded
    shared: List[_SharedPrefix]
    cascade: Optional[attention_kernels.CascadeTables] = None  # `shared` in the native kernel's layout


class TorchNativeAttnBackend(AttentionBackend):
    # Its decode metadata is shaped by the longest sequence of each batch, so it cannot be static.
    supports_cuda_graph = False

    def __init__(self, model_runner: AttentionRunner) -> None:
        self.device = model_runner.device
        # Two growing scratch buffers (K and V) for the decode gathers, reused by every layer and
        # step. Only the forward thread uses them, one forward at a time.
        self._scratch: List[Optional[torch.Tensor]] = [None, None]
        if str(self.device) == "cpu":
            library.load()  # build/load it now, not in the first decode
        self._prefix_panels = PrefixPanels()
        # The current forward batch's tables for the kernel's masked rows (kernel_rows.py), built at first use.
        self._kernel_rows: Optional[KernelRows] = None

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
        self._kernel_rows = None  # a batch's fields may change between forwards of one object (drafting steps)
        if isinstance(forward_batch.token_to_kv_pool, MLATokenToKVPool):  # K and V of different sizes: mla_torch.py
            forward_batch.attn_metadata = mla_metadata(forward_batch)
        elif forward_batch.forward_mode.is_decode():
            forward_batch.attn_metadata = self._decode_metadata(forward_batch)
            self._keep_prefix_panels(forward_batch.attn_metadata, forward_batch)
        elif forward_batch.forward_mode.is_extend():
            forward_batch.attn_metadata = self._extend_metadata(forward_batch)
            if isinstance(forward_batch.attn_metadata, _NativeExtend):
                self._keep_prefix_panels(forward_batch.attn_metadata.decode, forward_batch)
        else:
            forward_batch.attn_metadata = None

    def _keep_prefix_panels(self, meta: Optional[_DecodeMetadata], fb: "ForwardBatch") -> None:
        """Cascade prefixes' panels kept across steps (prefix_panels.py), where the kernel uses them."""
        pool = fb.token_to_kv_pool
        if meta is not None and meta.cascade is not None and pool is not None and pool.k_buffer[0].is_cpu:
            self._prefix_panels.attach(meta.cascade, [g.kv_indices for g in meta.shared], pool)

    def native_decode_tables(self, fb: "ForwardBatch") -> Optional[
            Tuple[torch.Tensor, torch.Tensor, Optional[attention_kernels.CascadeTables]]]:
        """(kv_indices, lens, cascade) of a decode batch whose metadata init_forward_metadata built, as
        forward_decode hands them to the native kernel (engine/kernels/decoder_layers.py runs the layers
        with them); None for other batches."""
        meta = fb.attn_metadata
        if not isinstance(meta, _DecodeMetadata):
            return None
        return meta.kv_indices, meta.lens, meta.cascade

    def _decode_metadata(self, fb: "ForwardBatch") -> _DecodeMetadata:
        assert fb.req_to_token_pool is not None  # ForwardBatch.init_new sets it
        return _decode_tables(fb.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu)

    def _extend_metadata(self, fb: "ForwardBatch"):
        pool = fb.token_to_kv_pool
        assert pool is not None  # ForwardBatch.init_new sets it
        if fb.spec_tree_mask is not None:
            # Tree drafts: each token a row of the decode kernel over the keys its mask shows
            # (kernel_rows.py, its tables built at the first layer); where the kernel does not take a
            # layer's call, one SDPA per request under its own mask (its metadata built then).
            if pool.k_buffer[0].is_cpu and library.attention() is not None:
                return None
            return self._extend_metadata_per_request(fb)
        # bf16 prefills on the CPU go through the native kernels (K/V read from the pool).
        if (pool.k_buffer[0].is_cpu and pool.dtype == torch.bfloat16 and pool.head_dim % 2 == 0
                and attention_kernels.extend_supported()):
            return _native_extend_tables(fb)
        padded = self._padded_extend_metadata(fb)
        return padded if padded is not None else self._extend_metadata_per_request(fb)

    def _extend_metadata_per_request(self, fb: "ForwardBatch") -> List[_ExtendSeq]:
        # ForwardBatch.init_new sets the pool, and the extend fields for extends.
        assert fb.req_to_token_pool is not None
        assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
        table = fb.req_to_token_pool.req_to_token
        pool_rows = fb.req_pool_indices.tolist()
        seqs: List[_ExtendSeq] = []
        q_start = 0
        for i, (row, seq_len, ext_len, prefix_len) in enumerate(zip(
            pool_rows, fb.seq_lens_cpu, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu
        )):
            kv_indices = table[row, :seq_len].long()
            mask = None
            tree = fb.tree_mask_block(i)
            if tree is not None:  # the keys before the tree's, then the tree mask
                visible = torch.ones(ext_len, seq_len - tree.shape[1], dtype=torch.bool, device=tree.device)
                mask = torch.cat([visible, tree], dim=1)
            elif prefix_len > 0 and ext_len > 1:
                # Query i sits at position prefix_len + i and sees keys 0..prefix_len + i.
                q_pos = torch.arange(ext_len, device=table.device).unsqueeze(1) + prefix_len
                mask = torch.arange(seq_len, device=table.device).unsqueeze(0) <= q_pos
            seqs.append(_ExtendSeq(q_start, ext_len, kv_indices, mask, prefix_len))
            q_start += ext_len
        return seqs

    def _padded_extend_metadata(self, fb: "ForwardBatch") -> Optional[_PaddedExtend]:
        ext_lens = fb.extend_seq_lens_cpu
        # ForwardBatch.init_new sets the extend fields for extends.
        assert ext_lens is not None and fb.extend_prefix_lens_cpu is not None
        assert fb.extend_seq_lens is not None and fb.extend_start_loc is not None
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
        key_valid = (offsets < fb.extend_seq_lens.unsqueeze(1))[:, None, None, :]
        return _PaddedExtend(bs, max_len, gather_rows.reshape(-1), output_rows, key_valid)

    # ------------------------------------------------------------------ forward
    def forward_extend(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool = True):
        if isinstance(forward_batch.attn_metadata, MLAExtendMetadata):
            return mla_forward(q, k, v, layer, forward_batch, save_kv_cache)
        pool = forward_batch.token_to_kv_pool
        assert pool is not None  # ForwardBatch.init_new sets it
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if not layer.is_plain:  # a window, a logit cap or sinks: the decode kernel's masked rows, or torch
            if kernel_takes(q, pool.get_key_buffer(layer.layer_id), layer):
                return self._rows_for(forward_batch).attend(q, layer)  # a tree's rows too
            if forward_batch.spec_tree_mask is not None:  # the speculator checks this at start-up
                raise NotImplementedError("tree drafts (--speculative-eagle-topk > 1) on layers with a sliding "
                                          "window, a logit cap or sinks need the native decode kernel")
            return windowed_extend(q, layer, forward_batch)
        if forward_batch.spec_tree_mask is not None and kernel_takes(q, pool.get_key_buffer(layer.layer_id), layer):
            return self._rows_for(forward_batch).attend(q, layer)  # each row over its tree mask's keys
        if k is not None and pool.is_fp8:  # the new tokens' K/V as the pool holds them, as every other key
            k, v = pool.as_stored(layer.layer_id, k, v)
        meta = forward_batch.attn_metadata
        if isinstance(meta, _PaddedExtend) and k is not None:
            return self._forward_padded_extend(q, k, v, layer, meta)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if isinstance(meta, _NativeExtend) and (not layer.is_causal or q.dtype != torch.bfloat16):
            # The native kernels are causal only, and bf16 only (a float32 model over a bf16 pool is not).
            meta = self._extend_metadata_per_request(forward_batch)
        if isinstance(meta, _NativeExtend):
            return self._forward_native_extend(q.view(q.shape[0], -1), k_buf, v_buf, layer, meta)
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        q = q.view(-1, num_heads, head_dim)
        out = torch.empty_like(q)
        gqa = num_heads != layer.tp_k_head_num
        if meta is None or isinstance(meta, _PaddedExtend):  # tree drafts the kernel did not take; no fresh K/V
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
                k_seq = pool.read_k(layer.layer_id, k_buf.index_select(0, seq.kv_indices), q.dtype).transpose(0, 1)
                v_seq = pool.read_v(layer.layer_id, v_buf.index_select(0, seq.kv_indices), q.dtype).transpose(0, 1)
            # With no prefix the mask is the plain (square) causal one; a single new token on top
            # of a prefix sees everything, and so does every token of an encoder.
            is_causal = layer.is_causal and seq.mask is None and seq.extend_len > 1
            o = F.scaled_dot_product_attention(
                q_seq.unsqueeze(0),
                k_seq.unsqueeze(0),
                v_seq.unsqueeze(0),
                attn_mask=seq.mask if layer.is_causal else None,
                is_causal=is_causal,
                scale=layer.scaling,
                enable_gqa=gqa,
            )
            out[seq.q_start : seq.q_start + seq.extend_len] = o.squeeze(0).transpose(0, 1)
        return out.view(-1, num_heads * head_dim)

    def forward_extend_last_rows(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch",
                                 save_kv_cache: bool = True):
        """With the native kernels, each request's last token attends through the decode kernel (and its
        cascade over shared prefixes): one query row per request instead of all the new tokens. A
        windowed, soft-capped or sink layer the kernel takes: the same, over its last row's window."""
        pool = forward_batch.token_to_kv_pool
        assert pool is not None  # ForwardBatch.init_new sets it
        if (not layer.is_plain and forward_batch.spec_tree_mask is None and not isinstance(
                forward_batch.attn_metadata, MLAExtendMetadata) and kernel_takes(q, pool.get_key_buffer(layer.layer_id), layer)):
            if save_kv_cache and k is not None:
                pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
            rows = q.reshape(q.shape[0], -1).index_select(0, forward_batch.last_positions())
            return self._rows_for(forward_batch).attend_last_rows(rows, layer)
        meta = forward_batch.attn_metadata
        if (not isinstance(meta, _NativeExtend) or not layer.is_causal or not layer.is_plain
                or q.dtype != torch.bfloat16):
            return super().forward_extend_last_rows(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        if meta.last_rows is None:
            meta.last_rows = self._decode_metadata(forward_batch)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        rows = q.view(q.shape[0], -1).index_select(0, forward_batch.last_positions())
        return attention_kernels.decode_attention(
            rows, k_buf, v_buf, meta.last_rows.kv_indices, meta.last_rows.lens, layer.tp_q_head_num,
            layer.tp_k_head_num, layer.head_dim, layer.scaling, cascade=meta.last_rows.cascade, layer_id=layer.layer_id)

    def _rows_for(self, fb: "ForwardBatch") -> KernelRows:
        if self._kernel_rows is None or self._kernel_rows.batch is not fb:
            self._kernel_rows = KernelRows(fb)
        return self._kernel_rows

    def _forward_native_extend(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                               layer: "RadixAttention", meta: _NativeExtend) -> torch.Tensor:
        heads, kv_heads, dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        if meta.decode is None:
            assert meta.extend is not None  # a batch has single-token requests, others, or both
            return attention_kernels.extend_attention(q, k_buf, v_buf, meta.extend, heads, kv_heads, dim, layer.scaling)
        assert meta.decode_rows is not None  # set with meta.decode
        out = torch.empty(q.shape[0], heads * dim, dtype=q.dtype)
        if meta.extend is not None:
            # Rows of single-token requests come out of the decode kernel below; these are overwritten.
            out = attention_kernels.extend_attention(q, k_buf, v_buf, meta.extend, heads, kv_heads, dim, layer.scaling)
        decoded = attention_kernels.decode_attention(q.index_select(0, meta.decode_rows), k_buf, v_buf,
                                                     meta.decode.kv_indices, meta.decode.lens, heads, kv_heads, dim,
                                                     layer.scaling, cascade=meta.decode.cascade,
                                                     layer_id=layer.layer_id)
        return out.index_copy_(0, meta.decode_rows, decoded)

    def _forward_padded_extend(self, q, k, v, layer: "RadixAttention", meta: _PaddedExtend) -> torch.Tensor:
        num_heads, kv_heads, head_dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim

        def pad(x: torch.Tensor, heads: int) -> torch.Tensor:  # [T, heads*D] -> [bs, heads, max_len, D]
            x = x.reshape(-1, heads * head_dim).index_select(0, meta.gather_rows)
            return x.view(meta.bs, meta.max_len, heads, head_dim).transpose(1, 2)

        # Right padding under a causal mask is never seen by a real query; without one it is masked.
        o = F.scaled_dot_product_attention(
            pad(q, num_heads), pad(k, kv_heads), pad(v, kv_heads),
            attn_mask=None if layer.is_causal else meta.key_valid,
            is_causal=layer.is_causal, scale=layer.scaling, enable_gqa=num_heads != kv_heads,
        )
        o = o.transpose(1, 2).reshape(meta.bs * meta.max_len, num_heads * head_dim)
        return o.index_select(0, meta.output_rows)

    def forward_decode(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch", save_kv_cache: bool = True):
        if isinstance(forward_batch.attn_metadata, MLADecodeMetadata):
            return mla_forward(q, k, v, layer, forward_batch, save_kv_cache)
        pool = forward_batch.token_to_kv_pool
        assert pool is not None  # ForwardBatch.init_new sets it
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        meta: _DecodeMetadata = forward_batch.attn_metadata
        if not layer.is_plain:
            if kernel_takes(q, pool.get_key_buffer(layer.layer_id), layer):
                plain = KernelTables(meta.kv_indices, meta.lens, cascade=meta.cascade)
                return self._rows_for(forward_batch).attend(q, layer, plain_decode=plain)
            return windowed_decode(q, layer, forward_batch)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        bs = q.shape[0]
        num_heads, kv_heads, head_dim = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        group = num_heads // kv_heads
        # GQA without copying K/V per query head: the `group` query heads sharing one KV head
        # become `group` query rows of that head (one decode token needs no causal mask).
        q4 = q.view(bs, kv_heads, group, head_dim)
        if attention_kernels.supports(q, k_buf):
            # The native kernel reads each request's K/V where they lie in the pool, and a cascade
            # group's prefix once for all its members, in one call per layer (fp8 K/V widened in registers).
            return attention_kernels.decode_attention(q.reshape(bs, -1), k_buf, v_buf, meta.kv_indices, meta.lens,
                                                      num_heads, kv_heads, head_dim, layer.scaling,
                                                      cascade=meta.cascade, layer_id=layer.layer_id,
                                                      kv_scales=pool.kv_scales(layer.layer_id))
        # index_select over the flat slot list is several times faster on the CPU than advanced
        # indexing with the 2-D index, and gathering into reused scratch memory is ~5x faster again
        # than into a fresh tensor (a fresh multi-MB tensor is page-faulted in every time).
        flat = meta.kv_indices.view(-1)
        k4 = pool.read_k(layer.layer_id, self._gather(k_buf, flat, 0), q.dtype).view(bs, -1, kv_heads, head_dim)
        v4 = pool.read_v(layer.layer_id, self._gather(v_buf, flat, 1), q.dtype).view(bs, -1, kv_heads, head_dim)
        k4, v4 = k4.transpose(1, 2), v4.transpose(1, 2)  # [bs, KH, L, D]
        if not meta.shared:
            o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=meta.mask, scale=layer.scaling)
            return o.reshape(bs, num_heads * head_dim)
        o, lse = _sdpa_with_lse(q4, k4, v4, meta.mask, layer.scaling)  # the suffixes
        for prefix in meta.shared:
            g = prefix.members.numel()
            # The group's queries become one request of g * group query rows per KV head.
            qg = q4.index_select(0, prefix.members).transpose(0, 1).reshape(1, kv_heads, g * group, head_dim)
            kp = pool.read_k(layer.layer_id, k_buf.index_select(0, prefix.kv_indices), q.dtype)
            vp = pool.read_v(layer.layer_id, v_buf.index_select(0, prefix.kv_indices), q.dtype)
            kp = kp.view(1, -1, kv_heads, head_dim).transpose(1, 2)
            vp = vp.view(1, -1, kv_heads, head_dim).transpose(1, 2)
            op, lsep = _sdpa_with_lse(qg, kp, vp, None, layer.scaling)
            op = op.view(kv_heads, g, group, head_dim).transpose(0, 1)
            lsep = lsep.view(kv_heads, g, group).transpose(0, 1)
            o[prefix.members] = _merge_attention(op, lsep, o[prefix.members], lse[prefix.members])
        return o.reshape(bs, num_heads * head_dim)


def _decode_tables(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                   seq_lens_cpu: List[int]) -> _DecodeMetadata:
    """Each request's KV slots past its cascade group's shared prefix (all of them without one)."""
    max_len = max(seq_lens_cpu)
    # Slice the columns first: the table is context_len wide and only max_len columns matter.
    rows = req_to_token[:, :max_len].index_select(0, req_pool_indices)
    shared = _shared_prefixes(rows, seq_lens_cpu)
    if shared:
        starts = torch.zeros(len(seq_lens_cpu), dtype=torch.long, device=rows.device)
        for group in shared:
            starts[group.members] = group.kv_indices.numel()
        lens = seq_lens - starts
        max_len = int(lens.max())
        cols = (starts.unsqueeze(1) + torch.arange(max_len, device=rows.device)).clamp_(max=rows.shape[1] - 1)
        rows = rows.gather(1, cols)
    else:
        lens = seq_lens
    cascade = _cascade_tables(shared, len(seq_lens_cpu), rows.device) if shared else None
    if int(lens.min()) == max_len:
        return _DecodeMetadata(kv_indices=rows.long(), lens=lens, mask=None, shared=shared, cascade=cascade)
    valid = torch.arange(max_len, device=rows.device).unsqueeze(0) < lens.unsqueeze(1)
    # Stale table entries past a request's length may point anywhere; send them to slot 0.
    kv_indices = torch.where(valid, rows.long(), torch.zeros((), dtype=torch.long, device=rows.device))
    return _DecodeMetadata(kv_indices=kv_indices, lens=lens, mask=valid[:, None, None, :], shared=shared,
                           cascade=cascade)


@dataclass
class _NativeExtend:
    """A bf16 extend batch for the native kernels: requests with several new tokens go through the
    extend kernel; those with one (the decode rows of a MIXED batch, a fully cached prompt) through the
    decode kernel, whose cascade reads a shared prefix once per group."""

    extend: Optional[attention_kernels.ExtendTables]
    decode: Optional[_DecodeMetadata]
    decode_rows: Optional[torch.Tensor]  # [n] the single-token requests' rows in q
    # Every request's last token over its whole sequence, as a decode batch (forward_extend_last_rows
    # builds it at its first use in the forward).
    last_rows: Optional[_DecodeMetadata] = None


def _native_extend_tables(fb: "ForwardBatch") -> _NativeExtend:
    # ForwardBatch.init_new sets these for an extend batch.
    assert fb.req_to_token_pool is not None and fb.extend_seq_lens_cpu is not None
    assert fb.extend_start_loc is not None and fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None
    table = fb.req_to_token_pool.req_to_token
    single = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n == 1]
    multi = [i for i, n in enumerate(fb.extend_seq_lens_cpu) if n > 1]
    extend = decode = decode_rows = None
    if multi:
        pick = torch.tensor(multi) if single else None
        lens = [fb.seq_lens_cpu[i] for i in multi]
        pool_rows = fb.req_pool_indices if pick is None else fb.req_pool_indices.index_select(0, pick)
        kv = table[:, :max(lens)].index_select(0, pool_rows).long()

        def sub(t: torch.Tensor) -> torch.Tensor:
            return (t if pick is None else t.index_select(0, pick)).long()

        extend = attention_kernels.ExtendTables(kv, sub(fb.extend_start_loc), sub(fb.extend_seq_lens),
                                          sub(fb.extend_prefix_lens))
    if single:
        pick = torch.tensor(single)
        decode = _decode_tables(table, fb.req_pool_indices.index_select(0, pick), fb.seq_lens.index_select(0, pick),
                                [fb.seq_lens_cpu[i] for i in single])
        decode_rows = fb.extend_start_loc.index_select(0, pick)
    return _NativeExtend(extend, decode, decode_rows)


def _shared_prefixes(rows: torch.Tensor, seq_lens: List[int]) -> List[_SharedPrefix]:
    """Groups of requests whose KV starts with the same >= MIN_SHARED_PREFIX pool slots.

    `rows` [bs, max_len] are the requests' req_to_token rows. Only the radix cache hands one slot
    to several requests, and a slot sits at one depth of one tree path: requests with the same
    slot at position MIN_SHARED_PREFIX - 1 share everything before it. Grouping by that slot (not
    the first one) keeps long shared prompts apart when they begin with a common short header.
    A group's prefix runs to where its rows first differ, and stops before its shortest member's
    newest token, which is always the request's own.
    """
    pos = MIN_SHARED_PREFIX - 1
    eligible = [i for i, n in enumerate(seq_lens) if n - 1 > pos]
    if len(eligible) < 2:
        return []
    eligible_t = torch.tensor(eligible, device=rows.device)
    keys, order = torch.sort(rows[eligible_t, pos])
    _, counts = torch.unique_consecutive(keys, return_counts=True)
    if int(counts.max()) < 2:
        return []
    groups: List[_SharedPrefix] = []
    end = 0
    for count in counts.tolist():
        start, end = end, end + count
        if count < 2:
            continue
        members = eligible_t[order[start:end]]
        limit = min(seq_lens[i] for i in members.tolist()) - 1
        block = rows.index_select(0, members)[:, :limit]
        differs = (block != block[:1]).any(0).nonzero()
        prefix_len = int(differs[0]) if differs.numel() else limit
        if prefix_len >= MIN_SHARED_PREFIX:  # always, when slots come from the radix cache
            groups.append(_SharedPrefix(members, block[0, :prefix_len].long()))
    return groups


def _cascade_tables(shared: List[_SharedPrefix], bs: int, device) -> attention_kernels.CascadeTables:
    sizes = torch.tensor([g.members.numel() for g in shared], dtype=torch.long)
    prefix_lens = torch.tensor([g.kv_indices.numel() for g in shared], dtype=torch.long)
    prefix = torch.zeros(len(shared), int(prefix_lens.max()), dtype=torch.long, device=device)
    group_of = torch.full((bs,), -1, dtype=torch.long, device=device)
    for i, g in enumerate(shared):
        prefix[i, : g.kv_indices.numel()] = g.kv_indices
        group_of[g.members] = i
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)]).to(device)
    members = torch.cat([g.members for g in shared]).long()
    return attention_kernels.CascadeTables(offsets, members, prefix, prefix_lens.to(device), group_of)


def _sdpa_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                   scale: float):
    """Attention output and its log-sum-exp (float32) per query row; q/k/v have equal head counts."""
    if q.is_cpu:
        bias = None
        if mask is not None:  # the CPU kernel takes an additive mask of the query's dtype
            bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                          scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype), v), lse


def _merge_attention(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint key sets from the attention over each."""
    lse = torch.logaddexp(lse1, lse2)
    w1 = torch.exp(lse1 - lse).unsqueeze(-1)
    w2 = torch.exp(lse2 - lse).unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)
