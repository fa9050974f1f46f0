"""The batched LoRA product (SGLang's segmented design).

A batch's rows are cut into segments of consecutive rows that use the same adapter slot
(`LoRABatchInfo`); slot 0 is "no adapter" and is skipped. For a projection with sub-projections
(q/k/v, gate/up) the A matrices are stacked ([slots, subs x R, K]) and each sub-projection's B
([slots, n_i, R], a row block of the stacked B) multiplies its own R columns of the shrunk rows:

    shrink = x @ A[slot]^T                        # [rows, subs x R]
    out[:, section i] += shrink[:, i R:(i+1) R] @ B_i[slot]^T * scaling[slot]

An adapter of rank r < R fills the first r rows of A and columns of B; the rest stay zero, so the
product is exact without per-slot ranks. Two implementations: `torch_native` (a loop over the
segments, the CPU path) and `triton` (one segmented-GEMM kernel launched for the shrink and once
per section for the expand; triton_ops.py), which agree to float tolerance (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class LoRABatchInfo:
    """The segments of one forward's rows: [start, end) rows use adapter slot `slots[i]`."""

    num_rows: int
    bounds: List[Tuple[int, int, int]]  # (start, end, slot) on the host, for the native loop
    seg_indptr: torch.Tensor  # [segments + 1] int32, on the device
    weight_indices: torch.Tensor  # [segments] int32 slot per segment, on the device
    max_len: int  # the longest segment (the kernel's grid)
    scalings: torch.Tensor  # [slots] float32 (the pool's; slot 0 is 0)

    @property
    def has_lora(self) -> bool:
        return any(slot != 0 for _, _, slot in self.bounds)


def build_batch_info(row_slots: Sequence[int], scalings: torch.Tensor, device: torch.device) -> LoRABatchInfo:
    """Segments of consecutive rows with the same slot."""
    bounds: List[Tuple[int, int, int]] = []
    for row, slot in enumerate(row_slots):
        if bounds and bounds[-1][2] == slot:
            start, _, _ = bounds[-1]
            bounds[-1] = (start, row + 1, slot)
        else:
            bounds.append((row, row + 1, slot))
    indptr = [0] + [end for _, end, _ in bounds]
    return LoRABatchInfo(
        num_rows=len(row_slots), bounds=bounds,
        seg_indptr=torch.tensor(indptr, dtype=torch.int32).to(device, non_blocking=True),
        weight_indices=torch.tensor([s for _, _, s in bounds], dtype=torch.int32).to(device, non_blocking=True),
        max_len=max((end - start for start, end, _ in bounds), default=0), scalings=scalings)


def lora_native(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                sections: Sequence[Tuple[int, int]], rank: int, info: LoRABatchInfo) -> None:
    """out += the LoRA delta of each segment (a: [slots, subs x R, K], b: [slots, N, R])."""
    scalings = info.scalings.tolist()
    for start, end, slot in info.bounds:
        if slot == 0:
            continue
        shrink = x[start:end] @ a[slot].t()
        rows = out[start:end]
        for i, (offset, size) in enumerate(sections):
            delta = shrink[:, i * rank:(i + 1) * rank] @ b[slot, offset:offset + size].t()
            rows[:, offset:offset + size] += delta * scalings[slot]


def lora_triton(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                sections: Sequence[Tuple[int, int]], rank: int, info: LoRABatchInfo) -> None:
    """As lora_native, with the segmented-GEMM kernel (triton_ops.segmented_gemm)."""
    from engine.lora.triton_ops import segmented_gemm

    shrink = torch.empty((x.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    segmented_gemm(x, a, shrink, info, scale=False, accumulate=False)
    for i, (offset, size) in enumerate(sections):
        segmented_gemm(shrink[:, i * rank:(i + 1) * rank], b[:, offset:offset + size], out[:, offset:offset + size],
                       info, scale=True, accumulate=True)


def pick_backend(name: str, device: str) -> str:
    """'auto': triton on CUDA, torch_native elsewhere."""
    if name == "auto":
        return "triton" if device.startswith("cuda") else "torch_native"
    return name


LORA_BACKENDS = {"torch_native": lora_native, "triton": lora_triton}


def run_lora(backend: str, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             sections: Sequence[Tuple[int, int]], rank: int, info: Optional[LoRABatchInfo]) -> None:
    if info is None or not info.has_lora:
        return
    LORA_BACKENDS[backend](x, out, a, b, sections, rank, info)
