"""Decode attention over the paged KV pool, split-K (flash-decoding) in two Triton kernels.

One decode token per request attends to all `seq_len` keys of its request, read through
`req_to_token[req_pool_index, position]`. A single program per (request, head) would leave most
of the GPU idle at small batch sizes and long contexts, so stage 1 also splits each request's keys
into up to `max_kv_splits` contiguous chunks, one program each, writing a partial (normalised)
output and its log-sum-exp. Stage 2 merges the chunks of one (request, head) with the usual
rescaling by exp(lse - max_lse).

GQA: a stage-1 program serves up to BLOCK_H query heads that share one KV head, so each K/V tile
is loaded once for the whole group and the scores come from one `tl.dot` of [heads, D] x [D, N].

Windowed layers (HAS_WINDOW): a request's keys are its last `sliding_window` positions only (the query
sees (p - window, p]), and the splits divide that range, so a step's cost does not grow with the
context. HAS_CAP soft-caps the scores (cap * tanh(s / cap)); HAS_SINKS adds each head's sink logit to
the softmax's denominator when stage 2 merges the chunks.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

# tl.dot needs every dimension to be at least 16, so the head tile is padded to 16 rows.
_BLOCK_H = 16
# Below this many keys per chunk, more chunks cost more in stage 2 than they save in stage 1.
MIN_KEYS_PER_SPLIT = 64


def dot_precision(dtype: torch.dtype) -> Optional[str]:
    """float32 inputs get exact fp32 dots (TF32 would cost ~1e-3 relative error); other dtypes
    keep the backend's default (None)."""
    return "ieee" if dtype == torch.float32 else None


def upcast_dot(device: torch.device) -> bool:
    """CPU tensors only ever run under TRITON_INTERPRET=1, whose tl.dot gives garbage for 16-bit
    floats (triton 3.x); there the operands are widened to float32, which is exact for products of
    bf16/fp16 values accumulated in float32, i.e. the same numbers the GPU computes."""
    return device.type == "cpu"


@triton.jit
def mma(a, b, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with a float32 result, see upcast_dot for UPCAST."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=DOT_PRECISION).to(tl.float32)
    return out


@triton.jit
def soft_cap(x, cap):
    """cap * tanh(x / cap), tanh written with the sigmoid (tl has no tanh on every backend)."""
    return cap * (2.0 * tl.sigmoid(2.0 * x / cap) - 1.0)


@triton.jit
def kv_range(seq_len, sliding_window, HAS_WINDOW: tl.constexpr):
    """(first key position, number of keys) a decode query at position seq_len - 1 sees."""
    if HAS_WINDOW:
        kv_start = tl.maximum(seq_len - sliding_window, 0)
    else:
        kv_start = seq_len * 0
    return kv_start, seq_len - kv_start


@triton.jit
def _decode_stage1_kernel(
    Q,
    K_Buffer,
    V_Buffer,
    sm_scale,
    v_scale,
    sliding_window,
    logit_cap,
    Slot_map,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Num_kv_splits,
    Mid_O,
    Mid_Lse,
    stride_req_to_token,
    stride_q_token,
    stride_q_head,
    stride_k_slot,
    stride_k_head,
    stride_v_slot,
    stride_v_head,
    stride_mid_o_req,
    stride_mid_o_head,
    stride_mid_o_split,
    stride_mid_lse_req,
    stride_mid_lse_head,
    kv_group_num: tl.constexpr,
    q_head_num: tl.constexpr,
    head_dim: tl.constexpr,
    v_head_dim: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_SLOT_MAP: tl.constexpr,
):
    cur_req = tl.program_id(0)
    head_block = tl.program_id(1)
    split_id = tl.program_id(2)

    # When a KV head has more query heads than BLOCK_H, several programs share that KV head.
    VALID_BLOCK_H: tl.constexpr = BLOCK_H if kv_group_num > BLOCK_H else kv_group_num
    cur_kv_head = head_block // tl.cdiv(kv_group_num, BLOCK_H)
    offs_h = head_block * VALID_BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = (tl.arange(0, BLOCK_H) < VALID_BLOCK_H) & (offs_h < q_head_num)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_d = offs_d < head_dim
    mask_dv = offs_dv < v_head_dim

    seq_len = tl.load(Seq_lens + cur_req)
    num_splits = tl.load(Num_kv_splits + cur_req)
    pool_row = tl.load(Req_pool_indices + cur_req)
    kv_start, kv_len = kv_range(seq_len, sliding_window, HAS_WINDOW)
    split_len = tl.cdiv(kv_len, num_splits)
    split_start = kv_start + split_len * split_id
    split_end = tl.minimum(split_start + split_len, seq_len)

    if split_end > split_start:
        q_ptrs = Q + cur_req * stride_q_token + offs_h[:, None] * stride_q_head + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)

        e_max = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
        e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)

        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            kv_loc = tl.load(Req_to_token + pool_row * stride_req_to_token + offs_n, mask=mask_n, other=0).to(tl.int64)
            if HAS_SLOT_MAP:  # the layer keeps its K/V in the hybrid pool's windowed buffers
                kv_loc = tl.load(Slot_map + kv_loc, mask=mask_n, other=0)

            k_ptrs = K_Buffer + kv_loc[None, :] * stride_k_slot + cur_kv_head * stride_k_head + offs_d[:, None]
            k = tl.load(k_ptrs, mask=mask_n[None, :] & mask_d[:, None], other=0.0)  # [D, N]
            qk = mma(q, k.to(q.dtype), DOT_PRECISION, UPCAST_DOT) * sm_scale  # [H, N]
            if HAS_CAP:
                qk = soft_cap(qk, logit_cap)
            # Mask keys only: padded head rows see finite zeros, so they never turn into NaN.
            qk = tl.where(mask_n[None, :], qk, float("-inf"))

            v_ptrs = V_Buffer + kv_loc[:, None] * stride_v_slot + cur_kv_head * stride_v_head + offs_dv[None, :]
            v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_dv[None, :], other=0.0).to(q.dtype)  # [N, DV]

            new_max = tl.maximum(tl.max(qk, 1), e_max)
            rescale = tl.exp(e_max - new_max)
            p = tl.exp(qk - new_max[:, None])
            acc = acc * rescale[:, None] + mma(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
            e_sum = e_sum * rescale + tl.sum(p, 1)
            e_max = new_max

        o_ptrs = (
            Mid_O
            + cur_req * stride_mid_o_req
            + offs_h[:, None] * stride_mid_o_head
            + split_id * stride_mid_o_split
            + offs_dv[None, :]
        )
        # v_scale: an fp8 pool's V are v_scale * stored (1.0 otherwise); sm_scale holds its k_scale.
        tl.store(o_ptrs, acc / e_sum[:, None] * v_scale, mask=mask_h[:, None] & mask_dv[None, :])
        lse_ptrs = Mid_Lse + cur_req * stride_mid_lse_req + offs_h * stride_mid_lse_head + split_id
        tl.store(lse_ptrs, e_max + tl.log(e_sum), mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    Mid_O,
    Mid_Lse,
    O,
    Seq_lens,
    Num_kv_splits,
    stride_mid_o_req,
    stride_mid_o_head,
    stride_mid_o_split,
    stride_mid_lse_req,
    stride_mid_lse_head,
    stride_o_token,
    stride_o_head,
    sliding_window,
    Sinks,
    v_head_dim: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    cur_req = tl.program_id(0)
    cur_head = tl.program_id(1)

    seq_len = tl.load(Seq_lens + cur_req)
    num_splits = tl.load(Num_kv_splits + cur_req)
    # Split offsets relative to the first key, as stage 1 drew them.
    _, kv_len = kv_range(seq_len, sliding_window, HAS_WINDOW)
    split_len = tl.cdiv(kv_len, num_splits)

    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < v_head_dim

    e_max = -float("inf")
    e_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    o_base = Mid_O + cur_req * stride_mid_o_req + cur_head * stride_mid_o_head
    lse_base = Mid_Lse + cur_req * stride_mid_lse_req + cur_head * stride_mid_lse_head

    for split_id in range(0, MAX_KV_SPLITS):
        split_start = split_len * split_id
        split_end = tl.minimum(split_start + split_len, kv_len)
        # Chunks past the end (num_splits does not always divide seq_len evenly) were never written.
        if split_end > split_start:
            part = tl.load(o_base + split_id * stride_mid_o_split + offs_dv, mask=mask_dv, other=0.0)
            lse = tl.load(lse_base + split_id)
            new_max = tl.maximum(lse, e_max)
            old_scale = tl.exp(e_max - new_max)
            weight = tl.exp(lse - new_max)
            acc = acc * old_scale + weight * part
            e_sum = e_sum * old_scale + weight
            e_max = new_max

    if HAS_SINKS:
        # The sink takes its share of the probability mass and contributes no value.
        e_sum = e_sum + tl.exp(tl.load(Sinks + cur_head).to(tl.float32) - e_max)
    tl.store(
        O + cur_req * stride_o_token + cur_head * stride_o_head + offs_dv,
        (acc / e_sum).to(O.dtype.element_ty),
        mask=mask_dv,
    )


def compute_num_kv_splits(seq_lens: torch.Tensor, max_kv_splits: int) -> torch.Tensor:
    """Chunks per request: enough that each holds >= MIN_KEYS_PER_SPLIT keys, at most max_kv_splits."""
    splits = (seq_lens + MIN_KEYS_PER_SPLIT - 1) // MIN_KEYS_PER_SPLIT
    return splits.clamp(min=1, max=max_kv_splits).to(torch.int32)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    block_n: int = 64,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    slot_map: Optional[torch.Tensor] = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write into `o` the attention of one query token per request over its paged keys (its last
    `sliding_window` ones with a window > 0; scores soft-capped with logit_cap > 0; sinks [q_heads];
    slot_map: int64 [full slots], the buffers' slot of each req_to_token slot, as the hybrid pool's;
    k_scale / v_scale: an fp8 pool's elements are read as k_scale * stored, v_scale * stored).

    q, o: [bs, q_heads, head_dim] / [bs, q_heads, v_head_dim]; k_buffer, v_buffer: [slots, kv_heads, D];
    req_to_token: [rows, context_len]; req_pool_indices, seq_lens, num_kv_splits: [bs];
    mid_o: [bs, q_heads, max_kv_splits, v_head_dim] float32 and mid_lse: [bs, q_heads, max_kv_splits]
    float32 are scratch, sized by max_kv_splits (each request uses its own num_kv_splits of them).
    """
    bs, q_head_num, head_dim = q.shape
    kv_head_num = k_buffer.shape[1]
    v_head_dim = v_buffer.shape[-1]
    if q_head_num % kv_head_num != 0:
        raise ValueError(f"query heads ({q_head_num}) must be a multiple of KV heads ({kv_head_num})")
    kv_group_num = q_head_num // kv_head_num
    max_kv_splits = mid_o.shape[2]
    if bs == 0:
        return
    for name, t in (("q", q), ("k_buffer", k_buffer), ("v_buffer", v_buffer), ("o", o), ("mid_o", mid_o), ("mid_lse", mid_lse)):
        if t.stride(-1) != 1:
            raise ValueError(f"decode_attention_fwd needs {name} contiguous in its last dim")

    block_d = max(16, triton.next_power_of_2(head_dim))
    block_dv = max(16, triton.next_power_of_2(v_head_dim))
    heads_per_program = min(_BLOCK_H, kv_group_num)
    grid = (bs, triton.cdiv(q_head_num, heads_per_program), max_kv_splits)
    _decode_stage1_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        sm_scale * k_scale,
        v_scale,
        sliding_window,
        logit_cap,
        slot_map if slot_map is not None else seq_lens,  # any pointer: never read without HAS_SLOT_MAP
        req_to_token,
        req_pool_indices,
        seq_lens,
        num_kv_splits,
        mid_o,
        mid_lse,
        req_to_token.stride(0),
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        kv_group_num=kv_group_num,
        q_head_num=q_head_num,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        BLOCK_N=block_n,
        BLOCK_H=_BLOCK_H,
        DOT_PRECISION=dot_precision(q.dtype),
        UPCAST_DOT=upcast_dot(q.device),
        HAS_WINDOW=sliding_window > 0,
        HAS_CAP=logit_cap > 0,
        HAS_SLOT_MAP=slot_map is not None,
    )
    _decode_stage2_kernel[(bs, q_head_num)](
        mid_o,
        mid_lse,
        o,
        seq_lens,
        num_kv_splits,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        sliding_window,
        sinks if sinks is not None else mid_lse,  # any pointer: never read without HAS_SINKS
        v_head_dim=v_head_dim,
        MAX_KV_SPLITS=max_kv_splits,
        BLOCK_DV=block_dv,
        HAS_WINDOW=sliding_window > 0,
        HAS_SINKS=sinks is not None,
    )
