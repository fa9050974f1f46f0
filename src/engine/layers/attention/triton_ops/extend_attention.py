"""Extend (prefill) attention: new tokens against their cached prefix plus, causally, each other.

A program owns one request, one query head and BLOCK_M of that request's new tokens. It runs one
online softmax over two key ranges:
  1. the prefix (positions 0 .. prefix_len - 1), read from the paged pool through
     `req_to_token[req_pool_index, position]`: every new token sees all of it;
  2. the new tokens themselves, read from the contiguous k/v of this forward (so the kernel does
     not depend on them having been written to the pool), under the causal mask (or, for an
     encoder, IS_CAUSAL False, all of them).
Page size never appears: a page only constrains which slots req_to_token holds.

Windowed layers (HAS_WINDOW): a query at position p sees the keys at (p - window, p] only; both loops
start at the first key the block's first query can see. A row may then meet blocks in which it sees
nothing (its running max still -inf): the exponentials are taken against a max of 0 there, so such a
block adds nothing instead of NaN. HAS_CAP soft-caps the scores; HAS_SINKS adds the head's sink logit to
the denominator. HAS_TREE_MASK (tree drafts of speculative decoding): the request's last Tree_widths keys
(its new tokens, and for a draft's tree steps the nodes it wrote before) are seen only where its
[extend, width] block of Tree_mask says so (a node sees its ancestors and itself, never a later
row, so the causal bound on the new keys still holds); the keys before them stay visible. A tree row's
position is its node's (the request's length before the tree plus its depth), not its index in the extend,
so with a window as well (Tree_positions, each row's position) the keys before the tree are windowed by
that position and the tree's own keys by the mask alone: a node's ancestors lie within its window, as the
speculator refuses trees deeper than a window.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from engine.layers.attention.triton_ops.decode_attention import dot_precision, mma, soft_cap, upcast_dot


@triton.jit
def _extend_kernel(
    Q,
    K_Extend,
    V_Extend,
    O,
    K_Buffer,
    V_Buffer,
    Req_to_token,
    Req_pool_indices,
    Extend_start_loc,
    Extend_seq_lens,
    Prefix_lens,
    sm_scale,
    k_scale,
    v_scale,
    sliding_window,
    logit_cap,
    Sinks,
    Slot_map,
    Tree_mask,
    Tree_mask_starts,
    Tree_widths,
    Tree_positions,
    stride_req_to_token,
    stride_q_token,
    stride_q_head,
    stride_ke_token,
    stride_ke_head,
    stride_ve_token,
    stride_ve_head,
    stride_o_token,
    stride_o_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    kv_group_num: tl.constexpr,
    head_dim: tl.constexpr,
    v_head_dim: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_SLOT_MAP: tl.constexpr,
    HAS_TREE_MASK: tl.constexpr,
):
    cur_req = tl.program_id(0)
    cur_head = tl.program_id(1)
    block_m = tl.program_id(2)
    cur_kv_head = cur_head // kv_group_num

    extend_len = tl.load(Extend_seq_lens + cur_req)
    if block_m * BLOCK_M < extend_len:
        q_start = tl.load(Extend_start_loc + cur_req)
        prefix_len = tl.load(Prefix_lens + cur_req)
        pool_row = tl.load(Req_pool_indices + cur_req)

        offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # index among this request's new tokens
        mask_m = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_d = offs_d < head_dim
        mask_dv = offs_dv < v_head_dim
        offs_n0 = tl.arange(0, BLOCK_N)

        q_ptrs = Q + (q_start + offs_m[:, None]) * stride_q_token + cur_head * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)

        if HAS_TREE_MASK:
            mask_start = tl.load(Tree_mask_starts + cur_req)
            tree_width = tl.load(Tree_widths + cur_req)
            tree_lo = prefix_len + extend_len - tree_width  # the first key the mask covers
        e_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        e_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # 1. The cached prefix: no mask beyond its length (but a tree mask's). Rows that see no key of
        #    a block (windows, tree masks) are handled by the max of 0 below.
        if HAS_WINDOW and HAS_TREE_MASK:
            # Rows past the extend read a huge position: they never lower the block's first key.
            row_pos = tl.load(Tree_positions + q_start + offs_m, mask=mask_m, other=1 << 40)
            first_key = tl.min(row_pos, 0) - sliding_window + 1
            # The covered keys (a draft's earlier nodes) are all read: the mask, not the window, picks.
            prefix_lo = tl.maximum(tl.minimum(first_key, tree_lo), 0)
            extend_lo = prefix_len * 0
        elif HAS_WINDOW:
            prefix_lo = tl.maximum(prefix_len + block_m * BLOCK_M - sliding_window + 1, 0)
            extend_lo = tl.maximum(block_m * BLOCK_M - sliding_window + 1, 0)
        else:
            prefix_lo = prefix_len * 0
            extend_lo = prefix_len * 0
        for start_n in range(prefix_lo, prefix_len, BLOCK_N):
            offs_n = start_n + offs_n0
            mask_n = offs_n < prefix_len
            kv_loc = tl.load(Req_to_token + pool_row * stride_req_to_token + offs_n, mask=mask_n, other=0).to(tl.int64)
            if HAS_SLOT_MAP:  # the layer keeps its K/V in the hybrid pool's windowed buffers
                kv_loc = tl.load(Slot_map + kv_loc, mask=mask_n, other=0)
            k = tl.load(
                K_Buffer + kv_loc[None, :] * stride_k_slot + cur_kv_head * stride_k_head + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            # An fp8 pool's K/V are k_scale * stored, v_scale * stored (scale 1.0 otherwise).
            qk = mma(q, k.to(q.dtype), DOT_PRECISION, UPCAST_DOT) * (sm_scale * k_scale)
            if HAS_CAP:
                qk = soft_cap(qk, logit_cap)
            visible = mask_n[None, :]
            if HAS_WINDOW and HAS_TREE_MASK:
                before_tree = offs_n < tree_lo
                visible = visible & ((~before_tree[None, :]) | (offs_n[None, :] > row_pos[:, None] - sliding_window))
            elif HAS_WINDOW:
                visible = visible & (offs_n[None, :] > prefix_len + offs_m[:, None] - sliding_window)
            if HAS_TREE_MASK:
                col = offs_n - tree_lo
                in_tree = col >= 0
                tree = tl.load(Tree_mask + mask_start + offs_m[:, None] * tree_width + col[None, :],
                               mask=mask_m[:, None] & mask_n[None, :] & in_tree[None, :], other=0)
                visible = visible & ((~in_tree[None, :]) | (tree != 0))
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V_Buffer + kv_loc[:, None] * stride_v_slot + cur_kv_head * stride_v_head + offs_dv[None, :],
                mask=mask_n[:, None] & mask_dv[None, :],
                other=0.0,
            )
            new_max = tl.maximum(tl.max(qk, 1), e_max)
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(e_max - safe_max)
            p = tl.exp(qk - safe_max[:, None])
            acc = acc * rescale[:, None] + mma(p.to(q.dtype), v.to(q.dtype), DOT_PRECISION, UPCAST_DOT) * v_scale
            e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = new_max

        # 2. The new tokens, causally: keys past this block's last query are never needed.
        if IS_CAUSAL:
            end_n = tl.minimum((block_m + 1) * BLOCK_M, extend_len)
        else:
            end_n = extend_len
        for start_n in range(extend_lo, end_n, BLOCK_N):
            offs_n = start_n + offs_n0
            mask_n = offs_n < end_n
            k = tl.load(
                K_Extend + (q_start + offs_n[None, :]) * stride_ke_token + cur_kv_head * stride_ke_head + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            qk = mma(q, k.to(q.dtype), DOT_PRECISION, UPCAST_DOT) * sm_scale
            if HAS_CAP:
                qk = soft_cap(qk, logit_cap)
            if IS_CAUSAL:
                visible = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
            else:
                visible = (offs_m[:, None] >= 0) & mask_n[None, :]
            if HAS_WINDOW and not HAS_TREE_MASK:  # every new key of a tree is under its mask
                visible = visible & (offs_n[None, :] > offs_m[:, None] - sliding_window)
            if HAS_TREE_MASK:
                col = prefix_len - tree_lo + offs_n
                tree = tl.load(Tree_mask + mask_start + offs_m[:, None] * tree_width + col[None, :],
                               mask=mask_m[:, None] & mask_n[None, :], other=0)
                visible = visible & (tree != 0)
            qk = tl.where(visible, qk, float("-inf"))
            v = tl.load(
                V_Extend + (q_start + offs_n[:, None]) * stride_ve_token + cur_kv_head * stride_ve_head + offs_dv[None, :],
                mask=mask_n[:, None] & mask_dv[None, :],
                other=0.0,
            )
            # Key 0 is visible to every row, so after the first block no row's max is -inf and
            # a fully masked later block only rescales by exp(0) = 1.
            new_max = tl.maximum(tl.max(qk, 1), e_max)
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            rescale = tl.exp(e_max - safe_max)
            p = tl.exp(qk - safe_max[:, None])
            acc = acc * rescale[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
            e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = new_max

        if HAS_SINKS:
            e_sum = e_sum + tl.exp(tl.load(Sinks + cur_head).to(tl.float32) - e_max)
        o_ptrs = O + (q_start + offs_m[:, None]) * stride_o_token + cur_head * stride_o_head + offs_dv[None, :]
        tl.store(o_ptrs, (acc / e_sum[:, None]).to(O.dtype.element_ty), mask=mask_m[:, None] & mask_dv[None, :])


def extend_attention_fwd(
    q: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    prefix_lens: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    block_m: int = 64,
    block_n: int = 64,
    is_causal: bool = True,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    slot_map: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    tree_mask: Optional[torch.Tensor] = None,
    tree_mask_starts: Optional[torch.Tensor] = None,
    tree_widths: Optional[torch.Tensor] = None,
    tree_positions: Optional[torch.Tensor] = None,
) -> None:
    """Write into `o` the attention of every new token (prefix keys from the pool, new keys causal,
    or all new keys with is_causal False; with sliding_window > 0 only the keys at (p - window, p];
    scores soft-capped with logit_cap > 0; sinks [q_heads] join each softmax's denominator; slot_map: the
    buffers' slot of each req_to_token slot, int64, for the prefix reads: the hybrid pool's windowed layers;
    k_scale / v_scale: an fp8 pool's elements are read as k_scale * stored, v_scale * stored;
    tree_mask / tree_mask_starts / tree_widths: speculative tree drafts, each request's [extend, width]
    block of which new token sees which of its last `width` keys, flat, where each block starts, and
    each width; tree_positions [num_tokens]: each new token's position, needed with a window, which
    bounds a tree node's keys by its position rather than its index in the extend).

    q, o: [num_tokens, q_heads, D] / [num_tokens, q_heads, DV]; k_extend, v_extend: [num_tokens,
    kv_heads, D]; k_buffer, v_buffer: [slots, kv_heads, D]; the per-request tensors are [bs], and
    request i owns rows extend_start_loc[i] .. + extend_seq_lens[i] of q/k_extend/v_extend/o.
    """
    bs = req_pool_indices.shape[0]
    q_head_num, head_dim = q.shape[1], q.shape[2]
    kv_head_num = k_extend.shape[1]
    v_head_dim = v_extend.shape[-1]
    if q_head_num % kv_head_num != 0:
        raise ValueError(f"query heads ({q_head_num}) must be a multiple of KV heads ({kv_head_num})")
    if bs == 0 or max_extend_len == 0:
        return
    for name, t in (("q", q), ("k_extend", k_extend), ("v_extend", v_extend), ("o", o), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"extend_attention_fwd needs {name} contiguous in its last dim")

    if tree_mask is not None and sliding_window > 0 and tree_positions is None:
        raise ValueError("a windowed layer's tree rows need tree_positions (a node's position is not its index)")
    grid = (bs, q_head_num, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_extend,
        v_extend,
        o,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        extend_start_loc,
        extend_seq_lens,
        prefix_lens,
        sm_scale,
        k_scale,
        v_scale,
        sliding_window,
        logit_cap,
        sinks if sinks is not None else q,  # any pointer: never read without HAS_SINKS
        slot_map if slot_map is not None else q,  # nor this one without HAS_SLOT_MAP
        tree_mask if tree_mask is not None else q,  # nor these without HAS_TREE_MASK
        tree_mask_starts if tree_mask_starts is not None else q,
        tree_widths if tree_widths is not None else q,
        tree_positions if tree_positions is not None else q,
        req_to_token.stride(0),
        q.stride(0),
        q.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        o.stride(0),
        o.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        kv_group_num=q_head_num // kv_head_num,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.device),
        IS_CAUSAL=is_causal,
        HAS_WINDOW=sliding_window > 0,
        HAS_CAP=logit_cap > 0,
        HAS_SINKS=sinks is not None,
        HAS_SLOT_MAP=slot_map is not None,
        HAS_TREE_MASK=tree_mask is not None,
    )

