"""SWARadixCache (mem_cache/swa_radix_cache.py): tree operations against a brute-force, token-level model
of the cache (which prefixes are cached, in which full slot, whether their windowed K/V is still held,
what the locks protect), and the window rules by hand."""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Set, Tuple

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.radix_cache import TreeNode
from engine.mem_cache.swa_pool import SWAKVPool, SWATokenToKVPoolAllocator
from engine.mem_cache.swa_radix_cache import SWARadixCache, SWATreeNode

CAPACITY = 256
SWA_CAPACITY = 200


def make_cache(window: int, capacity: int = CAPACITY, swa_capacity: int = SWA_CAPACITY):
    pool = SWAKVPool(capacity, swa_capacity, [0], torch.float32, head_num=1, head_dim=1, layer_num=2)
    alloc = SWATokenToKVPoolAllocator(capacity, swa_capacity, window, 8, torch.float32, "cpu", pool)
    cache = SWARadixCache(ReqToTokenPool(8, 64), alloc, 1, window)
    return cache, alloc


Prefix = Tuple[int, ...]


class Model:
    """The cache as a prefix-closed set of token prefixes: prefix -> (full slot, windowed K/V held)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.entries: Dict[Prefix, Tuple[int, bool]] = {}
        self.locks: Counter = Counter()

    def insert(self, key: List[int], slots: List[int], held: List[bool]) -> int:
        already: Optional[int] = None
        for i in range(len(key)):
            prefix = tuple(key[:i + 1])
            if prefix in self.entries:
                slot, live = self.entries[prefix]
                if not live and held[i] and slots[i] != slot:
                    self.entries[prefix] = (slot, True)  # revived with the duplicate's windowed K/V
            else:
                already = i if already is None else already
                self.entries[prefix] = (slots[i], held[i])
        return len(key) if already is None else already

    def match(self, key: List[int]) -> Tuple[int, List[int]]:
        """The longest e such that the last min(e, window) tokens of key[:e] are live and, when e is
        shorter than the window, all of them are."""
        matched = 0
        while matched < len(key) and tuple(key[:matched + 1]) in self.entries:
            matched += 1
        live = [self.entries[tuple(key[:i + 1])][1] for i in range(matched)]
        best = 0
        for end in range(1, matched + 1):
            if all(live[max(end - self.window, 0):end]) and (end >= self.window or all(live[:end])):
                best = end
        return best, [self.entries[tuple(key[:i + 1])][0] for i in range(best)]

    def full_locked(self) -> Set[Prefix]:
        return {key[:end] for key, n in self.locks.items() if n > 0 for end in range(1, len(key) + 1)}

    def swa_locked(self) -> Set[Prefix]:
        return {key[:end] for key, n in self.locks.items() if n > 0
                for end in range(max(len(key) - self.window, 0) + 1, len(key) + 1)}

    def is_leaf(self, prefix: Prefix) -> bool:
        return not any(len(p) == len(prefix) + 1 and p[:-1] == prefix for p in self.entries)


def tree_entries(cache: SWARadixCache) -> Dict[Prefix, Tuple[int, bool]]:
    out: Dict[Prefix, Tuple[int, bool]] = {}

    def visit(node: TreeNode, prefix: Prefix) -> None:
        for child in node.children.values():
            assert isinstance(child, SWATreeNode)
            for i in range(len(child.key)):
                out[prefix + tuple(child.key[:i + 1])] = (int(child.value[i]), not child.swa_tombstone)
            visit(child, prefix + tuple(child.key))

    visit(cache.root, ())
    return out


def check(cache: SWARadixCache, alloc: SWATokenToKVPoolAllocator, model: Model) -> None:
    cache.sanity_check()  # node uniformity against the allocator's map, lock order, both pools' counters
    assert tree_entries(cache) == model.entries
    full_locked, swa_locked = model.full_locked(), model.swa_locked()
    assert all(model.entries[p][1] for p in swa_locked), "a locked window lost its windowed K/V"
    live = sum(1 for _, held in model.entries.values() if held)
    assert cache.protected_size() == len(full_locked)
    assert cache.evictable_size() == len(model.entries) - len(full_locked)
    assert cache.swa_protected_size() == len(swa_locked)
    assert cache.swa_evictable_size() == live - len(swa_locked)
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == CAPACITY
    assert alloc.swa_available_size() + cache.swa_evictable_size() + cache.swa_protected_size() == SWA_CAPACITY


def request_insert(cache: SWARadixCache, alloc: SWATokenToKVPoolAllocator, model: Model, key: List[int],
                   use_prefix: bool, released: int) -> None:
    """A request finishing (cache_finished_req's steps): its row holds the tree's slots of its matched prefix
    (locked while it ran) and its own slots after them, the first `released` of which left its window."""
    match = cache.match_prefix(key) if use_prefix else None
    prefix = match.device_indices if match is not None else torch.empty(0, dtype=torch.int64)
    model_len, model_slots = model.match(key) if use_prefix else (0, [])
    assert prefix.tolist() == model_slots
    if match is not None:
        cache.inc_lock_ref(match.last_device_node)
    own = alloc.alloc(len(key) - len(prefix))
    assert own is not None
    alloc.release_swa(own[:released])
    slots = torch.cat((prefix, own))
    held = alloc.swa_held(slots).tolist()
    already = cache.insert(key, slots.clone())
    assert already == model.insert(key, slots.tolist(), held)
    alloc.free(slots[len(prefix):max(already, len(prefix))])  # the duplicates the tree already had
    if match is not None:
        cache.dec_lock_ref(match.last_device_node)


@st.composite
def ops_strategy(draw):
    tokens = st.integers(0, 2)
    longest = 14
    trunk = draw(st.lists(tokens, min_size=longest, max_size=longest))
    bases = []
    for _ in range(draw(st.integers(1, 4))):
        branch_at = draw(st.integers(0, longest))
        bases.append(trunk[:branch_at] + draw(st.lists(tokens, min_size=0, max_size=longest - branch_at)))

    def key(choice: Tuple[int, int]) -> List[int]:
        base = bases[choice[0] % len(bases)]
        return base[: choice[1] % (len(base) + 1)]

    cut = st.tuples(st.integers(0, 3), st.integers(0, 20)).map(key)
    op = st.one_of(
        st.tuples(st.just("insert"), st.tuples(cut, st.booleans(), st.integers(0, 12))),
        st.tuples(st.just("match"), cut),
        st.tuples(st.just("lock"), cut),
        st.tuples(st.just("unlock"), st.integers(0, 1000)),
        st.tuples(st.just("evict"), st.integers(0, 12)),
        st.tuples(st.just("evict_windowed"), st.integers(0, 12)),
    )
    return draw(st.integers(1, 5)), draw(st.lists(op, min_size=1, max_size=30))


def run_model_test(window: int, ops) -> None:
    cache, alloc = make_cache(window)
    model = Model(window)
    held: List[Tuple[TreeNode, Prefix]] = []
    for op, arg in ops:
        if op == "insert":
            key, use_prefix, released = arg
            if key:
                request_insert(cache, alloc, model, key, use_prefix, min(released, len(key)))
        elif op in ("match", "lock"):
            result = cache.match_prefix(arg)
            matched, slots = model.match(arg)
            assert result.device_indices.tolist() == slots
            if op == "lock" and matched:
                cache.inc_lock_ref(result.last_device_node)
                held.append((result.last_device_node, tuple(arg[:matched])))
                model.locks[tuple(arg[:matched])] += 1
        elif op == "unlock":
            if held:
                node, locked = held.pop(arg % len(held))
                cache.dec_lock_ref(node)
                model.locks[locked] -= 1
        elif op == "evict":
            before = dict(model.entries)
            free_before = alloc.available_size()
            freed = cache.evict(arg)
            after = tree_entries(cache)
            gone = set(before) - set(after)
            assert freed == len(gone) and alloc.available_size() == free_before + freed
            assert not gone & model.full_locked(), "evicted a locked prefix"
            for prefix in gone:
                del model.entries[prefix]
            if freed < arg:  # stopped early: nothing evictable may be left
                locked = model.full_locked()
                assert all(p in locked or not model.is_leaf(p) for p in model.entries)
        else:
            before = dict(model.entries)
            swa_free_before = alloc.swa_available_size()
            freed = cache.evict_windowed(arg)
            after = tree_entries(cache)
            changed = {p for p in before if before[p][1] and (p not in after or not after[p][1])}
            assert not {p for p in after if after[p][1] and not before[p][1]}, "windowed eviction revived"
            assert not set(before) - set(after) - changed, "windowed eviction deleted a tombstone"
            assert freed == len(changed) and alloc.swa_available_size() == swa_free_before + freed
            assert not changed & model.swa_locked(), "tombstoned a locked window"
            assert not (set(before) - set(after)) & model.full_locked(), "deleted a locked prefix"
            for prefix in changed:
                if prefix in after:
                    model.entries[prefix] = (before[prefix][0], False)
                else:
                    del model.entries[prefix]
            if freed < arg:
                locked = model.swa_locked()
                assert all(p in locked for p, (_, live) in model.entries.items() if live)
        check(cache, alloc, model)
    for node, locked in held:
        cache.dec_lock_ref(node)
        model.locks[locked] -= 1
    check(cache, alloc, model)
    assert cache.protected_size() == 0 and cache.swa_protected_size() == 0
    cache.evict(CAPACITY)
    assert cache.total_size() == 0
    assert alloc.available_size() == CAPACITY and alloc.swa_available_size() == SWA_CAPACITY


@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops_strategy())
def test_swa_radix_against_model(case):
    window, ops = case
    run_model_test(window, ops)


# ---------------------------------------------------------------- the window rules by hand


def _insert(cache: SWARadixCache, alloc: SWATokenToKVPoolAllocator, key: List[int], released: int = 0) -> torch.Tensor:
    slots = alloc.alloc(len(key))
    assert slots is not None
    alloc.release_swa(slots[:released])
    already = cache.insert(key, slots.clone())
    alloc.free(slots[:already])
    return slots


def test_match_stops_where_the_window_of_the_prefix_lost_its_windowed_kv():
    cache, alloc = make_cache(window=4)
    key = list(range(20))
    slots = _insert(cache, alloc, key, released=10)  # positions 0..9 left the request's window
    # Tombstones above, 10 live tokens below: any end with 4 live tokens before it qualifies.
    assert cache.match_prefix(key).device_indices.tolist() == slots.tolist()
    assert cache.match_prefix(key[:14]).device_indices.tolist() == slots[:14].tolist()
    # Ending at 13 leaves only 3 live tokens in its window: the match ends at the last tombstone (none).
    assert cache.match_prefix(key[:13]).device_indices.numel() == 0
    # Without tombstones any prefix is reusable, however short.
    other = list(range(100, 103))
    other_slots = _insert(cache, alloc, other)
    assert cache.match_prefix(other).device_indices.tolist() == other_slots.tolist()


def test_windowed_eviction_tombstones_lru_nearest_the_root_first_and_revives():
    cache, alloc = make_cache(window=4)
    key = list(range(12))
    slots = _insert(cache, alloc, key)
    node = cache.match_prefix(key[:8]).last_device_node  # splits at 8
    cache.match_prefix(key)  # both halves now have the same access time
    assert cache.evict_windowed(1) == 8  # the upper node (nearer the root) goes first, as a tombstone
    assert not bool(alloc.swa_held(slots[:8]).any()) and bool(alloc.swa_held(slots[8:]).all())
    assert cache.total_size() == 12 and cache.swa_evictable_size() == 4
    assert cache.match_prefix(key[:8]).device_indices.numel() == 0
    assert cache.match_prefix(key).device_indices.tolist() == slots.tolist()  # 4 live tokens end it
    # A request that computed the same tokens again inserts them with its windowed K/V: revived.
    dup = alloc.alloc(8)
    assert cache.insert(key[:8], dup.clone()) == 8
    alloc.free(dup)
    assert cache.match_prefix(key[:8]).device_indices.tolist() == slots[:8].tolist()
    assert node.parent is not None
    cache.sanity_check()
    # A live leaf without any lock is deleted outright (full and windowed K/V) by windowed eviction.
    assert cache.evict_windowed(12) == 12
    assert cache.total_size() == 0 and alloc.available_size() == CAPACITY
    assert alloc.swa_available_size() == SWA_CAPACITY


def test_lock_covers_the_window_of_the_prefix_only():
    cache, alloc = make_cache(window=4)
    key = list(range(12))
    _insert(cache, alloc, key)
    node = cache.match_prefix(key).last_device_node
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 12 and cache.swa_protected_size() == 4
    # The 8 tokens above the window may lose their windowed K/V while the request runs; the window not.
    assert cache.evict_windowed(100) == 8
    assert cache.evict(100) == 0
    cache.sanity_check()
    cache.dec_lock_ref(node)
    assert cache.protected_size() == 0 and cache.swa_protected_size() == 0 and cache.swa_evictable_size() == 4
    with pytest.raises(RuntimeError, match="unbalanced"):
        cache.dec_lock_ref(node)


def test_strict_idle_check_covers_the_tree_against_the_windowed_pool():
    """The strict idle check: both pools' counters, and (those balanced) every node against the allocator's
    map, so a live node whose windowed slots someone else took is a leak, not silently wrong K/V."""
    from engine.scheduler.kv_manager import KVManager, MemoryLeakError

    pool = SWAKVPool(CAPACITY, SWA_CAPACITY, [0], torch.float32, head_num=1, head_dim=1, layer_num=2)
    alloc = SWATokenToKVPoolAllocator(CAPACITY, SWA_CAPACITY, 4, 8, torch.float32, "cpu", pool)
    kv = KVManager(ReqToTokenPool(8, 64), alloc, CAPACITY, 1, 16, "cpu", use_radix_cache=True,
                   strict_memory_check=True)
    cache = kv.tree_cache
    assert isinstance(cache, SWARadixCache)
    _insert(cache, alloc, list(range(12)), released=4)
    kv.check_memory()  # 4 tombstoned tokens, 8 live ones: balanced
    assert kv.state()["swa_evictable_tokens"] == 8
    live = cache.match_prefix(list(range(12))).device_indices[4:6]
    alloc.release_swa(live)  # two windowed slots of a live node freed behind the cache's back...
    assert alloc.swa.alloc(2) is not None  # ...and taken again: the counters still balance
    with pytest.raises(MemoryLeakError, match="a live node lost windowed slots"):
        kv.check_memory()


# ---------------------------------------------------------------- page size 16: whole pages everywhere


def _paged_cache(window: int, page: int = 16):
    pool = SWAKVPool(CAPACITY, 128, [0], torch.float32, head_num=1, head_dim=1, layer_num=2, page_size=page)
    alloc = SWATokenToKVPoolAllocator(CAPACITY, 128, window, 8, torch.float32, "cpu", pool, page_size=page)
    return SWARadixCache(ReqToTokenPool(8, 128), alloc, page, window), alloc


def test_paged_tree_keeps_whole_pages_tombstones_them_and_locks_from_a_page_start():
    cache, alloc = _paged_cache(window=20)
    key = list(range(70))
    slots = alloc.alloc(80)  # five pages; the tree takes the 4 whole pages of the 70 tokens
    assert slots is not None
    alloc.release_swa(slots[:16])  # the first page left the request's window
    assert cache.insert(key, slots.clone()) == 0
    alloc.free(slots[64:])  # the request's own last page
    assert cache.total_size() == 64 and cache.swa_evictable_size() == 48
    # A match ends on a page; 30 tokens with a tombstone above and < 20 live tokens: nothing.
    assert cache.match_prefix(key[:30]).device_indices.numel() == 0
    assert cache.match_prefix(key[:47]).device_indices.numel() == 0  # 32 tokens: 16 live ones end it
    assert cache.match_prefix(key[:50]).device_indices.tolist() == slots[:48].tolist()
    assert cache.match_prefix(key).device_indices.tolist() == slots[:64].tolist()
    # Locking 64 tokens: the window (44..63) starts on the page at 32, so 32 tokens are under the lock.
    node = cache.match_prefix(key).last_device_node
    cache.inc_lock_ref(node)
    assert cache.swa_protected_size() == 32 and cache.protected_size() == 64
    assert cache.evict_windowed(1) == 16  # the unlocked live page (16..31), a tombstone now, whole
    assert not bool(alloc.swa_held(slots[:32]).any()) and bool(alloc.swa_held(slots[32:64]).all())
    cache.sanity_check()
    cache.dec_lock_ref(node)
    assert cache.evict(CAPACITY) == 64
    assert alloc.available_size() == CAPACITY and alloc.swa_available_size() == 128


def test_paged_tombstone_revived_by_a_duplicate_page():
    cache, alloc = _paged_cache(window=8)
    key = list(range(32))
    slots = alloc.alloc(32)
    assert slots is not None
    cache.insert(key, slots.clone())
    cache.match_prefix(key[:16])  # split after the first page
    cache.match_prefix(key)  # same access time: the upper page (nearer the root) goes first
    assert cache.evict_windowed(1) == 16  # the upper page: a tombstone
    assert cache.match_prefix(key[:16]).device_indices.numel() == 0
    dup = alloc.alloc(16)
    assert dup is not None
    assert cache.insert(key[:16], dup.clone()) == 16
    alloc.free(dup)  # its windowed page went to the tree's page
    assert cache.match_prefix(key[:16]).device_indices.tolist() == slots[:16].tolist()
    assert bool(alloc.swa_held(slots).all())
    cache.sanity_check()
    assert cache.evict(CAPACITY) == 32 and alloc.swa_available_size() == 128
