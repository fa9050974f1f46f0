"""The hybrid sliding-window allocator (mem_cache/swa_pool.py) at page sizes 1, 4 and 16 against a brute-force
model of what each request may still read: random sequences of prefills (chunked, ending mid-page),
decodes, speculative drafts then rejected, transfers received (PD) and finishes. After every step:

- every position a request may still read (from the read start of its previous batch, which a forward in
  flight under overlap may still read, to its end) has a windowed slot, on the windowed page that its
  full page maps to, at the same offset; no windowed page is mapped by two full pages (so none was freed
  while in use and handed out again);
- every page wholly below the read start of the previous batch is released (the windowed pool holds a
  bounded window per request), and the pool's free count equals its pages minus the mapped ones;
- at the end, with every request finished, both pools are whole.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch

from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.swa_pool import SWAKVPool, SWATokenToKVPoolAllocator

SIZE, SWA_SIZE, ROWS, CONTEXT = 2048, 1024, 6, 512


@dataclass
class _Req:
    row: int
    length: int = 0
    read_start: int = 0  # the newest batch's first read position
    prev_read_start: int = 0  # the batch before it (may be in flight)


def _make(page: int, window: int):
    pool = SWAKVPool(SIZE, SWA_SIZE, [1], torch.float32, 1, 2, 2, "cpu", page_size=page)
    allocator = SWATokenToKVPoolAllocator(SIZE, SWA_SIZE, window, ROWS, torch.float32, "cpu", pool, page_size=page)
    return allocator, ReqToTokenPool(ROWS, CONTEXT, "cpu")


def _i64(values: List[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class _Model:
    def __init__(self, page: int, window: int) -> None:
        self.page, self.window = page, window
        self.allocator, self.rows = _make(page, window)
        self.table = self.rows.req_to_token
        self.reqs: Dict[int, _Req] = {}

    def _before_batch(self, req: _Req, first: int, fresh: bool) -> None:
        self.allocator.release_out_of_window([req.row], [first], [0], [fresh], self.table)
        req.prev_read_start = req.read_start
        req.read_start = max(req.read_start, first - self.window + 1, 0)

    def _last_loc(self, req: _Req) -> int:
        return int(self.table[req.row, req.length - 1]) if req.length else -1

    def extend(self, req: _Req, n: int, fresh: bool = False) -> None:
        self._before_batch(req, req.length, fresh)
        out = self.allocator.alloc_extend(_i64([req.length]), _i64([req.length + n]), _i64([self._last_loc(req)]), n)
        assert out is not None
        self.table[req.row, req.length:req.length + n] = out.to(torch.int32)
        req.length += n

    def decode(self, req: _Req, drafts: int, kept: int) -> None:
        """A decode slot, `drafts` draft slots after it, then all but `kept` of them rejected."""
        self._before_batch(req, req.length, False)
        if self.page == 1:
            out = self.allocator.alloc(1)
        else:
            out = self.allocator.alloc_decode(_i64([req.length + 1]), _i64([self._last_loc(req)]))
        assert out is not None
        self.table[req.row, req.length] = out.to(torch.int32)
        req.length += 1
        if drafts:
            start = req.length
            more = self.allocator.alloc_extend(_i64([start]), _i64([start + drafts]), _i64([self._last_loc(req)]),
                                               drafts)
            assert more is not None
            self.table[req.row, start:start + drafts] = more.to(torch.int32)
            # As ScheduleBatch.keep_verified: the pages past the kept positions go back.
            end, new_len = start + drafts, start + kept
            first_free = -(-new_len // self.page) * self.page
            if first_free < end:
                self.allocator.free(self.table[req.row, first_free:end].long())
            req.length = new_len

    def new_request(self, rng: random.Random) -> None:
        rows = self.rows.alloc(1)
        assert rows is not None
        req = _Req(rows[0])
        self.reqs[req.row] = req
        if rng.random() < 0.25:  # its KV arrives by transfer: windowed pages for its last window only
            n = rng.randint(1, 200)
            out = self.allocator.alloc_received(req.row, n)
            assert out is not None
            self.table[req.row, :n] = out.to(torch.int32)
            req.length = n
            req.read_start = req.prev_read_start = max(n - self.window, 0)
            return
        self.extend(req, rng.randint(1, 90), fresh=True)

    def finish(self, req: _Req) -> None:
        self.allocator.free(self.table[req.row, :req.length].long())
        self.rows.free(req.row)
        del self.reqs[req.row]

    def check(self) -> None:
        page, allocator = self.page, self.allocator
        mapped_pages: List[int] = []
        for req in self.reqs.values():
            slots = self.table[req.row, :req.length].long()
            swa = allocator.full_to_swa[slots]
            visible = swa[req.prev_read_start:]
            assert bool((visible != 0).all()), f"a position still read lost its windowed slot: {req}"
            assert bool(((visible % page) == (slots[req.prev_read_start:] % page)).all())
            # Released: every page wholly below the previous batch's read start.
            below = (req.prev_read_start // page) * page
            assert bool((swa[:below] == 0).all()), f"a page out of every window is still held: {req}"
            held = swa[swa != 0]
            mapped_pages.extend(torch.unique(held // page).tolist())
        assert len(mapped_pages) == len(set(mapped_pages)), "one windowed page mapped by two full pages"
        assert allocator.swa_available_size() == SWA_SIZE - len(mapped_pages) * page


@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_paged_windowed_pages_against_a_model_of_what_is_read(page, seed):
    rng = random.Random(seed * 31 + page)
    model = _Model(page, window=rng.choice([1, 5, 16, 64]))
    for _ in range(400):
        op = rng.random()
        if not model.reqs or (op < 0.12 and len(model.reqs) < ROWS):
            model.new_request(rng)
        elif op < 0.2:
            model.finish(rng.choice(list(model.reqs.values())))
        else:
            req = rng.choice(list(model.reqs.values()))
            if req.length > CONTEXT - 64:
                model.finish(req)
            elif op < 0.35:
                model.extend(req, rng.randint(1, 40))  # a later chunk, starting mid-page
            else:
                drafts = rng.choice([0, 0, 3, 7])
                model.decode(req, drafts, rng.randint(0, drafts))
        model.check()
    for req in list(model.reqs.values()):
        model.finish(req)
    assert model.allocator.swa_available_size() == SWA_SIZE
    assert model.allocator.available_size() == SIZE
    assert bool((model.allocator.full_to_swa == 0).all())


def test_windowed_pool_short_takes_nothing_from_either_pool():
    """The windowed pool runs out first: the allocation fails whole, the full pool keeps its pages."""
    pool = SWAKVPool(256, 32, [1], torch.float32, 1, 2, 2, "cpu", page_size=16)
    allocator = SWATokenToKVPoolAllocator(256, 32, 16, 2, torch.float32, "cpu", pool, page_size=16)
    first = allocator.alloc_extend(_i64([0]), _i64([20]), _i64([-1]), 20)
    assert first is not None and allocator.swa_available_size() == 0
    assert allocator.alloc_extend(_i64([0]), _i64([5]), _i64([-1]), 5) is None
    assert allocator.available_size() == 256 - 32
    # Continuing the partly used second page needs no new windowed page.
    more = allocator.alloc_extend(_i64([20]), _i64([30]), _i64([int(first[-1])]), 10)
    assert more is not None and bool((allocator.full_to_swa[more] != 0).all())
    allocator.free(torch.cat((first, more)))
    assert allocator.available_size() == 256 and allocator.swa_available_size() == 32
