"""The batched LoRA product (SGLang's segmented design).

A batch's rows are cut into segments of consecutive rows that use the same adapter slot
(`LoRABatchInfo`); slot 0 is "no adapter" and is skipped. For a projection with sub-projections
(q/k/v, gate/up) the A matrices are stacked ([slots, subs x R, K]) and each sub-projection's B
([slots, n_i, R], a row block of the stacked B) multiplies its own R columns of the shrunk rows:

    shrink = x @ A[slot]^T                        # [rows, subs x R]
    out[:, section i] += shrink[:, i R:(i+1) R] @ B_i[slot]^T * scaling[slot]

An adapter of rank r < R fills the first r rows of A and columns of B; the rest stay zero, so the
product is exact without per-slot ranks. Implementations, which agree to float tolerance (tests):

- `torch_native` on a CPU model of float32 or bfloat16 with the native kernels built (the `lora` family,
  ENGINE_CPU_KERNEL_LORA): one call of csrc/lora_delta.c per projection (`lora_kernel`), whatever the
  rows (decode steps, prefills, mixed batches). It sorts the rows by slot itself and adds each row's delta
  straight into `out`, bf16 converted in registers; at a decode step the torch ops below cost several
  times their arithmetic in dispatch, and a bf16 model's rows were widened to float32 and back. Measured
  with benchmarks/bench_lora_op.py (docs/benchmarks.md): less CPU than the torch ops at decode and
  prefill sizes alike, so the torch ops are only the fallback.
- `torch_native` otherwise (no C compiler, the family off, float16): the rows of each adapter are gathered into one buffer, grouped by
  adapter (`GroupedRows`, built once per forward, not per layer), and each projection runs a fixed
  handful of ops whatever the number of adapters: one gather of x, one batched shrink over every
  adapter at once, one batched expand per section (written straight into its columns: the zero
  blocks of a fused q/k/v or gate/up B are never multiplied), one gather of the deltas back into
  row order and one add. The groups are padded to the longest one so that the products are single
  `bmm`s; a batch whose adapters hold very unequal numbers of rows (where padding would multiply
  mostly filler) loops over the adapters instead. B is stored transposed and pre-scaled
  (mem_pool.py), so no scaling op runs per layer. On a small model every op's fixed cost counts
  (a 64-row decode step of a hidden-256 projection is ~0.1 ms of arithmetic), hence few ops.
  Long segments (a prefill's requests: one adapter per request, so each request's rows are
  consecutive) are read in place instead (`NativeRows.segments`): per segment one shrink into a
  scratch block and one product per section accumulated straight into its columns of `out`, with no
  gather of x, no delta buffer, no scatter and no separate add. Only the short segments (the
  decode rows of a mixed batch) go through the grouped layout, over the span of rows that holds them.
- `triton` (one segmented-GEMM kernel launched for the shrink and once per section for the
  expand; triton_ops.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from engine.kernels import library
from engine.kernels.boundary import LoRAKernels

@dataclass(frozen=True)
class GroupedRows:
    """The native path's layout of one forward's adapter rows (rows of slot 0 take no part).

    Group g (adapter slot `slot_ids[g]`) holds its rows, in row order, at positions
    [starts[g], starts[g] + counts[g]) of a buffer of `positions` rows. Padded: every group starts
    at g * group_len (the buffer is [groups, group_len] for one bmm; the filler positions repeat a
    real row and their results are never read)."""

    slot_ids: List[int]
    slot_index: Union[slice, torch.Tensor]  # the slots as a slice when consecutive (a view, no copy)
    starts: List[int]
    counts: List[int]
    padded: bool
    group_len: int
    positions: int
    gather: Optional[torch.Tensor]  # [positions] int64: the row of x at each position; None: x itself
    # [rows] int64: the position of each row's delta, `positions` (a zero row) for rows of slot 0;
    # None: the buffer is already in row order (gather is None too).
    scatter: Optional[torch.Tensor]
    # One forward's scratch memory for every projection (deltas, their row-order copy, the shrunk
    # rows), so the per-layer products allocate nothing.
    workspace: torch.Tensor
    max_out: int  # the workspace's row width
    base_rows: int  # rows of slot 0


# A padded layout is used while it multiplies at most this many times the real rows (plus a small
# batch's slack); past that the adapters are looped over.
PAD_MAX_WASTE = 2.0
PAD_SLACK_ROWS = 64


def group_rows(row_slots: Sequence[int], max_out: int, max_stacked: int, dtype: torch.dtype,
               device: torch.device) -> Optional[GroupedRows]:
    """The grouped layout of a forward's rows for the native path (None when no row has an adapter).
    `max_out` / `max_stacked`: the widest projection output and stacked rank (the workspace)."""
    num_rows = len(row_slots)
    slots = torch.tensor(list(row_slots), dtype=torch.int64)
    counts_all = torch.bincount(slots).tolist() if num_rows else []
    slot_ids = [s for s in range(1, len(counts_all)) if counts_all[s] > 0]
    if not slot_ids:
        return None
    counts = [counts_all[s] for s in slot_ids]
    lora_rows = sum(counts)
    base_rows = num_rows - lora_rows
    group_len = max(counts)
    padded = len(slot_ids) * group_len <= PAD_MAX_WASTE * lora_rows + PAD_SLACK_ROWS
    starts = [g * group_len for g in range(len(slot_ids))] if padded else \
        [sum(counts[:g]) for g in range(len(slot_ids))]
    positions = len(slot_ids) * group_len if padded else lora_rows
    order = torch.argsort(slots, stable=True)[base_rows:]  # adapter rows, by slot, in row order within a slot
    # Each sorted row's position: its group's start plus its rank within the group.
    shift = torch.tensor([start - sum(counts[:g]) for g, start in enumerate(starts)], dtype=torch.int64)
    where = torch.arange(lora_rows, dtype=torch.int64) + torch.repeat_interleave(shift, torch.tensor(counts))
    in_order = base_rows == 0 and positions == num_rows and bool(torch.equal(order, torch.arange(num_rows)))
    gather: Optional[torch.Tensor] = None
    scatter: Optional[torch.Tensor] = None
    if not in_order:
        gather = torch.zeros(positions, dtype=torch.int64)
        gather[where] = order
        scatter = torch.full((num_rows,), positions, dtype=torch.int64)
        scatter[order] = where
        gather, scatter = gather.to(device, non_blocking=True), scatter.to(device, non_blocking=True)
    first, last = slot_ids[0], slot_ids[-1]
    slot_index: Union[slice, torch.Tensor] = slice(first, last + 1) if last - first + 1 == len(slot_ids) else \
        torch.tensor(slot_ids, dtype=torch.int64).to(device, non_blocking=True)
    # deltas (+ the zero row), the deltas in row order, the shrunk rows
    size = (positions + 1) * max_out + num_rows * max_out + positions * max_stacked
    workspace = torch.empty(size, dtype=dtype, device=device)
    return GroupedRows(slot_ids, slot_index, starts, counts, padded, group_len, positions, gather, scatter, workspace,
                       max_out, base_rows)


# A segment of at least this many rows is multiplied in place (NativeRows.segments): its products
# are large enough that the per-segment ops cost less than moving its rows to a grouped buffer and
# back (the gather, the delta buffer, the scatter and the add each move the rows' bytes once).
IN_PLACE_MIN_ROWS = 32


@dataclass(frozen=True)
class NativeRows:
    """The native path's plan for one forward's rows: `segments` (start, end, slot) multiplied in
    place, and the remaining adapter rows grouped (`grouped`, over rows [span[0], span[1]), where the
    in-place rows count as rows without an adapter)."""

    segments: List[Tuple[int, int, int]]
    grouped: Optional[GroupedRows]
    span: Tuple[int, int]
    longest: int  # rows of the longest in-place segment
    shrink: torch.Tensor  # flat, longest x the widest stacked rank: each in-place segment's shrunk rows


def plan_native_rows(row_slots: Sequence[int], bounds: Sequence[Tuple[int, int, int]], max_out: int,
                     max_stacked: int, dtype: torch.dtype, device: torch.device) -> Optional[NativeRows]:
    """The native path's plan (None when no row has an adapter)."""
    segments = [(start, end, slot) for start, end, slot in bounds if slot != 0 and end - start >= IN_PLACE_MIN_ROWS]
    short = [(start, end) for start, end, slot in bounds if slot != 0 and end - start < IN_PLACE_MIN_ROWS]
    if not segments and not short:
        return None
    grouped: Optional[GroupedRows] = None
    span = (0, 0)
    if short:
        span = (short[0][0], short[-1][1])
        part = list(row_slots[span[0]:span[1]])
        for start, end, _ in segments:  # in-place rows inside the span take no part in the grouped products
            for row in range(max(start, span[0]), min(end, span[1])):
                part[row - span[0]] = 0
        grouped = group_rows(part, max_out, max_stacked, dtype, device)
    longest = max((end - start for start, end, _ in segments), default=0)
    shrink = torch.empty(longest * max_stacked, dtype=dtype, device=device)
    return NativeRows(segments, grouped, span, longest, shrink)


@dataclass(frozen=True)
class NativeShape:
    """What the native path's workspace must hold: the widest projection output and stacked rank
    of the model's targets, in the pool's dtype."""

    max_out: int
    max_stacked: int
    dtype: torch.dtype


@dataclass(frozen=True)
class LoRABatchInfo:
    """The segments of one forward's rows: [start, end) rows use adapter slot `slots[i]`."""

    num_rows: int
    bounds: List[Tuple[int, int, int]]  # (start, end, slot) on the host
    seg_indptr: torch.Tensor  # [segments + 1] int32, on the device
    weight_indices: torch.Tensor  # [segments] int32 slot per segment, on the device
    max_len: int  # the longest segment (the kernel's grid)
    scalings: torch.Tensor  # [slots] float32 (the pool's; slot 0 is 0)
    has_lora: bool  # some row uses an adapter
    native: Optional[NativeRows] = None  # the native path's plan (None for triton, or no adapter rows)
    # int64 [rows] on the host, each row's slot, where the native kernel runs (lora_kernel; no plan then)
    kernel_slots: Optional[torch.Tensor] = None


def build_batch_info(row_slots: Sequence[int], scalings: torch.Tensor, device: torch.device,
                     native: Optional[NativeShape] = None, kernel: bool = False) -> LoRABatchInfo:
    """Segments of consecutive rows with the same slot; with `kernel`, each row's slot for the native
    kernel; else with `native`, the rows grouped by adapter for the torch path."""
    bounds: List[Tuple[int, int, int]] = []
    for row, slot in enumerate(row_slots):
        if bounds and bounds[-1][2] == slot:
            bounds[-1] = (bounds[-1][0], row + 1, slot)
        else:
            bounds.append((row, row + 1, slot))
    indptr = [0] + [end for _, end, _ in bounds]
    has_lora = any(slot != 0 for _, _, slot in bounds)
    plan, kernel_slots = None, None
    if kernel and has_lora:
        kernel_slots = torch.tensor(list(row_slots), dtype=torch.int64)
    elif native is not None:
        plan = plan_native_rows(row_slots, bounds, native.max_out, native.max_stacked, native.dtype, device)
    return LoRABatchInfo(
        num_rows=len(row_slots), bounds=bounds,
        seg_indptr=torch.tensor(indptr, dtype=torch.int32).to(device, non_blocking=True),
        weight_indices=torch.tensor([s for _, _, s in bounds], dtype=torch.int32).to(device, non_blocking=True),
        max_len=max((end - start for start, end, _ in bounds), default=0), scalings=scalings,
        has_lora=has_lora, native=plan, kernel_slots=kernel_slots)


def native_b(b: torch.Tensor, sections: Sequence[Tuple[int, int]], rank: int,
             scalings: torch.Tensor) -> List[torch.Tensor]:
    """B as the native path reads it: per section, [slots, R, n_i] = B_i^T x the slot's scaling."""
    scale = scalings.to(b.dtype).view(-1, 1, 1)
    return [(b[:, offset:offset + size, :rank].transpose(1, 2) * scale).contiguous() for offset, size in sections]


def kernel_b(b: torch.Tensor, rank: int, scalings: torch.Tensor) -> torch.Tensor:
    """B as the native kernel reads it (csrc/lora_delta.c): [slots, R, N] = B^T x the slot's scaling, every
    section's columns in one row (section i's are native_b's i-th)."""
    return (b[:, :, :rank].transpose(1, 2) * scalings.to(b.dtype).view(-1, 1, 1)).contiguous()


def sections_tensor(sections: Sequence[Tuple[int, int]]) -> torch.Tensor:
    """The sections as the native kernel takes them: int64 [sections, 2] of (column offset, width)."""
    return torch.tensor([list(sec) for sec in sections], dtype=torch.int64).view(-1, 2)


_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel_takes(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b_full: torch.Tensor) -> bool:
    """Whether csrc/lora_delta.c takes these operands as they are (rows of unit stride, x and out of one
    kernel dtype, A and B of one, on the CPU)."""
    return (x.device.type == "cpu" and x.dtype == out.dtype and x.dtype in _KERNEL_DTYPES
            and a.dtype == b_full.dtype and a.dtype in _KERNEL_DTYPES and x.stride(-1) == 1 and out.stride(-1) == 1
            and a.is_contiguous() and b_full.is_contiguous() and out.shape[1] == b_full.shape[2])


def lora_kernel(lib: LoRAKernels, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b_full: torch.Tensor,
                sections: torch.Tensor, rank: int, row_slots: torch.Tensor, num_threads: int) -> None:
    """out += the LoRA delta of each row's adapter in one native call (rows of slot 0 untouched); the
    operands as kernel_takes() accepts them, row_slots int64 [rows] on the host."""
    status = lib.lora_delta(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1],
                            row_slots.data_ptr(), a.shape[0], a.data_ptr(), b_full.data_ptr(),
                            int(a.dtype == torch.bfloat16), rank, sections.data_ptr(), sections.shape[0],
                            b_full.shape[2], int(x.dtype == torch.bfloat16), num_threads)
    if status == -1:
        raise MemoryError("lora_delta: no memory for its scratch")
    if status != 0:
        raise ValueError("lora_delta: a row's slot or a section lies outside the LoRA buffers")


def kernel_usable(dtype: torch.dtype, pool_dtype: torch.dtype, device: str) -> bool:
    """Whether the native kernel serves a CPU model of `dtype` over a pool of `pool_dtype` (the kernel
    family on and built)."""
    return (device == "cpu" and dtype in _KERNEL_DTYPES and pool_dtype in _KERNEL_DTYPES
            and library.lora() is not None)


# The kernel's rows up to which it runs on the calling thread alone. Measured on the 2-core machine at load
# 5-8 (bench_lora_op.py, docs/benchmarks.md): a 64-row decode forward's deltas took 2.4 ms of wall time on
# one thread, 3.3 on two, for the same CPU (each tile is microseconds; the partner thread waits for a core).
# Larger batches take the pool, which falls back to its caller alone where it sees contention: a prefill's
# products are what would idle the second core of a quiet machine.
KERNEL_SERIAL_MAX_ROWS = 256


def kernel_threads(rows: int) -> int:
    """The kernel's thread count for a batch of `rows` rows (KERNEL_SERIAL_MAX_ROWS)."""
    return 1 if rows <= KERNEL_SERIAL_MAX_ROWS else torch.get_num_threads()


def _omp_thread_count() -> Tuple[Optional[Callable[[], int]], Optional[Callable[[int], None]]]:
    """libgomp's getter and setter of the calling thread's OpenMP thread count (None, None without it)."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1")
        return gomp.omp_get_max_threads, gomp.omp_set_num_threads
    except (OSError, AttributeError):  # torch without libgomp: the products keep the thread count
        return None, None


_GET_OMP_THREADS, _SET_OMP_THREADS = _omp_thread_count()
# Batches of at most this many rows (decode steps) run their LoRA products on the calling thread
# alone: each product is a few microseconds of arithmetic, and on a busy CPU a parallel region can
# wait a scheduler time slice for its second thread, so a team costs more than it saves.
SERIAL_MAX_ROWS = 256


def lora_native(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b_sections: Sequence[torch.Tensor],
                sections: Sequence[Tuple[int, int]], rank: int, rows: NativeRows) -> None:
    """out += the LoRA delta of each adapter's rows (a: [slots, subs x R, K]; b_sections: native_b's)."""
    if rows.segments:
        _serial(rows.longest <= SERIAL_MAX_ROWS, _lora_in_place, x, out, a, b_sections, sections, rank, rows)
    if rows.grouped is not None:
        start, end = rows.span
        _serial(end - start <= SERIAL_MAX_ROWS, _lora_native, x[start:end], out[start:end], a, b_sections,
                sections, rank, rows.grouped)


def _serial(serial: bool, fn: Callable[..., None], *args: object) -> None:
    """fn(*args), on the calling thread alone when `serial` (see SERIAL_MAX_ROWS)."""
    if not serial or _GET_OMP_THREADS is None or _SET_OMP_THREADS is None:
        fn(*args)
        return
    threads = _GET_OMP_THREADS()  # this thread's own count (the scheduling thread's may be 1)
    _SET_OMP_THREADS(1)
    try:
        fn(*args)
    finally:
        _SET_OMP_THREADS(threads)


def _lora_in_place(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b_sections: Sequence[torch.Tensor],
                   sections: Sequence[Tuple[int, int]], rank: int, rows: NativeRows) -> None:
    stacked = a.shape[1]
    for start, end, slot in rows.segments:
        xs = x[start:end]
        if xs.dtype != a.dtype:  # a bfloat16 model: the small products run in float32 (the pool's dtype)
            xs = xs.to(a.dtype)
        shrunk = rows.shrink[:(end - start) * stacked].view(end - start, stacked)
        torch.mm(xs, a[slot].t(), out=shrunk)
        for i, (offset, size) in enumerate(sections):
            target = out[start:end, offset:offset + size]
            product = shrunk[:, i * rank:(i + 1) * rank]
            if target.dtype == product.dtype:
                target.addmm_(product, b_sections[i][slot])  # one product, accumulated in its columns
            else:
                target.add_(torch.mm(product, b_sections[i][slot]))


def _lora_native(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b_sections: Sequence[torch.Tensor],
                 sections: Sequence[Tuple[int, int]], rank: int, rows: GroupedRows) -> None:
    num_rows, stacked, k = out.shape[0], a.shape[1], x.shape[1]
    positions, groups, group_len = rows.positions, len(rows.slot_ids), rows.group_len
    ws = rows.workspace
    ordered_at = (positions + 1) * rows.max_out
    shrink_at = ordered_at + num_rows * rows.max_out
    shrink = ws[shrink_at:shrink_at + positions * stacked].view(positions, stacked)
    xs = x if rows.gather is None else x.index_select(0, rows.gather)
    if xs.dtype != a.dtype:  # a bfloat16 model: the small products run in float32 (the pool's dtype)
        xs = xs.to(a.dtype)
    if rows.padded:  # one product for every adapter at once
        torch.bmm(xs.view(groups, group_len, k), a[rows.slot_index].transpose(1, 2),
                  out=shrink.view(groups, group_len, stacked))
    else:
        for slot, start, count in zip(rows.slot_ids, rows.starts, rows.counts):
            torch.mm(xs[start:start + count], a[slot].t(), out=shrink[start:start + count])
    # Each section's deltas in a contiguous block of the workspace (products written into column
    # slices of one buffer take a slow strided path), then added to the section's columns of out.
    delta_at = 0
    for i, (offset, size) in enumerate(sections):
        delta = ws[delta_at:delta_at + (positions + 1) * size].view(positions + 1, size)
        delta_at += (positions + 1) * size
        shrunk = shrink[:, i * rank:(i + 1) * rank]
        if rows.padded:
            torch.bmm(shrunk.view(groups, group_len, rank), b_sections[i][rows.slot_index],
                      out=delta[:positions].view(groups, group_len, size))
        else:
            for slot, start, count in zip(rows.slot_ids, rows.starts, rows.counts):
                torch.mm(shrunk[start:start + count], b_sections[i][slot], out=delta[start:start + count])
        target = out if len(sections) == 1 else out[:, offset:offset + size]
        if rows.scatter is None:
            target.add_(delta[:positions])
            continue
        if rows.base_rows:
            delta[positions].zero_()  # what the rows without an adapter add
        ordered = ws[ordered_at:ordered_at + num_rows * size].view(num_rows, size)
        torch.index_select(delta, 0, rows.scatter, out=ordered)
        target.add_(ordered)


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
             b_sections: Sequence[torch.Tensor], sections: Sequence[Tuple[int, int]], rank: int,
             info: Optional[LoRABatchInfo], b_kernel: Optional[torch.Tensor] = None,
             sections_t: Optional[torch.Tensor] = None) -> None:
    if info is None or not info.has_lora:
        return
    if backend == "triton":
        lora_triton(x, out, a, b, sections, rank, info)
    elif info.kernel_slots is not None:
        # the manager asks for kernel_slots only where the kernel is loaded and takes the model's dtype
        lib = library.lora()
        assert lib is not None and b_kernel is not None and sections_t is not None
        x = x if x.stride(-1) == 1 else x.contiguous()
        lora_kernel(lib, x, out, a, b_kernel, sections_t, rank, info.kernel_slots, kernel_threads(x.shape[0]))
    else:
        assert info.native is not None  # the manager builds it for the native backend
        lora_native(x, out, a, b_sections, sections, rank, info.native)
