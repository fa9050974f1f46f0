"""Cascade prefixes' K^T and V panels kept across decode steps (layers/attention/prefix_panels.py): the same
bits as packing afresh, a copy that is really read, and one that is dropped once its slots are released."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels import attention as attention_kernels
from engine.kernels import library
from engine.kernels.boundary import AttentionKernels
from engine.layers.attention.prefix_panels import PrefixPanels
from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import MHATokenToKVPool

HEADS, KV_HEADS, DIM, LAYERS = 16, 8, 64, 2


def _pool(size: int = 32768):  # the default budget (1/8 of it) holds both prefixes
    pool = MHATokenToKVPool(size, 1, torch.bfloat16, KV_HEADS, DIM, LAYERS, "cpu")
    alloc = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", pool)
    torch.manual_seed(0)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape))
    return pool, alloc


def _batch(alloc, prefix_lens, members):
    """Groups of `members` requests over fresh prefixes of `prefix_lens` slots, with own suffixes."""
    prefixes = [alloc.alloc(n) for n in prefix_lens]
    bs = members * len(prefixes)
    lens = torch.randint(1, 30, (bs,))
    own = alloc.alloc(int(lens.sum()))
    kv_indices = torch.zeros(bs, int(lens.max()), dtype=torch.int64)
    start = 0
    for b in range(bs):
        kv_indices[b, :lens[b]] = own[start:start + int(lens[b])]
        start += int(lens[b])
    prefix_indices = torch.zeros(len(prefixes), max(prefix_lens), dtype=torch.int64)
    for g, p in enumerate(prefixes):
        prefix_indices[g, :p.numel()] = p
    group_of = torch.arange(bs) // members

    def cascade() -> attention_kernels.CascadeTables:
        return attention_kernels.CascadeTables(torch.arange(len(prefixes) + 1) * members, torch.arange(bs),
                                         prefix_indices, torch.tensor(prefix_lens), group_of)
    q = torch.randn(bs, HEADS * DIM).to(torch.bfloat16)
    return prefixes, kv_indices, lens, q, cascade


def _decode(pool, q, kv_indices, lens, cascade, layer):
    return attention_kernels.decode_attention(q, pool.k_buffer[layer], pool.v_buffer[layer], kv_indices, lens, HEADS,
                                        KV_HEADS, DIM, 1 / math.sqrt(DIM), cascade=cascade, layer_id=layer)


def _attention() -> AttentionKernels:
    lib = library.attention()
    assert lib is not None
    return lib


def _require_kernel() -> None:
    lib = library.linear()
    if lib is None or not lib.linear_bf16_available():
        pytest.skip("no AVX512-BF16 on this CPU: the cascade has no panel path")


def test_kept_panels_give_the_same_bits_and_follow_releases(cpu_isa):
    _require_kernel()
    pool, alloc = _pool()
    prefixes, kv_indices, lens, q, cascade = _batch(alloc, [300, 600], members=5)
    panels = PrefixPanels()
    for step in range(3):  # the first step packs the panels, the later ones read them
        tables = cascade()
        panels.attach(tables, prefixes, pool)
        assert tables.kept is not None
        for layer in range(LAYERS):
            fresh = _decode(pool, q, kv_indices, lens, cascade(), layer)
            assert torch.equal(_decode(pool, q, kv_indices, lens, tables, layer), fresh), (step, layer)
    assert panels.kept_bytes > 0
    # K/V rewritten under the prefix without a release (nothing in the engine does this): the kept
    # copy is what the kernel reads, so the result no longer follows the pool.
    pool.k_buffer[0][prefixes[0]] = torch.randn(300, KV_HEADS, DIM).to(torch.bfloat16)
    tables = cascade()
    panels.attach(tables, prefixes, pool)
    assert not torch.equal(_decode(pool, q, kv_indices, lens, tables, 0), _decode(pool, q, kv_indices, lens,
                                                                                cascade(), 0))
    # Once the slots went back to the allocator the copy is packed again from what they hold.
    alloc.free(prefixes[0])
    tables = cascade()
    panels.attach(tables, prefixes, pool)
    for layer in range(LAYERS):
        assert torch.equal(_decode(pool, q, kv_indices, lens, tables, layer),
                           _decode(pool, q, kv_indices, lens, cascade(), layer))


def test_kept_panels_stay_within_their_budget(cpu_isa):
    _require_kernel()
    pool, alloc = _pool()
    prefixes, kv_indices, lens, q, cascade = _batch(alloc, [256, 256], members=3)
    one = LAYERS * 2 * int(_attention().kept_prefix_elems(256, KV_HEADS, DIM))
    panels = PrefixPanels(budget_bytes=one)
    tables = cascade()
    panels.attach(tables, prefixes, pool)
    assert tables.kept is not None and tables.kept_tokens is not None
    assert tables.kept_tokens.ne(0).tolist() == [True, False] and panels.kept_bytes == one
    for layer in range(LAYERS):
        assert torch.equal(_decode(pool, q, kv_indices, lens, tables, layer),
                           _decode(pool, q, kv_indices, lens, cascade(), layer))
    # A later step with the second prefix alone: the first one, idle now, makes room for it.
    second = attention_kernels.CascadeTables(torch.tensor([0, 3]), torch.arange(3, 6), tables.prefix_indices[1:],
                                       torch.tensor([256]), torch.tensor([-1, -1, -1, 0, 0, 0]))
    panels.attach(second, prefixes[1:], pool)
    assert second.kept_tokens is not None and second.kept_tokens.tolist() != [0] and panels.kept_bytes == one


@pytest.mark.parametrize("page_size", [1, 4])
def test_pool_counts_slot_releases(page_size):
    pool = MHATokenToKVPool(64, page_size, torch.bfloat16, 2, 8, 1, "cpu")
    alloc = (TokenToKVPoolAllocator(64, torch.bfloat16, "cpu", pool) if page_size == 1
             else PagedTokenToKVPoolAllocator(64, page_size, torch.bfloat16, "cpu", pool))
    assert pool.slot_generation is not None
    start = pool.slot_generation.clone()
    slots = alloc.alloc(8)
    assert torch.equal(pool.slot_generation, start)  # handing slots out changes nothing
    alloc.free(slots[:page_size])  # one page
    moved = (pool.slot_generation != start).nonzero().flatten()
    first_page = slots[0] // page_size * page_size
    assert moved.tolist() == list(range(int(first_page), int(first_page) + page_size))
    alloc.clear()
    assert bool((pool.slot_generation > start).all())
    pool.release()
    before = pool.slot_generation.clone()
    pool.resume()  # new buffers: every slot's K/V is new
    assert bool((pool.slot_generation > before).all())
