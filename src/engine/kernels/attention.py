"""The attention kernels (csrc/decode_attention.c, csrc/extend_attention.c) at the tensor level.

`decode_attention` reads a decode batch's K/V where they lie in the paged pool instead of gathering
them first, and a cascade group's shared prefix once for the whole group; `extend_attention` does the
same for bf16 prefills. The torch_native attention backend (engine/layers/attention) calls them where
`supports()` / `extend_supported()` hold and keeps its pure-torch path otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from engine.kernels import library
from engine.kernels.boundary import AttentionKernels, DecodeAttentionArgs, ExtendAttentionArgs

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# The pool's element types the decode kernel reads (decode_attention_args_t.kv_dtype): q's, or fp8.
_KV_DTYPES = {**_DTYPES, torch.float8_e5m2: 2, torch.float8_e4m3fn: 3}
_FP8 = (torch.float8_e5m2, torch.float8_e4m3fn)


def _kernels() -> AttentionKernels:
    lib = library.attention()
    assert lib is not None, "the attention kernels are not loaded: check supports() / extend_supported() first"
    return lib


def supports(q: torch.Tensor, k_buf: torch.Tensor) -> bool:
    """Whether decode_attention takes these: float32 / bf16 q over a pool of q's dtype or of fp8."""
    return (q.is_cpu and q.dtype in _DTYPES and (k_buf.dtype == q.dtype or k_buf.dtype in _FP8)
            and library.attention() is not None)


@dataclass
class CascadeTables:
    """Groups of decoding requests that share a KV prefix, in the kernel's layout (int64 tensors)."""

    group_offsets: torch.Tensor  # [G + 1]: group g's members are members[offsets[g]:offsets[g + 1]]
    members: torch.Tensor  # rows of the batch
    prefix_indices: torch.Tensor  # [G, max_prefix] pool slots, the first prefix_lens[g] of row g used
    prefix_lens: torch.Tensor  # [G]
    group_of: torch.Tensor  # [bs] the request's group, -1 for none
    # Kept prefix panels (PrefixPanels): [num_layers, G] addresses of each layer's block of a group's
    # kept panels (0: none) and [G] the token of their fill; None: every prefix packed afresh.
    kept: Optional[torch.Tensor] = None
    kept_tokens: Optional[torch.Tensor] = None
    kept_buffers: Tuple[torch.Tensor, ...] = ()  # what `kept` points into, alive while these tables are


@dataclass
class RowTables:
    """Where each query row of decode_attention reads its slots: row `row_of[b]` of kv_indices from entry
    `starts[b]` on (int64 [bs] each), so that one request's new tokens share its table row."""

    row_of: torch.Tensor
    starts: torch.Tensor


@dataclass
class ExtendTables:
    """An extend batch in the prefill kernel's layout (int64 CPU tensors)."""

    kv_indices: torch.Tensor  # [bs, max_seq] each request's slots, prefix then new tokens
    q_starts: torch.Tensor  # [bs] the request's first row in q
    ext_lens: torch.Tensor  # [bs]
    prefix_lens: torch.Tensor  # [bs]


def extend_supported() -> bool:
    lib = library.attention()
    return lib is not None and bool(lib.extend_attention_available())


def extend_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, tables: ExtendTables,
                     num_heads: int, kv_heads: int, head_dim: int, scale: float) -> torch.Tensor:
    """Causal attention of every new token over its request's prefix and new tokens, all read from
    the pool (the new K/V are stored first). q [T, num_heads * head_dim] bf16, rows may be strided."""
    out = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype)
    assert q.stride(1) == 1 and k_buf.stride()[1:] == (head_dim, 1) and v_buf.stride()[1:] == (head_dim, 1)
    _kernels().extend_attention(ExtendAttentionArgs(
        q=q.data_ptr(), q_stride=q.stride(0), k=k_buf.data_ptr(), v=v_buf.data_ptr(), k_stride=k_buf.stride(0),
        v_stride=v_buf.stride(0), kv_indices=tables.kv_indices.data_ptr(), max_seq=tables.kv_indices.shape[1],
        q_starts=tables.q_starts.data_ptr(), ext_lens=tables.ext_lens.data_ptr(),
        prefix_lens=tables.prefix_lens.data_ptr(), bs=tables.ext_lens.numel(), heads=num_heads, kv_heads=kv_heads,
        dim=head_dim, scale=scale, out=out.data_ptr(), out_stride=out.stride(0), num_threads=torch.get_num_threads()))
    return out


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, kv_indices: torch.Tensor,
                     lens: torch.Tensor, num_heads: int, kv_heads: int, head_dim: int, scale: float,
                     cascade: Optional[CascadeTables] = None, layer_id: int = 0,
                     kv_scales: Tuple[float, float] = (1.0, 1.0), logit_cap: float = 0.0,
                     sinks: Optional[torch.Tensor] = None, rows: Optional[RowTables] = None) -> torch.Tensor:
    """Attention of one query token per request over pool slots `kv_indices[b, :lens[b]]`, preceded,
    for the members of a cascade group, by the group's shared prefix slots (read once per group;
    `layer_id` picks the layer's row of the cascade's kept panels). An fp8 pool's elements are read as
    kv_scales[0] * stored (K) and kv_scales[1] * stored (V). logit_cap > 0: scores become
    cap * tanh(score / cap) (Gemma 2); sinks [num_heads]: a logit per query head in the softmax's
    denominator only (gpt-oss). rows: query row b reads `kv_indices[rows.row_of[b], rows.starts[b]:][:lens[b]]`
    instead of its own table row (the new tokens of one request share its row, each its own window).

    q [bs, num_heads * head_dim]; k_buf, v_buf [num_slots, kv_heads, head_dim]; kv_indices
    [rows, max_len] int64; lens [bs] int64. Returns the output shaped like q.
    """
    lib = _kernels()
    q = q.contiguous()
    kv_indices = kv_indices.contiguous()
    lens = lens.to(torch.int64).contiguous()
    out = torch.empty_like(q)
    # Within a slot the kernel reads kv_heads * head_dim consecutive elements.
    assert k_buf.stride()[1:] == (head_dim, 1) and v_buf.stride()[1:] == (head_dim, 1)
    args = DecodeAttentionArgs(
        q=q.data_ptr(), k=k_buf.data_ptr(), v=v_buf.data_ptr(), kv_indices=kv_indices.data_ptr(),
        lens=lens.data_ptr(), max_len=kv_indices.shape[1], bs=q.shape[0], heads=num_heads, kv_heads=kv_heads,
        dim=head_dim, k_stride=k_buf.stride(0), v_stride=v_buf.stride(0), scale=scale, dtype=_DTYPES[q.dtype],
        kv_dtype=_KV_DTYPES[k_buf.dtype], k_scale=kv_scales[0], v_scale=kv_scales[1],
        out=out.data_ptr(), num_threads=torch.get_num_threads(),  # the cascade's fields: 0 / NULL, none
        logit_cap=logit_cap)
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).contiguous()
        assert sinks.numel() == num_heads
        args.sinks = sinks.data_ptr()
    if rows is not None:
        assert rows.row_of.numel() == q.shape[0] and rows.starts.numel() == q.shape[0]
        args.row_of, args.starts = rows.row_of.data_ptr(), rows.starts.data_ptr()
    else:
        assert kv_indices.shape[0] == q.shape[0]
    if cascade is not None and cascade.prefix_lens.numel():
        args.num_groups, args.max_prefix = cascade.prefix_lens.numel(), cascade.prefix_indices.shape[1]
        args.group_offsets, args.group_members = cascade.group_offsets.data_ptr(), cascade.members.data_ptr()
        args.prefix_indices, args.prefix_lens = cascade.prefix_indices.data_ptr(), cascade.prefix_lens.data_ptr()
        args.group_of = cascade.group_of.data_ptr()
        if cascade.kept is not None and cascade.kept_tokens is not None:
            args.kept, args.kept_tokens = cascade.kept[layer_id].data_ptr(), cascade.kept_tokens.data_ptr()
    lib.decode_attention(args)
    return out
