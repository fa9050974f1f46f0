"""ChunkCache: the no-sharing cache; every request's KV is its own and is freed at finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

import pytest
import torch

from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from engine.mem_cache.chunk_cache import ChunkCache
from engine.mem_cache.memory_pool import ReqToTokenPool


@dataclass
class FakeReq:
    origin_input_ids: List[int]
    output_ids: List[int] = field(default_factory=list)
    fill_ids: List[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Any = None
    cache_protected_len: int = 0
    kv_allocated_len: int = 0


def make(page_size: int, capacity: int = 64):
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(capacity, torch.float16, "cpu", None)
    else:
        alloc = PagedTokenToKVPoolAllocator(capacity, page_size, torch.float16, "cpu", None)
    req_pool = ReqToTokenPool(4, 64)
    return ChunkCache(req_pool, alloc, page_size), alloc, req_pool


def extend(cache: ChunkCache, alloc, req_pool: ReqToTokenPool, req: FakeReq, fill_len: int) -> None:
    req.fill_ids = req.origin_input_ids[:fill_len]
    prefix_len = len(req.prefix_indices)
    last_loc = int(req.prefix_indices[-1]) if prefix_len else -1
    out = alloc.alloc_extend(torch.tensor([prefix_len]), torch.tensor([fill_len]), torch.tensor([last_loc]),
                             fill_len - prefix_len)
    assert out is not None
    req_pool.write((req.req_pool_idx, slice(prefix_len, fill_len)), out)
    req.kv_allocated_len = fill_len


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache_no_sharing(page_size):
    cache, alloc, req_pool = make(page_size)
    result = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8])
    assert result.device_indices.numel() == 0 and result.last_device_node is None
    assert cache.insert([1, 2, 3, 4], torch.arange(4)) == 0
    assert cache.evict(100) == 0
    assert cache.inc_lock_ref(None) == 0 and cache.dec_lock_ref(None) == 0
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 0, 0)
    assert cache.disable


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunk_cache_chunks_then_finish(page_size):
    cache, alloc, req_pool = make(page_size)
    req = FakeReq(list(range(10, 21)))  # 11 tokens in chunks ending at 6 and 11
    req.req_pool_idx = req_pool.alloc(1)[0]
    extend(cache, alloc, req_pool, req, 6)
    cache.cache_unfinished_req(req)
    row = req_pool.req_to_token[req.req_pool_idx]
    assert req.prefix_indices.tolist() == row[:6].tolist()
    assert req.prefix_indices.dtype == torch.int64
    assert req.cache_protected_len == 0
    extend(cache, alloc, req_pool, req, 11)
    cache.cache_unfinished_req(req)
    assert req.prefix_indices.tolist() == row[:11].tolist()
    positions = torch.arange(11)
    assert (row[:11] % page_size == positions % page_size).all()
    used_pages = -(-11 // page_size)
    assert alloc.available_size() == 64 - used_pages * page_size

    req.output_ids.append(3)
    cache.cache_finished_req(req)
    assert alloc.available_size() == 64
    assert req_pool.available_size() == req_pool.size
    assert req.req_pool_idx is None and req.kv_allocated_len == 0 and req.prefix_indices.numel() == 0


def test_chunk_cache_abort_frees_everything_once():
    cache, alloc, req_pool = make(4)
    req = FakeReq(list(range(9)))
    req.req_pool_idx = req_pool.alloc(1)[0]
    extend(cache, alloc, req_pool, req, 9)
    cache.cache_finished_req(req, is_insert=False)
    assert alloc.available_size() == 64
    # The row is released; a second release of the same request is a no-op, not a double free.
    cache.cache_finished_req(req, is_insert=False)
    assert alloc.available_size() == 64 and req_pool.available_size() == req_pool.size
