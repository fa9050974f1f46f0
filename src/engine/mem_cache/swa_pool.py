"""The hybrid KV pool of sliding-window models (SGLang's SWAKVPool / SWATokenToKVPoolAllocator design,
simplified): full-attention layers keep every token in the full pool; windowed layers keep their K/V in
a second, smaller pool, holding for each request only the positions a later query can still see.

Slots are named by the full pool: `req_to_token` holds full slots, and `full_to_swa[full slot]` is the
windowed layers' slot of the same token (0: none, the padding slot). The allocator hands out a slot of
each pool per token, frees both with the token, and frees the windowed slot alone once the token has
left the window of every windowed layer (`release_out_of_window`, called by ScheduleBatch before each
allocation). A request's batch B reads positions >= its read start (its first query's position minus
window - 1); the forward of its previous batch may still run (overlap) and read from that batch's read
start, so what is released at B is everything below the previous batch's read start. Positions below
the request's cache-protected length belong to the prefix cache (SWARadixCache, swa_radix_cache.py),
which frees their windowed slots itself (tombstones), so a request never releases those.

Used where nothing else reads windowed layers' K/V by full slot: the torch_native backend (its windowed
path translates slots with `kv_slots`) and the Triton one (its kernels load `slot_map` entries), PD
transfer (kv_io.py gathers and scatters through `kv_slots`: positions without a windowed slot read and
write the padding slot, and a receiving decode server holds windowed slots for the last window only,
`alloc_received`), NGRAM speculative decoding (drafts take slots of both pools through `alloc`, rejected
ones free both), any page size: both pools are paged with the server's page size, a full page maps to one
windowed page (offsets kept), and a windowed page is released only once every position on it has left the
window (SGLang's paged SWATokenToKVPoolAllocator does the same).
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import MHATokenToKVPool


class SWAKVPool(MHATokenToKVPool):
    """Per-layer K/V buffers: `size` slots for full layers, `swa_size` for the windowed ones."""

    def __init__(self, size: int, swa_size: int, windowed_layers: Sequence[int], dtype: torch.dtype, head_num: int,
                 head_dim: int, layer_num: int, device: str = "cpu", k_scales: Optional[Sequence[float]] = None,
                 v_scales: Optional[Sequence[float]] = None, page_size: int = 1) -> None:
        self.swa_size = swa_size
        self.windowed_layers = frozenset(windowed_layers)
        # Until the allocator binds its map: every full slot maps to the padding slot.
        self._full_to_swa = torch.zeros(size + page_size, dtype=torch.int64, device=device)
        super().__init__(size, page_size, dtype, head_num, head_dim, layer_num, device, k_scales, v_scales)

    def use_slot_map(self, full_to_swa: torch.Tensor) -> None:
        """The allocator's map (it alone writes it); read here to place and find windowed K/V."""
        self._full_to_swa = full_to_swa

    def _create_buffers(self) -> None:
        self.slots_released()
        self.k_buffer, self.v_buffer = [], []
        for layer in range(self.layer_num):
            rows = (self.swa_size if layer in self.windowed_layers else self.size) + self.page_size
            shape = (rows, self.head_num, self.head_dim)
            self.k_buffer.append(torch.zeros(shape, dtype=self.dtype, device=self.device))
            self.v_buffer.append(torch.zeros(shape, dtype=self.dtype, device=self.device))

    def slot_map(self, layer_id: int) -> Optional[torch.Tensor]:
        return self._full_to_swa if layer_id in self.windowed_layers else None

    def kv_slots(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        if layer_id in self.windowed_layers:
            return self._full_to_swa[slots.long()]
        return slots

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        super().set_kv_buffer(layer_id, self.kv_slots(layer_id, loc), cache_k, cache_v)

    def bytes_per_token(self) -> int:
        """Of the full pool's layers (what a full slot costs); the windowed layers' pool is apart."""
        full_layers = self.layer_num - len(self.windowed_layers)
        return 2 * full_layers * self.head_num * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()


class SWATokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Full pages as PagedTokenToKVPoolAllocator, each with a windowed page from a second free list.

    Pages of both pools have the server's page size and a full page is mapped to a windowed page whole
    (slot offsets kept: `full_to_swa[p * P + o] == q * P + o`), so everything here moves whole pages:
    a windowed page is released only once every position on it has left the window."""

    def __init__(self, size: int, swa_size: int, window: int, num_rows: int, dtype: torch.dtype, device: str,
                 kvcache: SWAKVPool, page_size: int = 1) -> None:
        if window < 1 or swa_size < page_size:
            raise ValueError(f"SWATokenToKVPoolAllocator: window {window} must be >= 1 and swa_size {swa_size} "
                             f"at least one page ({page_size})")
        self.window = window
        self.swa = (TokenToKVPoolAllocator(swa_size, dtype, device) if page_size == 1
                    else PagedTokenToKVPoolAllocator(swa_size, page_size, dtype, device))
        # Slot level (what the kernels and kv_io read); the padding page maps to the padding slot.
        self.full_to_swa = torch.zeros((size // page_size + 1) * page_size, dtype=torch.int64, device=device)
        # Per request row: the read start of its last batch, and how far its windowed pages are released.
        self._read_floor = [0] * (num_rows + 1)
        self._released_upto = [0] * (num_rows + 1)
        super().__init__(size, page_size, dtype, device, kvcache)
        kvcache.use_slot_map(self.full_to_swa)

    def clear(self) -> None:
        super().clear()  # the base constructor calls this too: every part below exists by then
        self.swa.clear()
        self.full_to_swa.zero_()
        self._read_floor = [0] * len(self._read_floor)
        self._released_upto = [0] * len(self._released_upto)

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def _floor(self, n: int) -> int:
        return n - n % self.page_size

    def _ceil(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def read_floor(self, row: int) -> int:
        """The first position the newest batch prepared for `row` reads (what a forward of it still in
        flight under overlap may read; everything the row reads later lies above it)."""
        return self._read_floor[row]

    def keep_last_window(self, row: int, length: int, owned_from: int, req_to_token: torch.Tensor) -> None:
        """The windowed pages of the row's own positions below its last window go (no batch of it runs
        again, so nothing in flight reads them; a transfer reading them gets the padding row)."""
        upto = self._floor(max(length - self.window, 0))
        lo = self._ceil(max(self._released_upto[row], owned_from))
        if upto > lo:
            self._release_swa(req_to_token[row, lo:upto].long())
        self._released_upto[row] = max(self._released_upto[row], upto)

    def windowed_shortfall(self, num_tokens: int) -> int:
        return max(num_tokens - self.swa.available_size(), 0)

    def swa_held(self, full: torch.Tensor) -> torch.Tensor:
        """Per full slot: whether its windowed slot is still held (bool, same shape)."""
        return self.full_to_swa[full.long()] != 0

    def release_swa(self, full: torch.Tensor) -> None:
        """Free the windowed pages of these full slots' pages (the full pages stay allocated): the prefix
        cache tombstones a node (whole pages: its nodes are page aligned)."""
        if full.numel():
            self._release_swa(full.reshape(-1).long())

    def move_swa(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hand the windowed pages of full slots `src` to full slots `dst` (which hold none): the prefix
        cache revives a tombstoned node with a request's duplicate of it (whole pages, same offsets);
        `src` is freed afterwards."""
        src, dst = src.reshape(-1).long(), dst.reshape(-1).long()
        if bool((self.full_to_swa[dst] != 0).any()) or bool((self.full_to_swa[src] == 0).any()):
            raise ValueError("move_swa: the source must hold windowed slots and the destination none")
        if bool(((src % self.page_size) != (dst % self.page_size)).any()):
            raise ValueError("move_swa: source and destination slots must share their offsets in a page")
        self.full_to_swa[dst] = self.full_to_swa[src]
        self.full_to_swa[src] = 0

    def _map_fresh(self, full: torch.Tensor) -> bool:
        """Give every page among `full` that has no windowed page one; False (nothing taken) when the
        windowed pool is short."""
        full = full.reshape(-1).long()
        fresh = full[self.full_to_swa[full] == 0]
        if fresh.numel() == 0:
            return True
        pages = torch.unique(fresh // self.page_size)
        swa = self.swa.alloc(int(pages.numel()) * self.page_size)
        if swa is None:
            return False
        self.full_to_swa[(pages[:, None] * self.page_size + self._page_offsets).reshape(-1)] = swa
        return True

    def _with_windowed(self, full: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """`full` (just taken) once its new pages have windowed pages, else None with the full pages given
        back (the partially used page a request continues already has its windowed page)."""
        if full is None or full.numel() == 0:
            return full
        if self._map_fresh(full):
            return full
        fresh = full[self.full_to_swa[full.long()] == 0]
        super().free(fresh)
        return None

    def alloc_received(self, row: int, num_tokens: int) -> Optional[torch.Tensor]:
        """Full slots for positions [0, num_tokens) of a request whose KV arrives by transfer (PD decode,
        or a retraction backup coming back), with windowed pages for the pages of its last `window`
        positions only: the only ones its next query reads. Row `row` starts its release bookkeeping there."""
        one = torch.tensor([0], dtype=torch.int64)
        full = super().alloc_extend(one, torch.tensor([num_tokens], dtype=torch.int64), one - 1, num_tokens)
        if full is None or num_tokens == 0:
            return full
        tail_start = self._floor(max(num_tokens - self.window, 0))
        if not self._map_fresh(full[tail_start:]):
            super().free(full)
            return None
        self._read_floor[row] = self._released_upto[row] = tail_start
        return full

    def alloc(self, need: int) -> Optional[torch.Tensor]:
        return self._with_windowed(super().alloc(need))

    def alloc_extend(self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                     extend_num_tokens: int) -> Optional[torch.Tensor]:
        return self._with_windowed(super().alloc_extend(prefix_lens, seq_lens, last_loc, extend_num_tokens))

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> Optional[torch.Tensor]:
        return self._with_windowed(super().alloc_decode(seq_lens, last_loc))

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self._release_swa(indices.reshape(-1).long())
        super().free(indices)

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        # Page size 1: a slot given twice is a double free (TokenToKVPoolAllocator's check), not one page.
        return slots if self.page_size == 1 else super()._pages_of(slots)

    def _release_swa(self, full: torch.Tensor) -> None:
        """Free the windowed pages of the full pages holding `full` (those that still have one)."""
        page = self.page_size
        pages = torch.unique(full // page) if page > 1 else full
        firsts = pages * page
        held = self.full_to_swa[firsts] != 0
        if bool(held.any()):
            offsets = self._page_offsets
            self.swa.free((self.full_to_swa[firsts[held]][:, None] + offsets).reshape(-1))
            self.full_to_swa[(firsts[held][:, None] + offsets).reshape(-1)] = 0

    def release_out_of_window(self, rows: List[int], first_positions: List[int], owned_from: List[int],
                              fresh: List[bool], req_to_token: torch.Tensor) -> None:
        """Before a batch allocates: `first_positions[i]` is the first new position of the request in row
        rows[i] (its prefix length; seq_len - 1 for a decode), `owned_from[i]` where its own slots start
        (below: the prefix cache's), `fresh[i]` whether the request got that row for this batch. Releases
        the windowed pages of its own positions below the row's previous read start (whole pages only: a
        page goes once every position on it is out of the window), then records this batch's."""
        leaving: List[torch.Tensor] = []
        for row, first, own, new in zip(rows, first_positions, owned_from, fresh):
            if new:
                self._read_floor[row] = self._released_upto[row] = 0
            upto, lo = self._floor(self._read_floor[row]), self._ceil(max(self._released_upto[row], own))
            if upto > lo:
                leaving.append(req_to_token[row, lo:upto])
            self._released_upto[row] = max(self._released_upto[row], upto)
            self._read_floor[row] = max(self._read_floor[row], first - self.window + 1, 0)
        if leaving:  # one release for the batch (one device sync on the GPU, not one per request)
            self._release_swa(torch.cat(leaving).long())


def swa_pool_size(full_size: int, window: int, max_running_requests: int, max_extend_tokens: int,
                  cached_prefixes: bool = False, draft_tokens: int = 0, page_size: int = 1) -> int:
    """Windowed slots that can never run out before the full pool does: every running request holds at most
    its window plus the two tokens of the last two steps (with speculative decoding, each step's drafts
    too), and two batches' extends are in flight at most (overlap), each at most `max_extend_tokens` plus a
    decode token per running request. With the SWA radix cache each request (and the chunked one) also
    locks the window of its cached prefix; what the cache holds beyond the locks is evictable. Paged, a
    request's own range is released from the start of a page and allocated to the end of one (P - 1 more
    at each end), its prefix's lock starts a page early (P - 1 more), and a decode token opens a page."""
    slack = (3 if cached_prefixes else 2) * (page_size - 1)
    per_request = (2 * window + 3 if cached_prefixes else window + 3) + 2 * draft_tokens + slack
    requests = max_running_requests + 1 if cached_prefixes else max_running_requests
    bound = requests * per_request + 2 * (max_extend_tokens + max_running_requests * page_size)
    bound = -(-bound // page_size) * page_size
    return min(full_size, bound)
