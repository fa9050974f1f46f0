"""Fused element-wise ops of a decoder layer on the CPU (csrc/cpu_ops.c, in the native kernel
library of engine.kernels.library).

A decode step of a small model is dozens of tiny torch ops per layer: RMSNorm alone is nine
(add, cast, pow, mean, add, rsqrt, mul, cast, mul), rotary another dozen. Each is a dispatch, a
pass over the activations and, for larger batches, a fork/join of the thread team. These kernels
do each group in one call. The layers call them
when `usable(...)` holds (CPU tensors of float32 / bfloat16, the library built, no autograd) and
keep their torch code otherwise; `ENGINE_CPU_KERNEL_OPS=0` switches them off.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from engine.kernels import library
from engine.kernels.boundary import OpsKernels

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_ROTARY_DIM = 512  # the kernel's per-head scratch


def _kernels() -> OpsKernels:
    lib = library.ops()
    assert lib is not None, "the fused ops kernels are not loaded: check usable() first"
    return lib


def usable(x: torch.Tensor, *others: torch.Tensor) -> bool:
    return (x.is_cpu and x.dtype in _DTYPES and not x.requires_grad
            and all(o.dtype == x.dtype and o.is_cpu for o in others) and library.ops() is not None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight * norm(x + residual), x + residual); the second is None without a residual."""
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    res_out = None
    res_ptr = res_out_ptr = None
    if residual is not None:
        residual = residual.contiguous()
        res_out = torch.empty_like(x)
        res_ptr, res_out_ptr = residual.data_ptr(), res_out.data_ptr()
    _kernels().rms_norm(x.data_ptr(), res_ptr, weight.contiguous().data_ptr(), out.data_ptr(),
                        res_out_ptr, x.numel() // n, n, eps, _DTYPES[x.dtype],
                        torch.get_num_threads())
    return out, res_out


def rope_neox_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor,
               head_size: int, rotary_dim: int) -> None:
    """Rotate q [T, Hq * D] and k [T, Hk * D] in place (rows may be strided, elements contiguous)."""
    positions = positions.to(torch.int64).contiguous()
    tokens = q.shape[0]
    _kernels().rope_neox(
        positions.data_ptr(), q.data_ptr(), q.stride(0), q.shape[1] // head_size, k.data_ptr(), k.stride(0),
        k.shape[1] // head_size, cos_sin.data_ptr(), head_size, rotary_dim, tokens, _DTYPES[q.dtype],
        torch.get_num_threads())


def rope_usable(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> bool:
    return (usable(q, k) and q.dim() == 2 and k.dim() == 2 and q.stride(1) == 1 and k.stride(1) == 1
            and cos_sin.dtype == torch.float32 and cos_sin.is_contiguous() and rotary_dim <= MAX_ROTARY_DIM
            and rotary_dim % 2 == 0)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    _kernels().silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * d), d,
                            _DTYPES[x.dtype], torch.get_num_threads())
    return out


def argmax_usable(x: torch.Tensor) -> bool:
    return (x.is_cpu and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
            and x.shape[1] > 0 and library.ops() is not None)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a float32 [rows, n] CPU tensor (x.stride(1) == 1): the first index
    of each row's maximum, a row's first NaN where it has one."""
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _kernels().argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                           torch.get_num_threads())
    return out


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """The greedy pick of every row: the native kernel where it runs, torch.argmax elsewhere."""
    return argmax(logits) if argmax_usable(logits) else torch.argmax(logits, dim=-1)


def store_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_pool[loc] = k and v_pool[loc] = v: pools [slots, heads, dim] contiguous; k, v [T, heads, dim]
    whose (heads, dim) part is contiguous (rows may be slices of a fused qkv output)."""
    loc = loc.to(torch.int64).contiguous()
    width = k.shape[1] * k.shape[2]
    _kernels().store_kv(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), k_pool.data_ptr(),
                        v_pool.data_ptr(), k_pool.stride(0), loc.data_ptr(), loc.numel(), width,
                        k.element_size(), torch.get_num_threads())


def store_kv_usable(k_pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    def rows_ok(t: torch.Tensor) -> bool:
        return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]

    return usable(k_pool, k, v) and k_pool.is_contiguous() and rows_ok(k) and rows_ok(v)


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """layers/moe/router.py select_experts (weights [T, top_k] float32, ids [T, top_k] int32) in one call:
    the softmax in float32, the top_k largest first (usable(logits) must hold; logits [T, E])."""
    logits = logits.contiguous()
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=torch.float32)
    ids = torch.empty(tokens, top_k, dtype=torch.int32)
    _kernels().moe_route(logits.data_ptr(), tokens, num_experts, top_k, int(renormalize), _DTYPES[logits.dtype],
                         weights.data_ptr(), ids.data_ptr())
    return weights, ids
