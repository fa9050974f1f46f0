"""Free-slot allocators over the KV pool: one slot at a time (page size 1) or whole pages.

The allocator only hands out *indices* into `MHATokenToKVPool`; it never touches K/V data.
Slot 0 (page 0 when paged) is never handed out: padded tokens write their dummy K/V there.

Every free is checked: a slot outside the pool, slot 0, or a slot that is already free raises
`ValueError` naming it. A double free is always a bookkeeping bug upstream, and letting it through
would hand the same slot to two requests later, which corrupts outputs silently.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch

from engine.mem_cache.memory_pool import MHATokenToKVPool

logger = logging.getLogger(__name__)


def _as_index(indices: torch.Tensor) -> torch.Tensor:
    # req_to_token rows are int32; the free lists and masks work in int64.
    return indices.reshape(-1).to(torch.int64)


class PagedTokenToKVPoolAllocator:
    """Allocator over whole pages of `page_size` slots; free pages are 1..size // page_size.

    Page p covers slots p*P .. p*P+P-1. Everything returned keeps `slot % P == position % P`, so
    the positions of one logical page of a request always share one physical page.
    `free_group_begin` / `free_group_end` batch many frees into one validated release.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Optional[MHATokenToKVPool] = None,
    ) -> None:
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"PagedTokenToKVPoolAllocator: page_size must be a power of two, got {page_size}")
        if size < page_size:
            raise ValueError(f"PagedTokenToKVPoolAllocator: size {size} is smaller than one page ({page_size})")
        self.page_size = page_size
        self.num_pages = size // page_size
        # A partial last page could never be handed out, so capacity is counted in whole pages;
        # this keeps `available + evictable + protected == size` exact at idle.
        self.size = self.num_pages * page_size
        if self.size != size:
            logger.warning("KV pool size %d is not a multiple of page size %d; using %d slots",
                           size, page_size, self.size)
        self.dtype = dtype
        self.device = device
        self._kvcache = kvcache
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        self.clear()

    def get_kvcache(self) -> Optional[MHATokenToKVPool]:
        return self._kvcache

    def clear(self) -> None:
        if self._kvcache is not None:
            self._kvcache.slots_released()
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        # is_free[p] mirrors membership of p in free_pages; page 0 is never free (reserved).
        self._is_free = torch.ones(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._is_free[0] = False
        self._in_free_group = False
        self._free_group: List[torch.Tensor] = []

    def available_size(self) -> int:
        return int(self.free_pages.numel()) * self.page_size

    def _take_pages(self, num_pages: int) -> Optional[torch.Tensor]:
        if num_pages > self.free_pages.numel():
            return None
        pages = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        self._is_free[pages] = False
        return pages

    def alloc(self, need: int) -> Optional[torch.Tensor]:
        if need < 0 or need % self.page_size:
            raise ValueError(f"alloc: need must be a non-negative multiple of page size {self.page_size}, got {need}")
        pages = self._take_pages(need // self.page_size)
        if pages is None:
            return None
        return (pages[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        """Slots for positions [prefix_len, seq_len) of every request, flat in request order.

        A request whose prefix ends mid-page first fills that page (`last_loc + 1, + 2, ...`),
        then takes fresh pages. Nothing is allocated when the free pages do not suffice.
        """
        page = self.page_size
        prefix_lens = prefix_lens.to(device=self.device, dtype=torch.int64)
        seq_lens = seq_lens.to(device=self.device, dtype=torch.int64)
        last_loc = last_loc.to(device=self.device, dtype=torch.int64)
        batch = prefix_lens.numel()
        if extend_num_tokens == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)

        # Position p lives on logical page p // P; positions below ceil(prefix/P)*P share the
        # request's partially used last page, the others need fresh pages.
        prefix_pages = (prefix_lens + page - 1) // page
        new_pages_per_req = (seq_lens + page - 1) // page - prefix_pages
        total_new_pages = int(new_pages_per_req.sum().item())
        pages = self._take_pages(total_new_pages)
        if pages is None:
            return None

        extend_lens = seq_lens - prefix_lens
        req_of_token = torch.repeat_interleave(
            torch.arange(batch, device=self.device), extend_lens, output_size=extend_num_tokens
        )
        token_starts = torch.cumsum(extend_lens, 0) - extend_lens
        offset_in_req = torch.arange(extend_num_tokens, device=self.device) - token_starts[req_of_token]
        positions = prefix_lens[req_of_token] + offset_in_req

        in_partial_page = positions < prefix_pages[req_of_token] * page
        slot_in_partial = last_loc[req_of_token] + offset_in_req + 1

        first_new_page = torch.cumsum(new_pages_per_req, 0) - new_pages_per_req
        page_idx = first_new_page[req_of_token] + positions // page - prefix_pages[req_of_token]
        # Tokens on the partial page compute a meaningless page_idx; clamp so the gather is safe.
        page_idx = page_idx.clamp(0, max(total_new_pages - 1, 0))
        if total_new_pages:
            slot_in_new = pages[page_idx] * page + positions % page
        else:
            slot_in_new = slot_in_partial
        return torch.where(in_partial_page, slot_in_partial, slot_in_new)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> Optional[torch.Tensor]:
        """One slot per request for position seq_len - 1 (seq_lens already include the new token)."""
        seq_lens = seq_lens.to(device=self.device, dtype=torch.int64)
        last_loc = last_loc.to(device=self.device, dtype=torch.int64)
        opens_page = (seq_lens - 1) % self.page_size == 0
        num_new = int(opens_page.sum().item())
        pages = self._take_pages(num_new)
        if pages is None:
            return None
        if num_new == 0:
            return last_loc + 1
        page_idx = (torch.cumsum(opens_page.to(torch.int64), 0) - 1).clamp(min=0)
        return torch.where(opens_page, pages[page_idx] * self.page_size, last_loc + 1)

    def release_out_of_window(self, rows: List[int], first_positions: List[int], owned_from: List[int],
                              fresh: List[bool], req_to_token: torch.Tensor) -> None:
        """Before a batch allocates: release what its requests' windows left behind. Nothing here (one
        pool keeps every token); the hybrid sliding-window allocator (swa_pool.py) does."""

    def keep_last_window(self, row: int, length: int, owned_from: int, req_to_token: torch.Tensor) -> None:
        """A request that runs no more batches but keeps its KV (a PD prefill sending it): release what its
        next query would not read. Nothing here (one pool keeps every token); swa_pool.py does."""

    def windowed_shortfall(self, num_tokens: int) -> int:
        """Windowed-layer slots missing for `num_tokens` new tokens: none with one pool (swa_pool.py has
        a second one, which the prefix cache's evict_windowed refills)."""
        return 0

    def free(self, indices: torch.Tensor) -> None:
        """Free the pages holding `indices` (each page once, however many of its slots are given)."""
        if indices.numel() == 0:
            return
        pages = self._pages_of(_as_index(indices))
        if self._in_free_group:
            self._free_group.append(pages)
            return
        self._release(pages)

    def free_group_begin(self) -> None:
        self._in_free_group = True
        self._free_group = []

    def free_group_end(self) -> None:
        self._in_free_group = False
        group, self._free_group = self._free_group, []
        if group:
            # One validated release for the whole group: duplicates across the group's calls are
            # caught here as double frees.
            self._release(torch.cat(group))

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        foreign = (slots < self.page_size) | (slots >= (self.num_pages + 1) * self.page_size)
        if bool(foreign.any()):
            bad = int(slots[foreign][0].item())
            raise ValueError(f"free: slot {bad} (page {bad // self.page_size}) is not a slot of this pool "
                             f"(pages 1..{self.num_pages}, page size {self.page_size})")
        return torch.unique(slots // self.page_size)

    def _describe(self, page: int) -> str:
        return f"page {page} (slots {page * self.page_size}..{page * self.page_size + self.page_size - 1})"

    def _release(self, pages: torch.Tensor) -> None:
        _check_releasable(pages, self._is_free, unit="page" if self.page_size > 1 else "slot",
                          describe=self._describe)
        self._is_free[pages] = True
        self.free_pages = torch.cat((self.free_pages, pages))
        if self._kvcache is not None:
            self._kvcache.slots_released((pages[:, None] * self.page_size + self._page_offsets).reshape(-1))


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Page size 1: a page is a slot (free slots are 1..size).

    Any slot fits any position, so extend and decode take slots straight off the free list, and
    a slot given twice in one free is a double free (with bigger pages it is just two slots of
    one page).
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        device: str,
        kvcache: Optional[MHATokenToKVPool] = None,
    ) -> None:
        if size < 1:
            raise ValueError(f"TokenToKVPoolAllocator: size must be >= 1, got {size}")
        super().__init__(size, 1, dtype, device, kvcache)

    def alloc(self, need: int) -> Optional[torch.Tensor]:
        if need < 0:
            raise ValueError(f"alloc: need must be >= 0, got {need}")
        return self._take_pages(need)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> Optional[torch.Tensor]:
        return self.alloc(extend_num_tokens)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> Optional[torch.Tensor]:
        return self.alloc(int(seq_lens.numel()))

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        return slots  # range, reserved-slot and duplicate checks happen in _release

    def _describe(self, slot: int) -> str:
        return f"slot {slot}"


def _check_releasable(
    units: torch.Tensor, is_free: torch.Tensor, unit: str, describe: Callable[[int], str]
) -> None:
    """Raise ValueError for reserved/out-of-range units, units already free, or duplicates."""
    out_of_range = (units < 1) | (units >= is_free.numel())
    if bool(out_of_range.any()):
        bad = int(units[out_of_range][0].item())
        raise ValueError(f"free: {describe(bad)} is not a {unit} of this pool (valid 1..{is_free.numel() - 1})")
    already_free = is_free[units]
    if bool(already_free.any()):
        bad = int(units[already_free][0].item())
        raise ValueError(f"free: {describe(bad)} is already free (double free)")
    sorted_units, _ = torch.sort(units)
    repeated = sorted_units[1:] == sorted_units[:-1]
    if bool(repeated.any()):
        bad = int(sorted_units[1:][repeated][0].item())
        raise ValueError(f"free: {describe(bad)} is freed twice in one batch (double free)")
