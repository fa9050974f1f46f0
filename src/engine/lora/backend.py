"""The batched LoRA product (SGLang's segmented design).

A batch's rows are cut into segments of consecutive rows that use the same adapter slot
(`LoRABatchInfo`); slot 0 is "no adapter" and is skipped. For a projection with sub-projections
(q/k/v, gate/up) the A matrices are stacked ([slots, subs x R, K]) and each sub-projection's B
([slots, n_i, R], a row block of the stacked B) multiplies its own R columns of the shrunk rows:

    shrink = x @ A[slot]^T                        # [rows, subs x R]
    out[:, section i] += shrink[:, i R:(i+1) R] @ B_i[slot]^T * scaling[slot]

An adapter of rank r < R fills the first r rows of A and columns of B; the rest stay zero, so the
product is exact without per-slot ranks. Two implementations: `torch_native` (the CPU path: a
loop over the adapters, each one's rows gathered, so a batch of 64 requests over 8 adapters costs 8
small products per projection, not 64) and `triton` (one segmented-GEMM kernel launched for the shrink and once
per section for the expand; triton_ops.py), which agree to float tolerance (tests).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class SlotRows:
    """The rows of one adapter slot: [start, end) when they are consecutive, else `index`."""

    slot: int
    start: int
    end: int
    index: Optional[torch.Tensor]  # int64 row numbers, or None for the range


@dataclass(frozen=True)
class LoRABatchInfo:
    """The segments of one forward's rows: [start, end) rows use adapter slot `slots[i]`."""

    num_rows: int
    bounds: List[Tuple[int, int, int]]  # (start, end, slot) on the host
    seg_indptr: torch.Tensor  # [segments + 1] int32, on the device
    weight_indices: torch.Tensor  # [segments] int32 slot per segment, on the device
    max_len: int  # the longest segment (the kernel's grid)
    scalings: torch.Tensor  # [slots] float32 (the pool's; slot 0 is 0)
    # The native path: the rows of each adapter slot but 0, gathered (a few matmuls per adapter
    # instead of a few per segment: requests of one adapter need not be neighbours in a batch).
    groups: List[SlotRows]
    scaling_values: List[float]
    # The native dense path (few rows): per row, each slot's scaling where the row uses that slot,
    # else 0 ([rows, slots] float32); None for batches too large for it.
    row_scales: Optional[torch.Tensor] = None

    @property
    def has_lora(self) -> bool:
        return bool(self.groups)


def build_batch_info(row_slots: Sequence[int], scalings: torch.Tensor, device: torch.device,
                     scaling_values: Optional[List[float]] = None, dense: bool = True) -> LoRABatchInfo:
    """Segments of consecutive rows with the same slot, and the rows of each slot. `scaling_values`:
    the host copy of `scalings` (read from the device when not given); `dense`: prepare the native
    dense path for a small batch."""
    if scaling_values is None:
        scaling_values = scalings.tolist()
    bounds: List[Tuple[int, int, int]] = []
    rows_of: Dict[int, List[int]] = {}
    for row, slot in enumerate(row_slots):
        if bounds and bounds[-1][2] == slot:
            start, _, _ = bounds[-1]
            bounds[-1] = (start, row + 1, slot)
        else:
            bounds.append((row, row + 1, slot))
        if slot != 0:
            rows_of.setdefault(slot, []).append(row)
    groups = []
    for slot, rows in rows_of.items():
        consecutive = rows[-1] - rows[0] + 1 == len(rows)
        index = None if consecutive else torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        groups.append(SlotRows(slot, rows[0], rows[-1] + 1, index))
    indptr = [0] + [end for _, end, _ in bounds]
    row_scales = None
    if dense and len(row_slots) <= DENSE_MAX_ROWS and groups:
        slots = torch.tensor(list(row_slots), dtype=torch.int64)
        row_scales = torch.zeros((len(row_slots), len(scaling_values)), dtype=torch.float32)
        row_scales[torch.arange(len(row_slots)), slots] = torch.tensor(scaling_values, dtype=torch.float32)[slots]
        row_scales = row_scales.to(device, non_blocking=True)
    return LoRABatchInfo(
        num_rows=len(row_slots), bounds=bounds,
        seg_indptr=torch.tensor(indptr, dtype=torch.int32).to(device, non_blocking=True),
        weight_indices=torch.tensor([s for _, _, s in bounds], dtype=torch.int32).to(device, non_blocking=True),
        max_len=max((end - start for start, end, _ in bounds), default=0), scalings=scalings,
        groups=groups, scaling_values=scaling_values, row_scales=row_scales)


# Batches of at most this many rows (decode steps) take the dense native path: two GEMMs over every
# slot at once instead of a few per adapter. Each small GEMM is a parallel region, and on a busy CPU
# every region can wait a scheduler time slice for its second thread, so their number matters more
# than their size; the zero blocks the dense path multiplies cost little at this size.
DENSE_MAX_ROWS = 256


def lora_native(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                sections: Sequence[Tuple[int, int]], rank: int, info: LoRABatchInfo,
                dense_b: Optional[torch.Tensor] = None) -> None:
    """out += the LoRA delta of each adapter's rows (a: [slots, subs x R, K], b: [slots, N, R];
    dense_b: the same B as one block matrix [slots x subs x R, N], for the dense path)."""
    if dense_b is not None and info.row_scales is not None:
        slots, stacked = a.shape[0], a.shape[1]
        shrink = x.to(a.dtype) @ a.view(slots * stacked, -1).t()
        # Each row keeps its own slot's columns, scaled; the other slots' become 0.
        shrink.view(-1, slots, stacked).mul_(info.row_scales.to(shrink.dtype).unsqueeze(-1))
        if out.dtype == shrink.dtype:
            out.addmm_(shrink, dense_b)  # few ops: on a small model each one's overhead is the cost
        else:
            out += (shrink @ dense_b).to(out.dtype)
        return
    stacked = a.shape[1]
    for group in info.groups:
        slot, index = group.slot, group.index
        rows = x[group.start:group.end] if index is None else x.index_select(0, index)
        shrink = rows.to(a.dtype) @ a[slot].t()
        if dense_b is not None:  # every section's expand in one GEMM (the block of this slot)
            delta = shrink @ dense_b[slot * stacked:(slot + 1) * stacked]
        else:
            delta = torch.empty((shrink.shape[0], out.shape[1]), dtype=shrink.dtype, device=shrink.device)
            for i, (offset, size) in enumerate(sections):
                delta[:, offset:offset + size] = shrink[:, i * rank:(i + 1) * rank] @ b[slot, offset:offset + size].t()
        delta = (delta * info.scaling_values[slot]).to(out.dtype)
        if index is None:  # whole rows at once: one add (or scatter) per adapter
            out[group.start:group.end] += delta
        else:
            out.index_add_(0, index, delta)


def lora_triton(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                sections: Sequence[Tuple[int, int]], rank: int, info: LoRABatchInfo) -> None:
    """As lora_native, with the segmented-GEMM kernel (triton_ops.segmented_gemm)."""
    from engine.lora.triton_ops import segmented_gemm

    segments = (info.seg_indptr, info.weight_indices, info.scalings, info.max_len)
    shrink = torch.empty((x.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    segmented_gemm(x, a, shrink, *segments, scale=False, accumulate=False)
    for i, (offset, size) in enumerate(sections):
        segmented_gemm(shrink[:, i * rank:(i + 1) * rank], b[:, offset:offset + size], out[:, offset:offset + size],
                       *segments, scale=True, accumulate=True)


def pick_backend(name: str, device: str) -> str:
    """'auto': triton on CUDA, torch_native elsewhere."""
    if name == "auto":
        return "triton" if device.startswith("cuda") else "torch_native"
    return name


def run_lora(backend: str, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             sections: Sequence[Tuple[int, int]], rank: int, info: Optional[LoRABatchInfo],
             dense_b: Optional[torch.Tensor] = None) -> None:
    if info is None or not info.has_lora:
        return
    if backend == "triton":
        lora_triton(x, out, a, b, sections, rank, info)
    else:
        lora_native(x, out, a, b, sections, rank, info, dense_b)
