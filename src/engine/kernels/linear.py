"""The bf16 linear kernel on the CPU (csrc/linear_bf16.c): weights packed once at load into panels of
64 columns, then each linear (and a gated MLP's gate_up linear with its SiLU-and-mul) one call.
engine/layers/linear.py calls them where `linear_bf16_usable(weight)` held at packing time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from engine.kernels import library
from engine.kernels.boundary import LinearKernels
from engine.utils import huge_pages

# The bf16 linear kernel (csrc/linear_bf16.c) handles up to this many rows; longer prefills go to
# F.linear. Measured on the 2-core AMD EPYC, one thread, a model's worth of matmuls: the kernel
# ran at 436-494 GFLOP/s per CPU-second from 64 to 2048 rows against oneDNN's 412-456, and at
# 320 against 264 at 16 rows.
LINEAR_BF16_MAX_ROWS = 4096


def enabled() -> bool:
    """Whether the family runs (ENGINE_CPU_KERNEL_LINEAR): weights packed while it did stay packed, and
    their layers take F.linear over the unpacked weight while it does not."""
    return library.linear() is not None


def _kernels() -> LinearKernels:
    lib = library.linear()
    assert lib is not None, "the bf16 linear kernels are not loaded: check linear_bf16_usable() first"
    return lib


@dataclass
class Bf16Panels:
    """A bf16 linear weight [n, k] packed for csrc/linear_bf16.c, and its bias in float32."""

    data: torch.Tensor
    n: int
    k: int
    bias: Optional[torch.Tensor]


def linear_bf16_usable(weight: torch.Tensor) -> bool:
    lib = library.linear()
    return (lib is not None and weight.is_cpu and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 2 == 0 and bool(lib.linear_bf16_available()))


def pack_linear_bf16(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Bf16Panels:
    n, k = weight.shape
    weight = weight.detach().contiguous()
    data = huge_pages.empty(-(-n // 64) * 64 * k, torch.bfloat16)  # streamed every decode step
    _kernels().pack_linear_bf16(weight.data_ptr(), n, k, data.data_ptr(), torch.get_num_threads())
    return Bf16Panels(data, n, k, None if bias is None else bias.detach().float().contiguous())


def linear_bf16(x: torch.Tensor, panels: Bf16Panels, add_bias: bool) -> torch.Tensor:
    """x [..., k] bf16 -> [..., n] bf16, plus the packed bias when add_bias (a row-parallel layer
    adds its bias only after the all-reduce)."""
    rows = x.reshape(-1, panels.k).contiguous()
    out = torch.empty(rows.shape[0], panels.n, dtype=torch.bfloat16)
    bias = panels.bias.data_ptr() if add_bias and panels.bias is not None else None
    _kernels().linear_bf16(rows.data_ptr(), rows.shape[0], panels.k, panels.data.data_ptr(),
                           panels.n, bias, out.data_ptr(), torch.get_num_threads())
    return out.view(*x.shape[:-1], panels.n)


def gate_up_silu_usable(x: torch.Tensor, panels: Bf16Panels) -> bool:
    """Whether linear_bf16_silu_mul takes x through a gate_up weight: each half whole 64-column panels."""
    return (x.dtype == torch.bfloat16 and enabled() and panels.n % 128 == 0
            and x.numel() <= LINEAR_BF16_MAX_ROWS * panels.k)


def linear_bf16_silu_mul(x: torch.Tensor, panels: Bf16Panels) -> torch.Tensor:
    """silu(x W_gate^T) * (x W_up^T) for a packed gate_up weight [W_gate; W_up] (plus its bias): the
    linear and SiluAndMul in one pass, the same bits as the two one after the other."""
    rows = x.reshape(-1, panels.k).contiguous()
    half = panels.n // 2
    out = torch.empty(rows.shape[0], half, dtype=torch.bfloat16)
    bias = panels.bias.data_ptr() if panels.bias is not None else None
    _kernels().linear_bf16_silu_mul(rows.data_ptr(), rows.shape[0], panels.k, panels.data.data_ptr(),
                                    panels.n, bias, out.data_ptr(), torch.get_num_threads())
    return out.view(*x.shape[:-1], half)


# A linear's weight format in the native decode chain and the MoE experts (csrc/cpu_common.h's CHAIN_*).
CHAIN_BF16, CHAIN_W8A8, CHAIN_Q4, CHAIN_W4A8, CHAIN_FP8 = 0, 1, 2, 3, 4


def _addresses(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


@dataclass
class NativeExperts:
    """A MoE layer's local experts as csrc/moe.c reads them (layers/moe/layer.py FusedMoE.pack_native): each
    expert's gate_up [2 inter, hidden] and down [hidden, inter] in one format (bf16 panels packed here, or the
    int8 / e4m3 weights --quantization made, with their per-channel scales), and their addresses."""

    format: int  # CHAIN_BF16, CHAIN_W8A8 or CHAIN_FP8
    hidden: int
    intermediate: int
    weights: Tuple[torch.Tensor, ...]  # what the addresses point into (each expert's gate_up, then down)
    scales: Tuple[torch.Tensor, ...]  # likewise, 8-bit only
    gate_up_addresses: torch.Tensor  # int64 [experts]
    down_addresses: torch.Tensor
    gate_up_scale_addresses: Optional[torch.Tensor]  # int64 [experts], None for bf16
    down_scale_addresses: Optional[torch.Tensor]

    @classmethod
    def bf16_panels(cls, w13: torch.Tensor, w2: torch.Tensor) -> "NativeExperts":
        """Packed from the stacked bf16 weights w13 [E, 2 inter, hidden] and w2 [E, hidden, inter]."""
        gate_up = [pack_linear_bf16(w13[e], None).data for e in range(w13.shape[0])]
        down = [pack_linear_bf16(w2[e], None).data for e in range(w2.shape[0])]
        return cls(CHAIN_BF16, int(w2.shape[1]), int(w2.shape[2]), (*gate_up, *down), (), _addresses(gate_up),
                   _addresses(down), None, None)

    @classmethod
    def quantized(cls, format: int, gate_up: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                  down: Sequence[Tuple[torch.Tensor, torch.Tensor]]) -> "NativeExperts":
        """Each expert's (weight [n, k] contiguous, per-channel float32 scale [n]) for gate_up and for down."""
        hidden, intermediate = down[0][0].shape
        weights = (*(w for w, _ in gate_up), *(w for w, _ in down))
        scales = (*(s for _, s in gate_up), *(s for _, s in down))
        return cls(format, int(hidden), int(intermediate), weights, scales, _addresses([w for w, _ in gate_up]),
                   _addresses([w for w, _ in down]), _addresses([s for _, s in gate_up]),
                   _addresses([s for _, s in down]))

    @property
    def num_experts(self) -> int:
        return int(self.gate_up_addresses.numel())


def address_or_none(t: Optional[torch.Tensor]) -> Optional[int]:
    """A tensor's data pointer, None (C's NULL) for no tensor."""
    return None if t is None else t.data_ptr()


def moe_experts_usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.dim() == 2 and x.shape[0] <= LINEAR_BF16_MAX_ROWS and enabled()


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: NativeExperts) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]) for x [T, hidden] bf16 (moe_experts_usable), weights
    [T, k] float32 and ids [T, k] int32 (-1: an expert of another rank), in one call (csrc/moe.c)."""
    x = x.contiguous()
    weights = weights.to(torch.float32).contiguous()
    ids = ids.to(torch.int32).contiguous()
    out = torch.empty(x.shape[0], experts.hidden, dtype=torch.bfloat16)
    if _kernels().moe_experts(x.data_ptr(), x.shape[0], experts.hidden, experts.intermediate, experts.num_experts,
                              ids.shape[1], weights.data_ptr(), ids.data_ptr(), experts.format,
                              experts.gate_up_addresses.data_ptr(), address_or_none(experts.gate_up_scale_addresses),
                              experts.down_addresses.data_ptr(), address_or_none(experts.down_scale_addresses),
                              out.data_ptr(), torch.get_num_threads()) != 0:
        raise MemoryError("moe_experts: no memory for its scratch")
    return out


# Rows up to which a bf16 weight widened in registers (csrc/linear_q8.c) beats F.linear where the CPU has no
# bf16 instructions (AVX2 only: torch's bf16 matmul converts element by element). Measured on the 2-core Zen 1
# with the 32000 x 1024 LM head: 1 row ran at ~16 GB/s of weights per core with the weights in L2 against
# F.linear's ~2; at 64 rows and up the product is compute-bound and MKL's sgemm over a float32 copy would win,
# but the LM head sees the batch's last rows only.
WIDENED_BF16_MAX_ROWS = 256


@dataclass
class WidenedBf16:
    """A bf16 weight [n, k] read as stored by csrc/linear_q8.c's widening kernel (CPUs without AVX512-BF16,
    where linear_bf16_usable is false); the layer's own weight, not a copy."""

    weight: torch.Tensor


def widened_bf16_usable(weight: torch.Tensor) -> bool:
    """Whether a bf16 weight should take the widening kernel: on a CPU the bf16 panels do not serve."""
    lib = library.linear()
    return (lib is not None and weight.is_cpu and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.is_contiguous() and not bool(lib.linear_bf16_available()))


def linear_widened_bf16(x: torch.Tensor, packed: WidenedBf16, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x [..., k] (bf16 or float32) -> [..., n] in x's dtype, float32 sums rounded once; None where the kernel
    does not take it (too many rows, another dtype, the family switched off): the caller's F.linear does."""
    lib = library.linear()
    n, k = packed.weight.shape
    rows = x.reshape(-1, k)
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16) or rows.shape[0] > WIDENED_BF16_MAX_ROWS:
        return None
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    b = None if bias is None else bias.float().contiguous()
    if lib.linear_q8(rows.data_ptr(), rows.shape[0], k, packed.weight.data_ptr(), 2, None,
                     None if b is None else b.data_ptr(), n, out.data_ptr(), int(x.dtype == torch.bfloat16),
                     torch.get_num_threads()) != 0:
        raise MemoryError("linear_q8: no memory for the bf16 activations' float32 copy")
    return out.view(*x.shape[:-1], n)
