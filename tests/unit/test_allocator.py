"""KV slot allocators: accounting, page alignment, exhaustion, and misuse detection."""

from __future__ import annotations

import random
from typing import Dict, List

import pytest
import torch

from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator


def make_allocator(size: int, page_size: int):
    if page_size == 1:
        return TokenToKVPoolAllocator(size, torch.float16, "cpu", None)
    return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None)


# ---------------------------------------------------------------- page size 1


def test_page1_alloc_free_accounting():
    alloc = make_allocator(10, 1)
    assert alloc.page_size == 1 and alloc.size == 10 and alloc.available_size() == 10
    a = alloc.alloc(4)
    b = alloc.alloc(6)
    assert a.dtype == torch.int64 and a.numel() == 4 and b.numel() == 6
    got = sorted(torch.cat((a, b)).tolist())
    assert got == list(range(1, 11)), "slot 0 is never handed out and every slot is handed out once"
    assert alloc.available_size() == 0
    assert alloc.alloc(1) is None
    alloc.free(a[1:3])
    assert alloc.available_size() == 2
    again = alloc.alloc(2)
    assert sorted(again.tolist()) == sorted(a[1:3].tolist())
    assert alloc.alloc(0).numel() == 0


def test_page1_exhaustion_allocates_nothing():
    alloc = make_allocator(8, 1)
    alloc.alloc(5)
    assert alloc.alloc(4) is None
    assert alloc.available_size() == 3
    assert alloc.alloc_extend(torch.tensor([0]), torch.tensor([4]), torch.tensor([-1]), 4) is None
    assert alloc.alloc_decode(torch.tensor([3, 4, 5, 6]), torch.tensor([1, 2, 3, 4])) is None
    assert alloc.available_size() == 3


def test_page1_extend_and_decode_are_plain_allocs():
    alloc = make_allocator(16, 1)
    ext = alloc.alloc_extend(torch.tensor([0, 2]), torch.tensor([3, 5]), torch.tensor([-1, 7]), 6)
    assert ext.numel() == 6
    dec = alloc.alloc_decode(torch.tensor([4, 6]), torch.tensor([3, 9]))
    assert dec.numel() == 2
    assert len(set(ext.tolist()) | set(dec.tolist())) == 8
    assert alloc.available_size() == 8


@pytest.mark.parametrize("bad", [0, 11, -1])
def test_page1_foreign_index_rejected(bad):
    alloc = make_allocator(10, 1)
    alloc.alloc(10)
    with pytest.raises(ValueError, match=f"slot {bad}"):
        alloc.free(torch.tensor([bad]))
    assert alloc.available_size() == 0


def test_page1_double_free_rejected():
    alloc = make_allocator(10, 1)
    slots = alloc.alloc(3)
    alloc.free(slots[:1])
    with pytest.raises(ValueError, match=f"slot {int(slots[0])} is already free"):
        alloc.free(slots[:2])
    # The failed call freed nothing.
    assert alloc.available_size() == 8
    with pytest.raises(ValueError, match="double free"):
        alloc.free(torch.stack((slots[1], slots[1])))
    assert alloc.available_size() == 8


def test_page1_free_group_batches_and_catches_cross_call_double_free():
    alloc = make_allocator(10, 1)
    slots = alloc.alloc(6)
    alloc.free_group_begin()
    alloc.free(slots[:2])
    alloc.free(slots[2:4].to(torch.int32))  # rows of req_to_token are int32
    assert alloc.available_size() == 4, "frees inside a group are applied at the end"
    alloc.free_group_end()
    assert alloc.available_size() == 8

    alloc.free_group_begin()
    alloc.free(slots[4:5])
    alloc.free(slots[4:6])
    with pytest.raises(ValueError, match=f"slot {int(slots[4])}"):
        alloc.free_group_end()


def test_page1_clear():
    alloc = make_allocator(10, 1)
    alloc.alloc(7)
    alloc.clear()
    assert alloc.available_size() == 10
    assert sorted(alloc.alloc(10).tolist()) == list(range(1, 11))


# ---------------------------------------------------------------- paged


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_alloc_whole_pages(page_size):
    pages = 5
    alloc = make_allocator(pages * page_size, page_size)
    assert alloc.available_size() == pages * page_size
    slots = alloc.alloc(2 * page_size)
    assert slots.numel() == 2 * page_size
    assert (slots % page_size == torch.arange(2 * page_size) % page_size).all()
    assert (slots >= page_size).all(), "page 0 is reserved"
    assert (slots < (pages + 1) * page_size).all()
    assert alloc.available_size() == 3 * page_size
    with pytest.raises(ValueError, match="multiple of page size"):
        alloc.alloc(page_size + 1)
    assert alloc.alloc(4 * page_size) is None
    assert alloc.available_size() == 3 * page_size


def test_paged_size_rounds_down_to_whole_pages():
    alloc = make_allocator(70, 16)
    assert alloc.size == 64 and alloc.available_size() == 64


class ReqSim:
    """Slots of one simulated request, position by position."""

    def __init__(self) -> None:
        self.slots: List[int] = []


def check_alignment(reqs: List[ReqSim], page_size: int) -> None:
    owner: Dict[int, int] = {}
    for r, req in enumerate(reqs):
        for pos, slot in enumerate(req.slots):
            assert slot % page_size == pos % page_size, f"req {r} pos {pos} got slot {slot}"
            # All positions of one logical page share one physical page.
            first = req.slots[pos - pos % page_size]
            assert slot // page_size == first // page_size
            page = slot // page_size
            assert page != 0
            assert owner.setdefault(page, r) == r, f"page {page} shared by two requests"
        assert len(set(req.slots)) == len(req.slots)


def extend_batch(alloc, reqs: List[ReqSim], new_lens: List[int]):
    prefix = torch.tensor([len(r.slots) for r in reqs])
    seq = prefix + torch.tensor(new_lens)
    last = torch.tensor([r.slots[-1] if r.slots else -1 for r in reqs])
    out = alloc.alloc_extend(prefix, seq, last, sum(new_lens))
    if out is None:
        return None
    assert out.dtype == torch.int64 and out.numel() == sum(new_lens)
    start = 0
    for req, n in zip(reqs, new_lens):
        req.slots.extend(out[start:start + n].tolist())
        start += n
    return out


def decode_batch(alloc, reqs: List[ReqSim]):
    seq = torch.tensor([len(r.slots) + 1 for r in reqs])
    last = torch.tensor([r.slots[-1] if r.slots else -1 for r in reqs])
    out = alloc.alloc_decode(seq, last)
    if out is None:
        return None
    for req, slot in zip(reqs, out.tolist()):
        req.slots.append(slot)
    return out


def pages_in_use(reqs: List[ReqSim], page_size: int) -> int:
    return sum((len(r.slots) + page_size - 1) // page_size for r in reqs)


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_and_decode_keep_positions_aligned(page_size):
    rng = random.Random(page_size)
    num_pages = 200
    alloc = make_allocator(num_pages * page_size, page_size)
    reqs = [ReqSim() for _ in range(6)]
    # Chunks of odd lengths leave prefixes ending mid-page; decode steps then cross page ends.
    for _ in range(4):
        assert extend_batch(alloc, reqs, [rng.randint(1, 2 * page_size + 3) for _ in reqs]) is not None
        check_alignment(reqs, page_size)
        for _ in range(rng.randint(1, page_size + 2)):
            assert decode_batch(alloc, reqs) is not None
        check_alignment(reqs, page_size)
        used = pages_in_use(reqs, page_size)
        assert alloc.available_size() == (num_pages - used) * page_size
    for req in reqs:
        alloc.free(torch.tensor(req.slots))
    assert alloc.available_size() == num_pages * page_size


def test_extend_fills_partial_page_before_new_pages():
    alloc = make_allocator(64, 4)
    req = ReqSim()
    extend_batch(alloc, [req], [6])  # positions 0..5: one full page + half of the next
    page_of_pos4 = req.slots[4] // 4
    before = alloc.available_size()
    extend_batch(alloc, [req], [3])  # positions 6,7 fill that page, 8 opens a new one
    assert req.slots[6] == req.slots[5] + 1 and req.slots[7] == req.slots[5] + 2
    assert req.slots[6] // 4 == page_of_pos4
    assert req.slots[8] % 4 == 0
    assert alloc.available_size() == before - 4


def test_decode_opens_page_only_at_page_boundary():
    alloc = make_allocator(64, 4)
    a, b = ReqSim(), ReqSim()
    extend_batch(alloc, [a, b], [4, 2])
    before = alloc.available_size()
    out = decode_batch(alloc, [a, b])  # a: position 4 opens a page; b: position 2 continues
    assert out[1].item() == b.slots[1] + 1
    assert out[0].item() % 4 == 0 and out[0].item() // 4 != a.slots[3] // 4
    assert alloc.available_size() == before - 4


def test_decode_batch_of_256_matches_per_request_rule():
    page_size = 16
    alloc = make_allocator(1024 * page_size, page_size)
    rng = random.Random(0)
    reqs = [ReqSim() for _ in range(256)]
    extend_batch(alloc, reqs, [rng.randint(1, 40) for _ in reqs])
    for _ in range(20):
        lens_before = [len(r.slots) for r in reqs]
        prev_last = [r.slots[-1] for r in reqs]
        decode_batch(alloc, reqs)
        for req, n, last in zip(reqs, lens_before, prev_last):
            expected_new_page = n % page_size == 0
            assert (req.slots[-1] % page_size == 0) == expected_new_page
            if not expected_new_page:
                assert req.slots[-1] == last + 1
    check_alignment(reqs, page_size)


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_exhaustion_allocates_nothing(page_size):
    alloc = make_allocator(4 * page_size, page_size)
    a, b = ReqSim(), ReqSim()
    extend_batch(alloc, [a], [3 * page_size - 1])
    before = alloc.available_size()
    assert before == page_size
    # a fits in its partial page, b needs two fresh pages: one is missing -> nothing allocated.
    assert extend_batch(alloc, [a, b], [1, page_size + 1]) is None
    assert alloc.available_size() == before and len(a.slots) == 3 * page_size - 1
    assert extend_batch(alloc, [a, b], [1, page_size]) is not None
    assert alloc.available_size() == 0
    assert decode_batch(alloc, [a, b]) is None  # both need a fresh page
    assert alloc.available_size() == 0
    check_alignment([a, b], page_size)


def test_paged_free_by_page_and_misuse():
    page_size = 4
    alloc = make_allocator(40, page_size)
    slots = alloc.alloc(12)  # three pages
    # Several slots of one page in one call free that page once.
    alloc.free(slots[0:3])
    assert alloc.available_size() == 28 + 4
    page = int(slots[0]) // page_size
    with pytest.raises(ValueError, match=f"page {page} .*already free"):
        alloc.free(slots[3:4])
    with pytest.raises(ValueError, match="slot 2 "):
        alloc.free(torch.tensor([2]))  # page 0 is reserved
    with pytest.raises(ValueError, match="slot 44 "):
        alloc.free(torch.tensor([44]))  # past the last page
    assert alloc.available_size() == 32

    alloc.free_group_begin()
    alloc.free(slots[4:6])
    alloc.free(slots[6:8])  # same page again in another call of the group
    with pytest.raises(ValueError, match="double free"):
        alloc.free_group_end()


def test_paged_free_group_releases_at_end():
    alloc = make_allocator(64, 16)
    a = alloc.alloc(16)
    b = alloc.alloc(32)
    alloc.free_group_begin()
    alloc.free(a)
    alloc.free(b[:1])
    alloc.free(b[16:])
    assert alloc.available_size() == 16
    alloc.free_group_end()
    assert alloc.available_size() == 64
    alloc.clear()
    assert alloc.available_size() == 64
