"""The KV manager: the one owner of a scheduler's KV memory.

It holds the prefix cache (RadixCache, SWARadixCache with the hybrid sliding-window pool, or ChunkCache
without radix caching), the request-to-token pool (one row per running request) and the paged token
allocator, builds the batches that use them, flushes them, and runs the idle leak check: at idle every
KV slot (of both pools of a hybrid model) is free, evictable or protected by the cache, and every
request row is free.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, List, Optional, Tuple

from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator
from engine.scheduler.schedule_batch import ScheduleBatch

if TYPE_CHECKING:
    from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.mem_cache.memory_pool import ReqToTokenPool
    from engine.scheduler.req import Req

logger = logging.getLogger(__name__)


class MemoryLeakError(RuntimeError):
    pass


class KVManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: PagedTokenToKVPoolAllocator,
                 max_total_num_tokens: int, page_size: int, vocab_size: int, device: str, use_radix_cache: bool,
                 strict_memory_check: bool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = allocator
        self.max_total_num_tokens = max_total_num_tokens
        self.vocab_size = vocab_size
        self.device = device
        self.strict_memory_check = strict_memory_check
        self.tree_cache: BasePrefixCache
        if use_radix_cache and isinstance(allocator, SWATokenToKVPoolAllocator):
            from engine.mem_cache.swa_radix_cache import SWARadixCache

            # The hybrid sliding-window pool: a tree that frees windowed K/V apart from full K/V.
            self.tree_cache = SWARadixCache(req_to_token_pool, allocator, page_size, allocator.window)
        elif use_radix_cache:
            from engine.mem_cache.radix_cache import RadixCache

            self.tree_cache = RadixCache(req_to_token_pool, allocator, page_size)
        else:
            from engine.mem_cache.chunk_cache import ChunkCache

            self.tree_cache = ChunkCache(req_to_token_pool, allocator, page_size)
        self._reported_leak: Optional[tuple] = None  # the last leak logged by check_memory

    def new_batch(self, reqs: List[Req]) -> ScheduleBatch:
        return ScheduleBatch.init_new(reqs, self.req_to_token_pool, self.token_to_kv_pool_allocator,
                                      self.tree_cache, self.vocab_size, self.device)

    def free_request_rows(self) -> int:
        return self.req_to_token_pool.available_size()

    def token_usage(self) -> float:
        free = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        return 1.0 - free / self.max_total_num_tokens

    def reset(self) -> None:
        """Flush: the cache and both pools back to empty (no request may hold KV)."""
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()

    def state(self) -> dict:
        state = {
            "max_total_num_tokens": self.max_total_num_tokens,
            "available_tokens": self.token_to_kv_pool_allocator.available_size(),
            "evictable_tokens": self.tree_cache.evictable_size(),
            "protected_tokens": self.tree_cache.protected_size(),
            "token_usage": self.token_usage(),
        }
        allocator = self.token_to_kv_pool_allocator
        if isinstance(allocator, SWATokenToKVPoolAllocator):  # the windowed layers' pool of a hybrid model
            state["swa_max_total_num_tokens"] = allocator.swa.size
            state["swa_available_tokens"] = allocator.swa_available_size()
            state["swa_evictable_tokens"], state["swa_protected_tokens"] = self._swa_cached()
        return state

    def _swa_tree_error(self) -> str:
        """Strict mode: the SWA radix cache's nodes against the allocator's map (a node counted live whose
        windowed slots something else freed balances the counters but reads freed K/V); O(nodes)."""
        from engine.mem_cache.swa_radix_cache import SWARadixCache

        cache = self.tree_cache
        if not isinstance(cache, SWARadixCache):
            return ""
        try:
            cache.sanity_check()
        except AssertionError as exc:
            return f", SWA radix cache: {exc}"
        return ""

    def _swa_cached(self) -> Tuple[int, int]:
        """(evictable, protected) windowed-layer slots of the prefix cache: only SWARadixCache holds any."""
        from engine.mem_cache.swa_radix_cache import SWARadixCache

        cache = self.tree_cache
        if isinstance(cache, SWARadixCache):
            return cache.swa_evictable_size(), cache.swa_protected_size()
        return 0, 0

    def check_memory(self, extra_error: Optional[str] = None) -> None:
        """At idle every KV slot is free, evictable or protected and every request row is free;
        `extra_error` is what the PD role found wrong with its own buffers. A leak raises with
        --strict-memory-check, else it is logged once per distinct leak."""
        available = self.token_to_kv_pool_allocator.available_size()
        evictable = self.tree_cache.evictable_size()
        protected = self.tree_cache.protected_size()
        free_rows = self.req_to_token_pool.available_size()
        ok_tokens = available + evictable + protected == self.max_total_num_tokens
        ok_rows = free_rows == self.req_to_token_pool.size
        allocator = self.token_to_kv_pool_allocator
        swa_error = ""
        if isinstance(allocator, SWATokenToKVPoolAllocator):
            # The windowed layers' pool: every slot free or held by the prefix cache, as the full pool.
            swa_evictable, swa_protected = self._swa_cached()
            swa_available = allocator.swa_available_size()
            if swa_available + swa_evictable + swa_protected != allocator.swa.size:
                swa_error = (f", windowed-layer pool available={swa_available}, evictable={swa_evictable}, "
                             f"protected={swa_protected}, total={allocator.swa.size}")
            elif self.strict_memory_check:
                swa_error = self._swa_tree_error()
        if ok_tokens and ok_rows and not swa_error and extra_error is None:
            self._reported_leak = None
            return
        msg = (f"Scheduler memory leak detected! available={available}, evictable={evictable}, "
               f"protected={protected}, total={self.max_total_num_tokens}, free req slots="
               f"{free_rows}/{self.req_to_token_pool.size}{swa_error}" + (f", PD: {extra_error}" if extra_error else ""))
        if self.strict_memory_check:
            raise MemoryLeakError(msg)
        # The check runs every idle second: report each distinct leak once, not forever.
        leak = (available, evictable, protected, free_rows, extra_error, swa_error)
        if leak != self._reported_leak:
            self._reported_leak = leak
            logger.error("%s. The server keeps serving; --strict-memory-check makes this fatal.", msg)
