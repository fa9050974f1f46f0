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
ones free both), page size 1.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import MHATokenToKVPool


class SWAKVPool(MHATokenToKVPool):
    """Per-layer K/V buffers: `size` slots for full layers, `swa_size` for the windowed ones."""

    def __init__(self, size: int, swa_size: int, windowed_layers: Sequence[int], dtype: torch.dtype, head_num: int,
                 head_dim: int, layer_num: int, device: str = "cpu", k_scales: Optional[Sequence[float]] = None,
                 v_scales: Optional[Sequence[float]] = None) -> None:
        self.swa_size = swa_size
        self.windowed_layers = frozenset(windowed_layers)
        # Until the allocator binds its map: every full slot maps to the padding slot.
        self._full_to_swa = torch.zeros(size + 1, dtype=torch.int64, device=device)
        super().__init__(size, 1, dtype, head_num, head_dim, layer_num, device, k_scales, v_scales)

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


class SWATokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """Full slots as TokenToKVPoolAllocator (page size 1), each with a windowed slot from a second free list."""

    def __init__(self, size: int, swa_size: int, window: int, num_rows: int, dtype: torch.dtype, device: str,
                 kvcache: SWAKVPool) -> None:
        if window < 1 or swa_size < 1:
            raise ValueError(f"SWATokenToKVPoolAllocator: window {window} and swa_size {swa_size} must be >= 1")
        self.window = window
        self.swa = TokenToKVPoolAllocator(swa_size, dtype, device)
        self.full_to_swa = torch.zeros(size + 1, dtype=torch.int64, device=device)
        # Per request row: the read start of its last batch, and how far its windowed slots are released.
        self._read_floor = [0] * (num_rows + 1)
        self._released_upto = [0] * (num_rows + 1)
        super().__init__(size, dtype, device, kvcache)
        kvcache.use_slot_map(self.full_to_swa)

    def clear(self) -> None:
        super().clear()  # the base constructor calls this too: every part below exists by then
        self.swa.clear()
        self.full_to_swa.zero_()
        self._read_floor = [0] * len(self._read_floor)
        self._released_upto = [0] * len(self._released_upto)

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def read_floor(self, row: int) -> int:
        """The first position the newest batch prepared for `row` reads (what a forward of it still in
        flight under overlap may read; everything the row reads later lies above it)."""
        return self._read_floor[row]

    def keep_last_window(self, row: int, length: int, owned_from: int, req_to_token: torch.Tensor) -> None:
        """The windowed slots of the row's own positions below its last window go (no batch of it runs
        again, so nothing in flight reads them; a transfer reading them gets the padding row)."""
        upto = max(length - self.window, 0)
        lo = max(self._released_upto[row], owned_from)
        if upto > lo:
            self._release_swa(req_to_token[row, lo:upto].long())
        self._released_upto[row] = max(self._released_upto[row], upto)

    def windowed_shortfall(self, num_tokens: int) -> int:
        return max(num_tokens - self.swa.available_size(), 0)

    def swa_held(self, full: torch.Tensor) -> torch.Tensor:
        """Per full slot: whether its windowed slot is still held (bool, same shape)."""
        return self.full_to_swa[full.long()] != 0

    def release_swa(self, full: torch.Tensor) -> None:
        """Free the windowed slots of these full slots (the full slots stay allocated): the prefix
        cache tombstones a node."""
        if full.numel():
            self._release_swa(full.reshape(-1).long())

    def move_swa(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hand the windowed slots of full slots `src` to full slots `dst` (which hold none): the prefix
        cache revives a tombstoned node with a request's duplicate of it; `src` is freed afterwards."""
        src, dst = src.reshape(-1).long(), dst.reshape(-1).long()
        if bool((self.full_to_swa[dst] != 0).any()) or bool((self.full_to_swa[src] == 0).any()):
            raise ValueError("move_swa: the source must hold windowed slots and the destination none")
        self.full_to_swa[dst] = self.full_to_swa[src]
        self.full_to_swa[src] = 0

    def alloc_received(self, row: int, num_tokens: int) -> Optional[torch.Tensor]:
        """Full slots for positions [0, num_tokens) of a request whose KV arrives by transfer (PD decode,
        or a retraction backup coming back), with windowed slots for its last `window` positions only: the
        only ones its next query reads. Row `row` starts its release bookkeeping there."""
        full = super().alloc(num_tokens)
        if full is None or num_tokens == 0:
            return full
        tail = min(num_tokens, self.window)
        swa = self.swa.alloc(tail)
        if swa is None:
            super().free(full)
            return None
        self.full_to_swa[full[num_tokens - tail:]] = swa
        self._read_floor[row] = self._released_upto[row] = num_tokens - tail
        return full

    def alloc(self, need: int) -> Optional[torch.Tensor]:
        full = super().alloc(need)
        if full is None or need == 0:
            return full
        swa = self.swa.alloc(need)
        if swa is None:
            super().free(full)
            return None
        self.full_to_swa[full] = swa
        return full

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self._release_swa(indices.reshape(-1).long())
        super().free(indices)

    def _release_swa(self, full: torch.Tensor) -> None:
        swa = self.full_to_swa[full]
        held = swa != 0
        if bool(held.any()):
            self.swa.free(swa[held])
            self.full_to_swa[full[held]] = 0

    def release_out_of_window(self, rows: List[int], first_positions: List[int], owned_from: List[int],
                              fresh: List[bool], req_to_token: torch.Tensor) -> None:
        """Before a batch allocates: `first_positions[i]` is the first new position of the request in row
        rows[i] (its prefix length; seq_len - 1 for a decode), `owned_from[i]` where its own slots start
        (below: the prefix cache's), `fresh[i]` whether the request got that row for this batch. Releases
        the windowed slots of its own positions below the row's previous read start, then records this
        batch's."""
        leaving: List[torch.Tensor] = []
        for row, first, own, new in zip(rows, first_positions, owned_from, fresh):
            if new:
                self._read_floor[row] = self._released_upto[row] = 0
            upto, lo = self._read_floor[row], max(self._released_upto[row], own)
            if upto > lo:
                leaving.append(req_to_token[row, lo:upto])
            self._released_upto[row] = max(self._released_upto[row], upto)
            self._read_floor[row] = max(upto, first - self.window + 1, 0)
        if leaving:  # one release for the batch (one device sync on the GPU, not one per request)
            self._release_swa(torch.cat(leaving).long())


def swa_pool_size(full_size: int, window: int, max_running_requests: int, max_extend_tokens: int,
                  cached_prefixes: bool = False, draft_tokens: int = 0) -> int:
    """Windowed slots that can never run out before the full pool does: every running request holds at most
    its window plus the two tokens of the last two steps (with speculative decoding, each step's drafts
    too), and two batches' extends are in flight at most (overlap), each at most `max_extend_tokens` plus a
    decode token per running request. With the SWA radix cache each request (and the chunked one) also
    locks the window of its cached prefix; what the cache holds beyond the locks is evictable."""
    per_request = (2 * window + 3 if cached_prefixes else window + 3) + 2 * draft_tokens
    requests = max_running_requests + 1 if cached_prefixes else max_running_requests
    bound = requests * per_request + 2 * (max_extend_tokens + max_running_requests)
    return min(full_size, bound)
