"""Large read-mostly CPU buffers (the packed decode weights) on transparent huge pages.

A decode step streams every weight once. With 4 KiB pages the ~220 MB of a small model's linears
are ~55k pages, far more than the TLB holds: every page is a walk, and the hardware prefetchers stop
at each page boundary. On 2 MiB pages the same stream is ~110 pages. Measured on the 2-core AMD
EPYC (Zen 4, 2026-12-02): a plain 2-thread read of 233 MB 20 -> 30 GB/s; the bf16 linear kernel
over a model's worth of packed weights at 1 row 25 -> 30-33 GB/s, at 16 rows 250-280 -> 300-345
GFLOP/s. The kernel's madvise must precede the first touch (pages faulted in before it stay small),
so the buffer is a fresh anonymous mapping aligned to 2 MiB. Where the kernel offers no
transparent huge pages (`never`, another OS) the mapping is an ordinary one; `ENGINE_CPU_HUGE_PAGES=0`
turns the whole thing off (plain `torch.empty`).
"""

from __future__ import annotations

import mmap
import os

import torch

HUGE_PAGE = 2 << 20
ENABLED = os.environ.get("ENGINE_CPU_HUGE_PAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of `numel` elements, on huge pages where it is large enough
    (at least one huge page) and the system allows it; else `torch.empty`."""
    nbytes = numel * dtype.itemsize
    if not ENABLED or nbytes < HUGE_PAGE:
        return torch.empty(numel, dtype=dtype)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    # One huge page of slack for the alignment: the part before the aligned start is never touched,
    # so it costs address space, not memory.
    buf = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(buf, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = (-whole.data_ptr()) % HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, size)
    except OSError:  # THP disabled or unsupported: ordinary pages, still a correct buffer
        pass
    return whole[start:start + nbytes].view(dtype)
