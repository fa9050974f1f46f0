"""The segmented GEMM of the LoRA product (SGLang's sgemm_lora_a / sgemm_lora_b in one kernel).

y[rows of segment s] (+)= x[rows of s] @ W[slot(s)]^T (* scaling[slot(s)]): one program per
(segment, block of output columns, block of rows). Segments of slot 0 (no adapter) are skipped.
Every operand is read through its strides, so the expand runs on column slices of the shrunk rows
and on row blocks of the stacked B without copies. Runs under TRITON_INTERPRET=1 on the CPU
(tests compare it with the native path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _segmented_gemm_kernel(x_ptr, w_ptr, y_ptr, seg_indptr, weight_indices, scalings,
                           K, N, stride_xm, stride_xk, stride_ws, stride_wn, stride_wk, stride_ym, stride_yn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           SCALE: tl.constexpr, ACCUMULATE: tl.constexpr):
    seg = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    slot = tl.load(weight_indices + seg)
    if slot == 0:
        return
    start = tl.load(seg_indptr + seg)
    end = tl.load(seg_indptr + seg + 1)
    rows = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if pid_m * BLOCK_M >= end - start:
        return
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < end
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    w_base = w_ptr + slot.to(tl.int64) * stride_ws
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + (k0 + ks)[:, None] * stride_wk,
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    if SCALE:
        acc *= tl.load(scalings + slot)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn
    mask = row_ok[:, None] & col_ok[None, :]
    if ACCUMULATE:
        acc += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def segmented_gemm(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, seg_indptr: torch.Tensor,
                   weight_indices: torch.Tensor, scalings: torch.Tensor, max_len: int,
                   scale: bool, accumulate: bool) -> None:
    """x: [rows, K]; w: [slots, N, K]; y: [rows, N] (written, or added to with `accumulate`);
    segment s is rows [seg_indptr[s], seg_indptr[s + 1]) with slot weight_indices[s]."""
    num_segments = weight_indices.shape[0]
    if num_segments == 0 or max_len == 0:
        return
    n, k = w.shape[1], w.shape[2]
    block_m, block_n, block_k = 16, 32, 32
    grid = (num_segments, triton.cdiv(n, block_n), triton.cdiv(max_len, block_m))
    _segmented_gemm_kernel[grid](
        x, w, y, seg_indptr, weight_indices, scalings, k, n,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0), y.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALE=scale, ACCUMULATE=accumulate)
