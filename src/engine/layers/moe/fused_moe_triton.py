"""The experts' forward on the GPU: SGLang's fused_moe_triton design, our own code.

`moe_align_block_size` sorts the (token, slot) pairs of the top-k by expert and pads each expert's run
to a multiple of BLOCK_M, so that every block of BLOCK_M sorted rows belongs to one expert. One
grouped-GEMM kernel (`_fused_moe_kernel`) then multiplies each block's gathered rows by its expert's
weight (plus the expert's bias, where the model has biases); it runs twice: gate_up ([T * k, 2I] from the
hidden states) and, after the activation (SiLU-and-mul, or the model's own: gpt-oss's ClampedSwiGLU), down
([T * k, H], each row scaled by its routing weight). The k rows of a token are summed at the end.

Everything stays on the device (no host synchronisation): the sorted list has its worst-case length
(T * k + E * (BLOCK_M - 1)) and blocks past the padded total return at once, so a decode step can be
captured in a CUDA graph. Slots whose expert lives on another EP rank (id -1) are left out of the
sort; their rows stay zero.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import triton
import triton.language as tl

from engine.layers.attention.triton_ops.decode_attention import dot_precision, mma, upcast_dot
from engine.layers.moe.fused_moe_native import Activation


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) for topk_ids [T, k] (local ids, -1 elsewhere).

    sorted_token_ids [T*k + E*(block_m-1)]: indices into the flattened top-k, grouped by expert, each
    group padded to a multiple of block_m with T*k (an index no row has); expert_ids: the expert of
    each block of block_m entries (-1 past the end); num_tokens_post_padded [1]: the padded total.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    device = flat.device
    valid = flat >= 0
    keyed = torch.where(valid, flat, torch.full_like(flat, num_experts))  # the slots elsewhere sort last
    # scatter_add, not bincount: bincount reads the largest id back to the host (no graph capture).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device).scatter_add_(
        0, keyed, torch.ones_like(keyed))[:num_experts]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(counts, 0) - counts  # each expert's first index in the unpadded sort
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    order = torch.argsort(keyed, stable=True)
    sorted_experts = keyed[order]
    in_sort = sorted_experts < num_experts
    expert_of = sorted_experts.clamp(max=num_experts - 1)
    position = padded_starts[expert_of] + torch.arange(numel, device=device) - starts[expert_of]
    max_len = numel + num_experts * (block_m - 1)
    sorted_token_ids = torch.full((max_len + 1,), numel, dtype=torch.int32, device=device)
    # Slots of other ranks are written to the spare last entry, then dropped.
    sorted_token_ids[torch.where(in_sort, position, torch.full_like(position, max_len))] = order.to(torch.int32)
    sorted_token_ids = sorted_token_ids[:max_len]
    num_blocks = (max_len + block_m - 1) // block_m
    block_starts = torch.arange(num_blocks, device=device) * block_m
    expert_ids = torch.searchsorted(padded_ends, block_starts, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, torch.full_like(expert_ids, -1)).to(torch.int32)
    num_tokens_post_padded = padded_ends[-1:].to(torch.int32)
    return sorted_token_ids, expert_ids, num_tokens_post_padded


@triton.jit
def _fused_moe_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, topk_weights_ptr, sorted_token_ids_ptr, expert_ids_ptr,
    num_tokens_post_padded_ptr, N, K, num_valid_tokens,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bias_e,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TOP_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    """C[row] = (A[row // TOP_K] @ B[expert]^T + bias[expert]) (times the row's routing weight) for the
    BLOCK_M sorted rows of program m and the BLOCK_N output columns of program n."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_post_padded = tl.load(num_tokens_post_padded_ptr)
    if pid_m * BLOCK_M >= num_post_padded:
        return
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_row = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_token_ids_ptr + offs_row).to(tl.int64)
    row_mask = rows < num_valid_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // TOP_K)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k0 * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += mma(a, b, DOT_PRECISION, UPCAST_DOT)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:  # before the routing weight: the weight scales the expert's whole output
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def default_config(num_tokens: int) -> Dict[str, int]:
    """Tile sizes: small row blocks for decode-sized batches (few rows per expert)."""
    if num_tokens <= 32:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                  topk_weights: torch.Tensor, aligned: Tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int,
                  mul_routed_weight: bool, config: Dict[str, int]) -> None:
    sorted_token_ids, expert_ids, num_post_padded = aligned
    n, k = b.shape[1], b.shape[2]
    if bias is not None and (bias.shape != (b.shape[0], n) or bias.stride(1) != 1):
        raise ValueError(f"expert biases {tuple(bias.shape)} (unit stride) expected for weights {tuple(b.shape)}")
    grid = (expert_ids.shape[0], triton.cdiv(n, config["BLOCK_N"]))
    _fused_moe_kernel[grid](
        a, b, c, c if bias is None else bias, topk_weights, sorted_token_ids, expert_ids, num_post_padded,
        n, k, c.shape[0],
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        0 if bias is None else bias.stride(0),
        BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"], TOP_K=top_k,
        MUL_ROUTED_WEIGHT=mul_routed_weight, HAS_BIAS=bias is not None, DOT_PRECISION=dot_precision(a.dtype),
        UPCAST_DOT=upcast_dot(a.device),
    )


def fused_moe_triton(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, config: Dict[str, int] | None = None,
                     w13_bias: Optional[torch.Tensor] = None, w2_bias: Optional[torch.Tensor] = None,
                     activation: Optional[Activation] = None) -> torch.Tensor:
    """What fused_moe_native computes (same arguments), with the two grouped GEMMs in Triton; the
    activation runs in torch between them, in float32."""
    num_tokens, top_k = topk_ids.shape
    hidden = w2.shape[1]
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    config = config or default_config(num_tokens)
    aligned = moe_align_block_size(topk_ids, w13.shape[0], config["BLOCK_M"])
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    x = hidden_states.contiguous()
    gate_up = torch.empty(num_tokens * top_k, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, w13_bias, weights, aligned, top_k, False, config)
    if activation is not None:
        activated = activation(gate_up.float()).to(x.dtype)
    else:
        inter = w13.shape[1] // 2
        activated = (torch.nn.functional.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()).to(x.dtype)
    # Rows of slots held by other ranks are never written: zeros keep them out of the sum.
    down = torch.zeros(num_tokens * top_k, hidden, dtype=torch.float32, device=x.device)
    _grouped_gemm(activated, w2, down, w2_bias, weights, aligned, 1, True, config)
    return down.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
