"""RadixCache: tree operations against a brute-force model, and request-level caching."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.radix_cache import RadixCache, TreeNode


def make_allocator(size: int, page_size: int):
    if page_size == 1:
        return TokenToKVPoolAllocator(size, torch.float16, "cpu", None)
    return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None)


def make_cache(size: int, page_size: int, rows: int = 8, context: int = 64):
    alloc = make_allocator(size, page_size)
    req_pool = ReqToTokenPool(rows, context)
    return RadixCache(req_pool, alloc, page_size), alloc, req_pool


def insert_fresh(cache: RadixCache, alloc, key: List[int]) -> Tuple[int, torch.Tensor]:
    """Allocate slots for `key`, insert them, free what the tree did not take (like a finished request)."""
    page = cache.page_size
    need = -(-len(key) // page) * page
    slots = alloc.alloc(need)
    assert slots is not None, "test pool too small"
    slots = slots[: len(key)]
    aligned = len(key) - len(key) % page
    already = cache.insert(key, slots[:aligned].clone())
    alloc.free(torch.cat((slots[:already], slots[aligned:need])))
    return already, slots


# ---------------------------------------------------------------- brute-force model


class Model:
    """The cache as a prefix-closed set of page-aligned prefixes, one entry per page."""

    def __init__(self, page_size: int) -> None:
        self.page = page_size
        self.pages: Dict[Tuple[int, ...], Tuple[List[int], int]] = {}  # prefix -> (slots, access time)
        self.locks: Counter = Counter()
        self.clock = 0

    def insert(self, key: List[int], slots: List[int]) -> int:
        self.clock += 1
        aligned = len(key) - len(key) % self.page
        already = None
        for end in range(self.page, aligned + 1, self.page):
            prefix = tuple(key[:end])
            if prefix in self.pages:
                self.pages[prefix] = (self.pages[prefix][0], self.clock)
            else:
                already = end - self.page if already is None else already
                self.pages[prefix] = (slots[end - self.page:end], self.clock)
        return aligned if already is None else already

    def match(self, key: List[int]) -> Tuple[int, List[int]]:
        aligned = len(key) - len(key) % self.page
        if aligned == 0:
            return 0, []
        self.clock += 1
        matched, slots = 0, []
        for end in range(self.page, aligned + 1, self.page):
            prefix = tuple(key[:end])
            if prefix not in self.pages:
                break
            page_slots, _ = self.pages[prefix]
            self.pages[prefix] = (page_slots, self.clock)
            slots.extend(page_slots)
            matched = end
        return matched, slots

    def protected_prefixes(self) -> set:
        """Every page prefix of a locked key (a lock protects the whole path to the root)."""
        out = set()
        for key, count in self.locks.items():
            if count > 0:
                out.update(key[:end] for end in range(self.page, len(key) + 1, self.page))
        return out

    def lru_order(self) -> List[Tuple[int, ...]]:
        """Pages in the order LRU leaf eviction would remove them, until nothing is evictable."""
        protected = self.protected_prefixes()
        remaining = dict(self.pages)
        order = []
        while True:
            parents = {p[: -self.page] for p in remaining}
            leaves = [p for p in remaining if p not in parents and p not in protected]
            if not leaves:
                return order
            times = sorted(remaining[p][1] for p in leaves)
            assert len(times) == 1 or times[0] < times[1], "two evictable leaves with one access time"
            victim = min(leaves, key=lambda p: remaining[p][1])
            order.append(victim)
            del remaining[victim]

    def sizes(self) -> Tuple[int, int]:
        protected = len(self.protected_prefixes() & set(self.pages)) * self.page
        return len(self.pages) * self.page - protected, protected


def tree_pages(cache: RadixCache) -> Dict[Tuple[int, ...], Tuple[List[int], int]]:
    out: Dict[Tuple[int, ...], Tuple[List[int], int]] = {}
    page = cache.page_size

    def visit(node: TreeNode, prefix: Tuple[int, ...]) -> None:
        for child in node.children.values():
            for start in range(0, len(child.key), page):
                full = prefix + tuple(child.key[: start + page])
                out[full] = (child.value[start:start + page].tolist(), child.last_access_time)
            visit(child, prefix + tuple(child.key))

    visit(cache.root, ())
    return out


def check_against_model(cache: RadixCache, alloc, model: Model, capacity: int) -> None:
    cache.sanity_check()
    assert tree_pages(cache) == model.pages
    evictable, protected = model.sizes()
    assert cache.evictable_size() == evictable
    assert cache.protected_size() == protected
    assert cache.total_size() == evictable + protected
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == capacity


@st.composite
def ops_strategy(draw, page_size: int):
    """Operations on keys cut from a few sequences that branch off one trunk at different depths.

    Keys that are prefixes of each other and diverge mid-node (mid-page for P > 1) are what
    exercise splits, partial page matches, locks on split nodes and cascading eviction; fully
    random keys would rarely share anything.
    """
    tokens = st.integers(0, 2)
    longest = 4 * page_size + 3
    trunk = draw(st.lists(tokens, min_size=longest, max_size=longest))
    bases = []
    for _ in range(draw(st.integers(1, 4))):
        branch_at = draw(st.integers(0, longest))
        suffix = draw(st.lists(tokens, min_size=0, max_size=longest - branch_at))
        bases.append(trunk[:branch_at] + suffix)

    def key(choice: Tuple[int, int]) -> List[int]:
        base = bases[choice[0] % len(bases)]
        return base[: choice[1] % (len(base) + 1)]

    cut = st.tuples(st.integers(0, 3), st.integers(0, 10 * page_size)).map(key)
    op = st.one_of(
        st.tuples(st.just("insert"), cut),
        st.tuples(st.just("match"), cut),
        st.tuples(st.just("lock"), cut),
        st.tuples(st.just("unlock"), st.integers(0, 1000)),
        st.tuples(st.just("evict"), st.integers(0, 6 * page_size)),
    )
    return draw(st.lists(op, min_size=1, max_size=30))


def run_model_test(page_size: int, ops) -> None:
    capacity = 1024
    cache, alloc, _ = make_cache(capacity, page_size)
    model = Model(page_size)
    held: List[Tuple[TreeNode, Tuple[int, ...]]] = []
    for op, arg in ops:
        if op == "insert":
            already, slots = insert_fresh(cache, alloc, arg)
            assert already == model.insert(arg, slots.tolist())
        elif op in ("match", "lock"):
            result = cache.match_prefix(arg)
            matched, slots = model.match(arg)
            assert result.device_indices.dtype == torch.int64
            assert result.device_indices.tolist() == slots
            if op == "lock":
                cache.inc_lock_ref(result.last_device_node)
                held.append((result.last_device_node, tuple(arg[:matched])))
                model.locks[tuple(arg[:matched])] += 1
        elif op == "unlock":
            if held:
                node, locked_key = held.pop(arg % len(held))
                cache.dec_lock_ref(node)
                model.locks[locked_key] -= 1
        else:
            order = model.lru_order()
            before_pages = set(model.pages)
            before_free = alloc.available_size()
            freed = cache.evict(arg)
            evicted = before_pages - set(tree_pages(cache))
            assert freed == len(evicted) * page_size
            assert alloc.available_size() == before_free + freed
            assert evicted == set(order[: len(evicted)]), "eviction is not LRU over unlocked leaves"
            if freed < arg:
                assert len(evicted) == len(order), "stopped early with evictable pages left"
            elif arg > 0:
                # Only the rest of the node that crossed the target may be evicted past it.
                needed = -(-arg // page_size)
                tail_times = {model.pages[p][1] for p in order[needed - 1: len(evicted)]}
                assert len(tail_times) == 1
            for prefix in evicted:
                del model.pages[prefix]
        check_against_model(cache, alloc, model, capacity)
    for node, locked_key in held:
        cache.dec_lock_ref(node)
        model.locks[locked_key] -= 1
    check_against_model(cache, alloc, model, capacity)
    assert cache.protected_size() == 0
    cache.evict(capacity)
    assert cache.total_size() == 0 and alloc.available_size() == capacity


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops_strategy(1))
def test_radix_against_model_page1(ops):
    run_model_test(1, ops)


@pytest.mark.slow  # test_radix_against_model_page1 keeps the same check in the fast lane
@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops_strategy(4))
def test_radix_against_model_page4(ops):
    run_model_test(4, ops)


# ---------------------------------------------------------------- tree unit tests


def test_insert_match_split_and_lock():
    cache, alloc, _ = make_cache(64, 1)
    already, slots_a = insert_fresh(cache, alloc, [1, 2, 3, 4])
    assert already == 0 and cache.evictable_size() == 4
    already, slots_b = insert_fresh(cache, alloc, [1, 2, 5])
    assert already == 2
    assert cache.evictable_size() == 5
    # The request that inserted [1, 2, 5] had its own [1, 2] slots freed: the tree keeps the first copy.
    assert cache.match_prefix([1, 2, 5, 9]).device_indices.tolist() == slots_a[:2].tolist() + slots_b[2:].tolist()

    result = cache.match_prefix([1, 2, 3])  # ends inside [3, 4]: split so the node is exactly [3]
    assert result.device_indices.tolist() == slots_a[:3].tolist()
    node = result.last_device_node
    assert node.key == [3] and node.parent.key == [1, 2]
    assert cache.inc_lock_ref(node) == -3
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2  # [4] and [5] go; the locked path stays
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == slots_a[:3].tolist()
    assert cache.dec_lock_ref(node) == 3
    assert cache.evictable_size() == 3 and cache.protected_size() == 0
    with pytest.raises(RuntimeError, match="not locked"):
        cache.dec_lock_ref(node)
    cache.sanity_check()
    assert "lock_ref=0" in cache.pretty_print()


def test_evict_lru_order_and_cascade():
    cache, alloc, _ = make_cache(64, 1)
    insert_fresh(cache, alloc, [1, 1])
    insert_fresh(cache, alloc, [2, 2])
    insert_fresh(cache, alloc, [3, 3])
    cache.match_prefix([1, 1])  # [1, 1] is now the most recent
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).device_indices.numel() == 0
    assert cache.match_prefix([1, 1]).device_indices.numel() == 2
    # Parent becomes a leaf after its child goes, and is evicted in the same call.
    insert_fresh(cache, alloc, [3, 3, 4, 4])
    cache.match_prefix([1, 1])
    assert cache.evict(3) == 4
    assert cache.total_size() == 2
    assert alloc.available_size() == 64 - 2


def test_paged_keys_are_page_aligned():
    cache, alloc, _ = make_cache(64, 4)
    already, slots = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6, 7])  # only the first page is cached
    assert already == 0 and cache.total_size() == 4
    assert cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 8]).device_indices.tolist() == slots[:4].tolist()
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert cache.match_prefix([1, 2, 3, 9]).device_indices.numel() == 0  # a page matches only whole
    already, _ = insert_fresh(cache, alloc, [1, 2, 3, 4, 5, 6, 7, 9])
    assert already == 4 and cache.total_size() == 8
    assert alloc.available_size() + cache.evictable_size() == 64


def test_disabled_radix_cache_caches_nothing():
    alloc = make_allocator(32, 1)
    cache = RadixCache(ReqToTokenPool(4, 16), alloc, 1, disable=True)
    slots = alloc.alloc(3)
    assert cache.insert([1, 2, 3], slots) == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert cache.total_size() == 0 and cache.evict(10) == 0


# ---------------------------------------------------------------- request level


@dataclass
class FakeReq:
    origin_input_ids: List[int]
    output_ids: List[int] = field(default_factory=list)
    fill_ids: List[int] = field(default_factory=list)
    req_pool_idx: Optional[int] = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    last_node: Optional[TreeNode] = None
    cache_protected_len: int = 0
    kv_allocated_len: int = 0
    extra_key: Optional[Hashable] = None  # the cache namespace


class MiniScheduler:
    """Just enough of the scheduler's KV bookkeeping to drive the cache like it does."""

    def __init__(self, page_size: int, capacity: int = 256) -> None:
        self.page = page_size
        self.capacity = capacity
        self.cache, self.alloc, self.req_pool = make_cache(capacity, page_size, rows=8, context=128)
        self.live: List[FakeReq] = []

    def row(self, req: FakeReq) -> torch.Tensor:
        return self.req_pool.req_to_token[req.req_pool_idx].to(torch.int64)

    def admit(self, req: FakeReq, fill_len: Optional[int] = None) -> None:
        """Match the prefix, lock it, take a row and allocate KV for the rest of this chunk."""
        tokens = req.origin_input_ids + req.output_ids
        req.fill_ids = tokens[: fill_len or len(tokens)]
        result = self.cache.match_prefix(req.fill_ids[: len(req.fill_ids) - 1])
        req.prefix_indices = result.device_indices
        req.last_node = result.last_device_node
        self.cache.inc_lock_ref(req.last_node)
        req.cache_protected_len = len(req.prefix_indices)
        req.req_pool_idx = self.req_pool.alloc(1)[0]
        self.live.append(req)
        self._extend(req)

    def next_chunk(self, req: FakeReq, fill_len: int) -> None:
        req.fill_ids = (req.origin_input_ids + req.output_ids)[:fill_len]
        self._extend(req)

    def _extend(self, req: FakeReq) -> None:
        prefix_len, seq_len = len(req.prefix_indices), len(req.fill_ids)
        last_loc = int(req.prefix_indices[-1]) if prefix_len else -1
        out = self.alloc.alloc_extend(torch.tensor([prefix_len]), torch.tensor([seq_len]),
                                      torch.tensor([last_loc]), seq_len - prefix_len)
        assert out is not None
        self.req_pool.write((req.req_pool_idx, slice(0, prefix_len)), req.prefix_indices)
        self.req_pool.write((req.req_pool_idx, slice(prefix_len, seq_len)), out)
        req.kv_allocated_len = seq_len

    def decode(self, req: FakeReq, token: int) -> None:
        """Sample `token`, then allocate the slot the next step feeds it into."""
        req.output_ids.append(token)
        seq_len = req.kv_allocated_len + 1
        last_loc = self.row(req)[req.kv_allocated_len - 1]
        out = self.alloc.alloc_decode(torch.tensor([seq_len]), last_loc.reshape(1))
        assert out is not None
        self.req_pool.write((req.req_pool_idx, req.kv_allocated_len), out[0])
        req.kv_allocated_len = seq_len

    def finish(self, req: FakeReq, is_insert: bool = True) -> None:
        self.cache.cache_finished_req(req, is_insert=is_insert)
        self.live.remove(req)

    def check(self) -> None:
        """KV conservation (page-rounded), alignment, and that the tree owns every protected prefix."""
        self.cache.sanity_check()
        owned = 0
        for req in self.live:
            assert req.cache_protected_len % self.page == 0
            owned += -(-(req.kv_allocated_len - req.cache_protected_len) // self.page) * self.page
            row = self.row(req)[: req.kv_allocated_len]
            positions = torch.arange(req.kv_allocated_len)
            assert (row % self.page == positions % self.page).all()
            tree = self.cache.match_prefix(req.fill_ids[: req.cache_protected_len]).device_indices
            assert tree.tolist() == row[: req.cache_protected_len].tolist()
        total = self.alloc.available_size() + self.cache.evictable_size() + self.cache.protected_size() + owned
        assert total == self.capacity
        if not self.live:
            assert self.cache.protected_size() == 0
            assert self.req_pool.available_size() == self.req_pool.size


def assert_released(req: FakeReq) -> None:
    assert req.req_pool_idx is None and req.last_node is None
    assert req.prefix_indices.numel() == 0
    assert req.cache_protected_len == 0 and req.kv_allocated_len == 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_finished_req_is_inserted_and_tail_freed(page_size):
    sched = MiniScheduler(page_size)
    prompt = list(range(10, 21))  # 11 tokens
    req = FakeReq(prompt)
    sched.admit(req)
    sched.decode(req, 100)
    sched.decode(req, 101)
    sched.decode(req, 102)  # fed 100, 101, 102 -> committed = 11 + 3 = 14 tokens; 103 has no KV
    req.output_ids.append(103)
    row = sched.row(req)[:14].clone()
    sched.check()
    sched.finish(req)
    assert_released(req)
    committed = 14
    aligned = committed - committed % page_size
    assert sched.cache.total_size() == aligned
    assert sched.alloc.available_size() + sched.cache.evictable_size() == sched.capacity
    tokens = prompt + [100, 101, 102, 103]
    assert sched.cache.match_prefix(tokens).device_indices.tolist() == row[:aligned].tolist()
    sched.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_two_requests_same_prompt_free_duplicates(page_size):
    sched = MiniScheduler(page_size)
    prompt = list(range(1, 10))  # 9 tokens
    a, b = FakeReq(list(prompt)), FakeReq(list(prompt))
    sched.admit(a)
    sched.admit(b)  # admitted before a is cached: no sharing, both own their slots
    assert b.cache_protected_len == 0
    sched.decode(a, 50)
    sched.decode(b, 60)
    a.output_ids.append(51)
    b.output_ids.append(61)
    sched.check()

    sched.finish(a)  # caches prompt + [50] (10 tokens) floored to pages
    sched.check()
    before = sched.alloc.available_size()
    b_row = sched.row(b)[: b.kv_allocated_len].clone()
    sched.finish(b)
    # b's prompt pages duplicate a's; its own [60] branch is new.
    shared = len(prompt) - len(prompt) % page_size
    aligned_b = 10 - 10 % page_size
    freed_slots = set(b_row[:shared].tolist()) | set(b_row[aligned_b:].tolist())
    freed_pages = {s // page_size for s in freed_slots}
    assert sched.alloc.available_size() - before == len(freed_pages) * page_size
    assert sched.cache.match_prefix(prompt + [60]).device_indices[shared:].tolist() == b_row[shared:aligned_b].tolist()
    sched.check()

    # A third request with the same prompt reuses the cached pages and owns only the rest.
    c = FakeReq(list(prompt))
    sched.admit(c)
    assert c.cache_protected_len == shared if shared < len(prompt) else len(prompt) - page_size
    assert sched.cache.protected_size() == c.cache_protected_len
    sched.check()
    sched.finish(c, is_insert=False)
    assert_released(c)
    assert sched.cache.protected_size() == 0
    sched.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_abort_without_insert_frees_own_kv_only(page_size):
    sched = MiniScheduler(page_size)
    seed = FakeReq(list(range(30, 42)))
    sched.admit(seed)
    seed.output_ids.append(7)
    sched.finish(seed)
    cached = sched.cache.total_size()
    free_before = sched.alloc.available_size()

    req = FakeReq(list(range(30, 42)) + [1, 2, 3])
    sched.admit(req)
    protected = req.cache_protected_len
    assert protected > 0
    sched.decode(req, 9)
    sched.check()
    sched.finish(req, is_insert=False)
    assert_released(req)
    assert sched.cache.total_size() == cached, "nothing inserted on abort"
    assert sched.cache.protected_size() == 0
    assert sched.alloc.available_size() == free_before
    sched.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_over_allocated_slot_is_freed_once(page_size):
    sched = MiniScheduler(page_size)
    req = FakeReq(list(range(1, 8)))  # 7 tokens
    sched.admit(req)
    sched.decode(req, 20)
    sched.decode(req, 21)
    # Overlap scheduling: the next step was prepared (slot allocated) before 21 turned out final.
    seq_len = req.kv_allocated_len + 1
    last_loc = sched.row(req)[req.kv_allocated_len - 1]
    out = sched.alloc.alloc_decode(torch.tensor([seq_len]), last_loc.reshape(1))
    sched.req_pool.write((req.req_pool_idx, req.kv_allocated_len), out[0])
    req.kv_allocated_len = seq_len  # committed (7 + 2 - 1 = 8) < allocated (9)
    sched.check()
    sched.finish(req)
    assert sched.cache.total_size() == 8 - 8 % page_size
    assert sched.alloc.available_size() + sched.cache.evictable_size() == sched.capacity
    sched.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_with_cache_unfinished_req(page_size):
    sched = MiniScheduler(page_size)
    prompt = list(range(100, 114))  # 14 tokens in chunks ending at 6, 11, 14
    req = FakeReq(prompt)
    sched.admit(req, fill_len=6)
    for end, next_end in ((6, 11), (11, 14), (14, None)):
        sched.cache.cache_unfinished_req(req)
        aligned = end - end % page_size
        assert req.cache_protected_len == aligned
        assert req.prefix_indices.tolist() == sched.row(req)[:end].tolist()
        # The lock moved: only the request's own cached prefix is protected.
        assert sched.cache.protected_size() == aligned
        assert sched.cache.evictable_size() == 0
        assert sched.cache.evict(100) == 0
        sched.check()
        if next_end is not None:
            sched.next_chunk(req, next_end)
            sched.check()
    req.output_ids.append(5)
    sched.finish(req)
    assert sched.cache.protected_size() == 0
    assert sched.cache.total_size() == 14 - 14 % page_size
    sched.check()


@pytest.mark.parametrize("page_size", [1, 4])
def test_cache_unfinished_req_switches_row_to_tree_copy(page_size):
    sched = MiniScheduler(page_size)
    prompt = list(range(200, 212))  # 12 tokens
    first, second = FakeReq(list(prompt)), FakeReq(list(prompt))
    sched.admit(first)
    sched.admit(second)
    sched.cache.cache_unfinished_req(first)
    first_row = sched.row(first)[:12].clone()
    second_row_before = sched.row(second)[:12].clone()
    before = sched.alloc.available_size()
    sched.cache.cache_unfinished_req(second)
    # second's own copies of the cached pages went back to the allocator ...
    assert sched.alloc.available_size() - before == 12 - 12 % page_size
    assert not set(second_row_before[:12 - 12 % page_size].tolist()) & set(sched.row(second)[:12].tolist())
    # ... and its row now points at the tree's (first's) slots.
    assert sched.row(second)[:12].tolist() == first_row.tolist()
    assert second.cache_protected_len == 12 - 12 % page_size
    sched.check()
    first.output_ids.append(1)
    second.output_ids.append(2)
    sched.finish(first)
    sched.finish(second)
    sched.check()
    assert sched.cache.protected_size() == 0


def test_finish_right_after_full_prefill_keeps_tree_pages():
    """Committed length can fall below the protected prefix (no output yet); nothing tree-owned is freed."""
    sched = MiniScheduler(4)
    req = FakeReq(list(range(40, 48)))  # 8 tokens: two full pages
    sched.admit(req)
    sched.cache.cache_unfinished_req(req)
    assert req.cache_protected_len == 8
    sched.check()
    sched.finish(req)  # committed = 8 - 1 = 7 -> floored to 4 < protected 8
    assert_released(req)
    assert sched.cache.total_size() == 8 and sched.cache.protected_size() == 0
    sched.check()
