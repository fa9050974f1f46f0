"""SWARadixCache: the radix cache of hybrid sliding-window models (SGLang's SWA radix cache design).

A hybrid model keeps two kinds of K/V per token (swa_pool.py): the full layers' (full slot, the node's
`value`) and the windowed layers' (the allocator's `full_to_swa` map). The tree caches both, but frees
them separately: under windowed-pool pressure a node's windowed K/V goes first and the node stays as a
*tombstone*, its full K/V still cached. A prefix is then reusable only where the windowed layers can
compute its continuation: when the last `window` tokens of the prefix still have windowed K/V (or the
whole prefix does, when shorter). `match_prefix` returns the longest such prefix of the match.

Every node is uniform: all of its tokens hold windowed slots (live) or none does (tombstone). Inserted
tokens whose windowed slots a request already released (they left its window while it ran) become
tombstones; a tombstone that a request inserts again with its windowed K/V held is revived with them.

Locks: a request locks the full K/V of its whole prefix (`lock_ref`, as RadixCache) and the windowed K/V
of its last `window` tokens (`swa_lock_ref`). The node holding position depth - window is split there on
locking, so the windowed lock covers whole nodes and `dec_lock_ref` finds the same nodes from the depth
alone (later splits only add edges). A windowed lock implies a full lock. Eviction of full K/V takes
unlocked leaves (their windowed K/V with them); eviction of windowed K/V (`evict_windowed`) takes live
nodes without a windowed lock, least recently used first and nearer the root first on ties, deleting an
unlocked leaf outright (a tombstone leaf is never reusable) and tombstoning any other.

Paged (page size P > 1) as RadixCache: keys, matches and inserts are whole pages, and so is every node
(the allocator maps and releases windowed K/V a page at a time, so a node is still uniform); the windowed
lock starts at the page holding position depth - window.
"""

from __future__ import annotations

import heapq
import logging
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from engine.mem_cache.base_prefix_cache import CachedReq, MatchResult
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.mem_cache.radix_cache import RadixCache, TreeNode, _empty_slots
from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator

logger = logging.getLogger(__name__)


class SWATreeNode(TreeNode):
    __slots__ = ("swa_lock_ref", "swa_tombstone")

    def __init__(self, node_id: int, key: List[int], value: torch.Tensor, parent: Optional[TreeNode],
                 last_access_time: int, extra_key: Optional[Hashable] = None) -> None:
        super().__init__(node_id, key, value, parent, last_access_time, extra_key)
        self.swa_lock_ref = 0
        self.swa_tombstone = False

    def __repr__(self) -> str:
        return (f"SWATreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref}, "
                f"swa_lock_ref={self.swa_lock_ref}, tombstone={self.swa_tombstone})")


def _swa(node: TreeNode) -> SWATreeNode:
    assert isinstance(node, SWATreeNode)  # every node of this tree is made by _new_node
    return node


def _runs(mask: torch.Tensor) -> List[Tuple[int, int, bool]]:
    """(start, end, value) of the maximal runs of equal values in a 1-D bool tensor."""
    values = mask.tolist()
    runs: List[Tuple[int, int, bool]] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append((start, i, bool(values[start])))
            start = i
    return runs


class SWARadixCache(RadixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: SWATokenToKVPoolAllocator,
                 page_size: int, window: int) -> None:
        if page_size != token_to_kv_pool_allocator.page_size:
            raise ValueError(f"SWARadixCache: page size {page_size} differs from the pool's "
                             f"{token_to_kv_pool_allocator.page_size}")
        if window < 1:
            raise ValueError(f"SWARadixCache: window must be >= 1, got {window}")
        self.window = window
        self.swa_allocator = token_to_kv_pool_allocator
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size)

    # ------------------------------------------------------------------ tree basics

    def reset(self) -> None:
        super().reset()
        # Requests whose lock cache_unfinished_req took, by id: (the request, its node, its floor). The
        # request is kept so that its id cannot be reused while the entry exists.
        self._req_locks: Dict[int, Tuple[CachedReq, TreeNode, Optional[int]]] = {}
        _swa(self.root).swa_lock_ref = 1  # like lock_ref: the root is never evicted or counted
        self._swa_evictable_size = 0
        self._swa_protected_size = 0

    def _new_node(self, key: List[int], value: torch.Tensor, parent: Optional[TreeNode],
                  extra_key: Optional[Hashable] = None) -> TreeNode:
        node = SWATreeNode(self._next_id, key, value, parent, self._clock, extra_key)
        self._next_id += 1
        return node

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        upper = _swa(super()._split(child, split_len))
        # Both halves lie on the same paths: same windowed locks and state (the sizes do not change).
        upper.swa_lock_ref = _swa(child).swa_lock_ref
        upper.swa_tombstone = _swa(child).swa_tombstone
        return upper

    def _split_runs(self, node: SWATreeNode, mask: torch.Tensor) -> List[Tuple[SWATreeNode, bool]]:
        """Cut `node` where `mask` (one value per token) changes; the pieces top-down with their value.
        The last piece is `node` itself (splitting keeps the lower part in the original object)."""
        pieces: List[Tuple[SWATreeNode, bool]] = []
        cut = 0
        for start, end, value in _runs(mask):
            if end < len(mask):
                pieces.append((_swa(self._split(node, end - cut)), value))
                cut = end
            else:
                pieces.append((node, value))
        return pieces

    def _walk(self, key: List[int], extra_key: Optional[Hashable]) -> List[SWATreeNode]:
        """The nodes of the longest cached prefix of `key` (RadixCache._match_path), tombstones included."""
        return [_swa(node) for node in self._match_path(key, extra_key)]

    def _usable(self, path: List[SWATreeNode]) -> int:
        """How many nodes of `path` the longest reusable prefix spans: it ends where the tokens since the
        last tombstone are at least a window (or no tombstone lies above)."""
        best = 0
        live_run = 0
        clean = True  # no tombstone from the root down to here
        for i, node in enumerate(path):
            if node.swa_tombstone:
                clean = False
                live_run = 0
                continue
            live_run += len(node.key)
            if clean or live_run >= self.window:
                best = i + 1
        return best

    # ------------------------------------------------------------------ public tree API

    def match_prefix(self, key: List[int], extra_key: Optional[Hashable] = None) -> MatchResult:
        if len(key) < self.page_size:
            return MatchResult(_empty_slots(self.device), self.root)
        path = self._walk(list(key[: self._page_floor(len(key))]), extra_key)
        usable = self._usable(path)
        if usable == 0:
            return MatchResult(_empty_slots(self.device), self.root)
        return MatchResult(torch.cat([n.value for n in path[:usable]]), path[usable - 1])

    def insert(self, key: List[int], value: torch.Tensor, extra_key: Optional[Hashable] = None) -> int:
        aligned = self._page_floor(len(key))
        if value.numel() < aligned:
            raise ValueError(f"insert: value has {value.numel()} slots for a key of {aligned} tokens")
        key = list(key[:aligned])
        value = value[:aligned].to(torch.int64)
        held = self.swa_allocator.swa_held(value)
        now = self._tick()
        node = self.root
        pos = 0
        while pos < len(key):
            child_key = self._index(node, self._child_key(key, pos), extra_key)
            child = node.children.get(child_key)
            if child is None:
                leaf = _swa(self._new_node(key[pos:], value[pos:], node, extra_key))
                leaf.last_access_time = now
                node.children[child_key] = leaf
                self._evictable_size += len(leaf.key)
                for piece, live in self._split_runs(leaf, held[pos:]):
                    # The request's windowed slots pass to the tree where it still held them.
                    piece.swa_tombstone = not live
                    if live:
                        self._swa_evictable_size += len(piece.key)
                return pos
            matched = self._match_len(child.key, key, pos)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access_time = now
            if _swa(child).swa_tombstone:
                self._revive(_swa(child), value[pos:pos + matched], held[pos:pos + matched])
            node = child
            pos += matched
        return pos

    def _revive(self, node: SWATreeNode, slots: torch.Tensor, held: torch.Tensor) -> None:
        """A tombstone met again by an insert: where the inserted duplicate (not the node's own slots)
        still holds windowed K/V, the node takes it over, so the prefix becomes reusable again."""
        revivable = held & (slots != node.value)
        if not bool(revivable.any()):
            return
        offset = 0
        for piece, revive in self._split_runs(node, revivable):
            n = len(piece.key)
            if revive:
                self.swa_allocator.move_swa(slots[offset:offset + n], piece.value)
                piece.swa_tombstone = False
                assert piece.swa_lock_ref == 0  # tombstones are never under a windowed lock
                self._swa_evictable_size += n
            offset += n

    def evict(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        released: List[torch.Tensor] = []
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            released.append(leaf.value)
            freed += len(leaf.key)
            parent = self._delete_leaf(_swa(leaf))
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if released:
            # The allocator frees each full slot's windowed slot with it (live leaves hold one).
            self.token_to_kv_pool_allocator.free(torch.cat(released))
        return freed

    def _delete_leaf(self, leaf: SWATreeNode) -> TreeNode:
        """Unlink an unlocked leaf and uncount it (its slots are freed by the caller); returns its parent."""
        parent = leaf.parent
        assert parent is not None and leaf.lock_ref == 0 and not leaf.children
        del parent.children[self._index_of(leaf)]
        leaf.parent = None
        self._evictable_size -= len(leaf.key)
        if not leaf.swa_tombstone:
            self._swa_evictable_size -= len(leaf.key)
        return parent

    def evict_windowed(self, num_tokens: int) -> int:
        if num_tokens <= 0:
            return 0
        # (time, depth): on equal times the node nearer the root goes first, keeping the windows' ends.
        heap: List[Tuple[int, int, int, SWATreeNode]] = []
        stack: List[Tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            stack.extend((c, depth + 1) for c in node.children.values())
            swa_node = _swa(node)
            if node is not self.root and not swa_node.swa_tombstone and swa_node.swa_lock_ref == 0:
                heap.append((node.last_access_time, depth, node.id, swa_node))
        heapq.heapify(heap)
        freed = 0
        deleted: List[torch.Tensor] = []
        while freed < num_tokens and heap:
            _, _, _, node = heapq.heappop(heap)
            freed += len(node.key)
            if not node.children and node.lock_ref == 0:
                deleted.append(node.value)
                self._delete_leaf(node)
            else:
                self.swa_allocator.release_swa(node.value)
                node.swa_tombstone = True
                self._swa_evictable_size -= len(node.key)
        if deleted:
            self.token_to_kv_pool_allocator.free(torch.cat(deleted))
        return freed

    def _depth(self, node: TreeNode) -> int:
        depth = 0
        walker: Optional[TreeNode] = node
        while walker is not self.root:
            if walker is None:
                raise RuntimeError("lock: node is not attached to this tree (evicted or reset)")
            depth += len(walker.key)
            walker = walker.parent
        return depth

    def inc_lock_ref(self, node: Optional[TreeNode]) -> int:
        return self._lock(node, None)

    def dec_lock_ref(self, node: Optional[TreeNode]) -> int:
        return self._unlock(node, None)

    def _window_start(self, depth: int, floor: Optional[int]) -> int:
        """Where the windowed lock of a prefix of `depth` tokens starts: its last window, or from `floor`
        (a request's in-flight read start) when that is lower."""
        start = depth - self.window if floor is None else min(depth - self.window, floor)
        return self._page_floor(max(start, 0))  # nodes are whole pages

    def _lock(self, node: Optional[TreeNode], floor: Optional[int]) -> int:
        if node is None or node is self.root:
            return 0
        depth = self._depth(node)
        boundary = self._window_start(depth, floor)
        delta = 0
        end = depth
        walker: Optional[TreeNode] = node
        while walker is not self.root:
            assert walker is not None  # _depth walked this path to the root
            current = _swa(walker)
            start = end - len(current.key)
            if start < boundary < end:
                # Cut where the window starts: the windowed lock then covers whole nodes.
                self._split(current, boundary - start)
                start = boundary
            if current.lock_ref == 0:
                self._evictable_size -= len(current.key)
                self._protected_size += len(current.key)
                delta -= len(current.key)
            current.lock_ref += 1
            if start >= boundary:
                if current.swa_tombstone:
                    raise RuntimeError(f"inc_lock_ref: {current} lies in the window of the locked prefix "
                                       f"but its windowed K/V is gone (match_prefix never returns that)")
                if current.swa_lock_ref == 0:
                    self._swa_evictable_size -= len(current.key)
                    self._swa_protected_size += len(current.key)
                current.swa_lock_ref += 1
            end = start
            walker = current.parent
        return delta

    def _unlock(self, node: Optional[TreeNode], floor: Optional[int]) -> int:
        if node is None or node is self.root:
            return 0
        depth = self._depth(node)
        boundary = self._window_start(depth, floor)
        delta = 0
        end = depth
        walker: Optional[TreeNode] = node
        while walker is not self.root:
            assert walker is not None
            current = _swa(walker)
            start = end - len(current.key)
            if current.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref: {current} is not locked (unbalanced unlock)")
            if current.lock_ref == 1:
                self._evictable_size += len(current.key)
                self._protected_size -= len(current.key)
                delta += len(current.key)
            current.lock_ref -= 1
            if start >= boundary:
                if current.swa_lock_ref <= 0 or current.swa_tombstone:
                    raise RuntimeError(f"dec_lock_ref: {current} has no windowed lock (unbalanced unlock)")
                if current.swa_lock_ref == 1:
                    self._swa_evictable_size += len(current.key)
                    self._swa_protected_size -= len(current.key)
                current.swa_lock_ref -= 1
            end = start
            walker = current.parent
        return delta

    def _release_req_lock(self, req: CachedReq) -> None:
        """Undo the lock `req` holds on its last node: the one cache_unfinished_req took (from the floor
        it recorded), else the plain one its admission took."""
        entry = self._req_locks.get(id(req))
        if entry is not None and entry[0] is req:
            del self._req_locks[id(req)]
            assert entry[1] is req.last_node, "a request's lock moved without the cache"
            self._unlock(entry[1], entry[2])
        else:
            self.dec_lock_ref(req.last_node)

    def swa_evictable_size(self) -> int:
        """Windowed-layer slots held by unlocked live nodes."""
        return self._swa_evictable_size

    def swa_protected_size(self) -> int:
        """Windowed-layer slots held by live nodes under a windowed lock."""
        return self._swa_protected_size

    def sanity_check(self) -> None:
        super().sanity_check()
        evictable = protected = 0
        for node in self._nodes():
            if node is self.root:
                continue
            current = _swa(node)
            held = self.swa_allocator.swa_held(current.value)
            if current.swa_tombstone:
                assert not bool(held.any()), f"{current}: a tombstone holds windowed slots"
                assert current.swa_lock_ref == 0, f"{current}: a tombstone under a windowed lock"
                continue
            assert bool(held.all()), f"{current}: a live node lost windowed slots"
            assert current.lock_ref >= current.swa_lock_ref, f"{current}: windowed lock without full lock"
            if current.swa_lock_ref:
                protected += len(current.key)
            else:
                evictable += len(current.key)
        assert evictable == self._swa_evictable_size, f"swa evictable {self._swa_evictable_size} != tree {evictable}"
        assert protected == self._swa_protected_size, f"swa protected {self._swa_protected_size} != tree {protected}"

    def pretty_print(self) -> str:
        lines = [f"SWARadixCache(window={self.window}, evictable={self._evictable_size}, "
                 f"protected={self._protected_size}, swa_evictable={self._swa_evictable_size}, "
                 f"swa_protected={self._swa_protected_size})"]

        def visit(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda n: n.id):
                current = _swa(child)
                lines.append(f"{'  ' * depth}- key={child.key[:8]}{'...' if len(child.key) > 8 else ''} "
                             f"len={len(child.key)} lock_ref={child.lock_ref} swa_lock_ref={current.swa_lock_ref} "
                             f"tombstone={current.swa_tombstone} t={child.last_access_time}")
                visit(child, depth + 1)

        visit(self.root, 1)
        return "\n".join(lines)

    # ------------------------------------------------------------------ request-level API

    def cache_finished_req(self, req: CachedReq, is_insert: bool = True) -> None:
        """As RadixCache's (insert what it computed, free its duplicates and tail, release its row and
        lock), with the lock released as it was taken."""
        if req.req_pool_idx is not None:
            row = req.req_pool_idx
            kv = self.req_to_token_pool.req_to_token[row, : req.kv_allocated_len].to(torch.int64)
            protected = req.cache_protected_len
            if is_insert:
                token_ids = list(req.origin_input_ids) + list(req.output_ids)
                # The last sampled token was never fed to the model, so it has no KV.
                committed = self._page_floor(max(min(len(token_ids) - 1, req.kv_allocated_len), 0))
                new_prefix_len = self.insert(token_ids[:committed], kv[:committed].clone(), req.extra_key)
                # Duplicates and the tail past the last whole page in one call: no page freed twice.
                to_free = torch.cat((kv[protected:new_prefix_len], kv[max(committed, protected):]))
            else:
                to_free = kv[protected:]
            self.token_to_kv_pool_allocator.free(to_free)
            self.req_to_token_pool.free(row)
        self._release_req_lock(req)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = _empty_slots(self.device)
        req.cache_protected_len = 0
        req.kv_allocated_len = 0

    def _cached_len(self, key: List[int], extra_key: Optional[Hashable]) -> int:
        """How much of `key` the tree holds, looked up without touching it (no split, no access time)."""
        node = self.root
        pos = 0
        while pos < len(key):
            child = node.children.get(self._index(node, self._child_key(key, pos), extra_key))
            if child is None:
                break
            matched = self._match_len(child.key, key, pos)
            pos += matched
            if matched < len(child.key):
                break
            node = child
        return pos

    def cache_unfinished_req(self, req: CachedReq) -> None:
        """After a prefill chunk (or the whole prompt): the computed tokens become the tree's, locked.

        Under overlap this runs while the chunk's forward may still be in flight, reading the windowed
        K/V of the positions from its read start on through the allocator's map: the lock then covers
        those too (the floor), until the request's next chunk or its end. For the same reason the
        request's copies of tokens the tree already holds (another request computed them meanwhile)
        are not swapped for the tree's here, which would free them under the forward: the request keeps
        its own KV and the tree gets it when the request finishes."""
        row = req.req_pool_idx
        assert row is not None  # a request being prefilled holds a row
        fill_len = len(req.fill_ids)
        protected = req.cache_protected_len
        if fill_len < protected:
            raise RuntimeError(f"cache_unfinished_req: fill length {fill_len} is below the request's "
                               f"cached prefix {protected}")
        kv = self.req_to_token_pool.req_to_token[row, :fill_len].to(torch.int64)
        aligned = self._page_floor(fill_len)  # the tree takes whole pages; the request keeps its last part
        key = list(req.fill_ids[:aligned])
        if aligned <= protected or self._cached_len(key, req.extra_key) > protected:
            req.prefix_indices = kv
            return
        assert self.insert(key, kv[:aligned].clone(), req.extra_key) == protected
        path = self._walk(key, req.extra_key)
        last = path[-1]
        # A chunk whose result is not processed yet may be in flight (overlap): hold what it reads.
        floor = self.swa_allocator.read_floor(row) if req.is_chunked > 0 else None
        self._lock(last, floor)
        # Lock the new node before unlocking the old one so the shared path never looks evictable.
        self._release_req_lock(req)
        self._req_locks[id(req)] = (req, last, floor)
        req.prefix_indices = kv
        req.last_node = last
        req.cache_protected_len = aligned
