"""The native LoRA kernel (csrc/lora_delta.c) against the delta computed row by row in float64, and against
the torch path (backend.lora_native) on the same rows: float32 and bfloat16 activations and weights, one
and two threads, rows of slot 0 untouched, widths and input sizes that leave vector tails."""

from __future__ import annotations

import shutil
from typing import List, Sequence, Tuple

import pytest
import torch

from engine.kernels import library
from engine.lora import backend

pytestmark = pytest.mark.skipif(not (shutil.which("gcc") or shutil.which("cc")), reason="no C compiler")


def _lib():
    lib = library.lora()
    assert lib is not None, "a C compiler is present but the kernels did not build (see the log)"
    return lib


def _operands(slots: int, rank: int, k: int, sections: Sequence[Tuple[int, int]], rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    n = sum(size for _, size in sections)
    a = torch.randn(slots, len(sections) * rank, k, generator=gen)
    b = torch.randn(slots, n, rank, generator=gen)
    a[0].zero_()
    b[0].zero_()
    scalings = torch.rand(slots, generator=gen) + 0.5
    scalings[0] = 0.0
    x = torch.randn(rows, k, generator=gen)
    base = torch.randn(rows, n, generator=gen)
    return a, b, scalings, x, base


def _reference(x: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor,
               sections: Sequence[Tuple[int, int]], rank: int, row_slots: List[int]) -> torch.Tensor:
    """out += delta row by row, in float64 from the operands as the kernel sees them."""
    want = base.double().clone()
    for t, s in enumerate(row_slots):
        if s == 0:
            continue
        shrink = a[s].double() @ x[t].double()
        for i, (off, size) in enumerate(sections):
            want[t, off:off + size] += (b[s, off:off + size].double() @ shrink[i * rank:(i + 1) * rank]) * float(
                scalings[s])
    return want


# (row slots, k, sections, rank): decode rows of 4 adapters interleaved with base rows (tiles of 4 and a
# partial one per slot); one row; k, section widths and a stacked rank (3 x 5) that are not multiples of 8
# or 2 (the scalar tails); a slot with more rows than a tile; an unfused projection (one section).
_CASES = {
    "decode": ([1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 1, 2, 3, 1, 1, 1], 64, [(0, 48), (48, 16), (64, 16)], 8),
    "one-row": ([3], 64, [(0, 32), (32, 16), (48, 16)], 16),
    "tails": ([2, 0, 2, 1, 4, 4, 4, 4, 4, 4, 1], 37, [(0, 19), (19, 5), (24, 13)], 5),
    "unfused": ([1, 0, 2, 3, 1, 1, 4, 0], 40, [(0, 56)], 8),
    "all-base": ([0, 0, 0], 16, [(0, 16)], 4),
}


@pytest.mark.parametrize("case", sorted(_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_equals_a_per_row_reference(case, dtype, w_dtype, threads):
    row_slots, k, sections, rank = _CASES[case]
    a, b, scalings, x, base = _operands(5, rank, k, sections, len(row_slots), seed=len(row_slots) + k)
    a, b_full = a.to(w_dtype), backend.kernel_b(b, rank, scalings).to(w_dtype)
    # what the kernel reads: the weights rounded to w_dtype, x and out to dtype
    b_seen = b_full.float().transpose(1, 2)
    xs, out = x.to(dtype), base.to(dtype)
    want = _reference(xs, out, a.float(), b_seen, torch.ones_like(scalings), sections, rank, row_slots)
    slots = torch.tensor(row_slots, dtype=torch.int64)
    assert backend.kernel_takes(xs, out, a, b_full)
    backend.lora_kernel(_lib(), xs, out, a, b_full, backend.sections_tensor(sections), rank, slots, threads)
    base_rows = [t for t, s in enumerate(row_slots) if s == 0]
    assert torch.equal(out[base_rows], base.to(dtype)[base_rows])  # rows of slot 0 keep their bits
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)
    else:  # one rounding of the sum to bfloat16: within half an ulp of the exact value (plus float32 noise)
        err = (out.double() - want).abs()
        ulp = want.abs().clamp_min(1e-30) * 2.0 ** -7
        assert bool((err <= 0.5 * ulp + 1e-4).all()), float((err - 0.5 * ulp).max())


def test_kernel_reads_strided_rows_and_writes_only_its_columns():
    """x and out as row slices of wider buffers (a projection's input inside a fused tensor): the kernel
    follows the row strides and leaves the columns past its width alone."""
    row_slots, k, sections = [1, 0, 2, 2, 1], 24, [(0, 16), (16, 8)]
    rank = 4
    a, b, scalings, x, base = _operands(3, rank, k, sections, len(row_slots), seed=7)
    wide_x = torch.cat([x, torch.randn(len(row_slots), 5)], dim=1)
    wide_out = torch.cat([base, torch.full((len(row_slots), 3), 7.0)], dim=1)
    xs, out = wide_x[:, :k], wide_out[:, :24]
    b_full = backend.kernel_b(b, rank, scalings)
    want = _reference(x, base, a, b, scalings, sections, rank, row_slots)
    backend.lora_kernel(_lib(), xs, out, a, b_full, backend.sections_tensor(sections), rank,
                        torch.tensor(row_slots, dtype=torch.int64), 1)
    torch.testing.assert_close(wide_out[:, :24].double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(wide_out[:, 24:], torch.full((len(row_slots), 3), 7.0))


def test_kernel_refuses_slots_and_sections_out_of_range():
    row_slots, k, sections = [1, 2], 16, [(0, 16)]
    a, b, scalings, x, base = _operands(3, 4, k, sections, 2, seed=3)
    b_full = backend.kernel_b(b, 4, scalings)
    out = base.clone()
    with pytest.raises(ValueError):
        backend.lora_kernel(_lib(), x, out, a, b_full, backend.sections_tensor(sections), 4,
                            torch.tensor([1, 3], dtype=torch.int64), 1)
    with pytest.raises(ValueError):
        backend.lora_kernel(_lib(), x, out, a, b_full, backend.sections_tensor([(8, 16)]), 4,
                            torch.tensor(row_slots, dtype=torch.int64), 1)
    assert torch.equal(out, base)  # nothing written
