"""ChunkCache: the prefix cache used with --disable-radix-cache (no sharing between requests).

It keeps the RadixCache interface so the scheduler never branches on the cache kind. Its only job
is chunked prefill: between chunks a request keeps its own KV as its "prefix".
"""

from __future__ import annotations

import logging
from typing import Any, Hashable, List, Optional

import torch

from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator
from engine.mem_cache.base_prefix_cache import BasePrefixCache, CachedReq, MatchResult
from engine.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)


class ChunkCache(BasePrefixCache):
    # Callers that special-case "no sharing" (e.g. admission policies) check this flag.
    disable = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: PagedTokenToKVPoolAllocator,
                 page_size: int) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.device = token_to_kv_pool_allocator.device

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def reset(self) -> None:
        pass  # nothing is cached

    def match_prefix(self, key: List[int], extra_key: Optional[Hashable] = None) -> MatchResult:
        return MatchResult(self._empty(), None)

    def insert(self, key: List[int], value: torch.Tensor, extra_key: Optional[Hashable] = None) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def pretty_print(self) -> str:
        return "ChunkCache (no shared prefixes)"

    def cache_finished_req(self, req: CachedReq, is_insert: bool = True) -> None:
        # Nothing is shared, so finishing and aborting release the same way: all of the row's KV.
        if req.req_pool_idx is not None:
            row = req.req_pool_idx
            kv = self.req_to_token_pool.req_to_token[row, : req.kv_allocated_len]
            self.token_to_kv_pool_allocator.free(kv)
            self.req_to_token_pool.free(row)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = self._empty()
        req.cache_protected_len = 0
        req.kv_allocated_len = 0

    def cache_unfinished_req(self, req: CachedReq) -> None:
        row = req.req_pool_idx
        req.prefix_indices = self.req_to_token_pool.req_to_token[row, : len(req.fill_ids)].to(torch.int64)
