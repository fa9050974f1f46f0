"""RadixCache: a token-keyed radix tree over KV slots, shared across requests.

Each edge holds a run of token ids (`key`) and the KV slots that hold their K/V (`value`). Two
requests with a common prompt prefix reuse the same slots. Nodes that a running request depends on
are locked (`lock_ref > 0`); unlocked leaves are evicted least-recently-used first when the pool
runs short.

With page size P > 1 keys are compared a page at a time and every match/insert length is floored
to a multiple of P: a physical page is then either wholly owned by the tree or wholly owned by one
request, so it can be freed as a unit.

Cache namespaces (SGLang's `extra_key` / `cache_salt`): a key may come with an `extra_key`; the
root's children are indexed by (extra_key, first token or page), so keys of different namespaces
never share a node, and nothing below the root needs to know.
"""

from __future__ import annotations

import heapq
import logging
from typing import Any, Dict, Hashable, Iterator, List, Optional, Tuple, Union

import torch

from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator
from engine.mem_cache.base_prefix_cache import BasePrefixCache, CachedReq, MatchResult
from engine.mem_cache.memory_pool import ReqToTokenPool

logger = logging.getLogger(__name__)

ChildKey = Union[int, Tuple[Any, ...]]


class TreeNode:
    """One edge of the tree: `key` tokens stored in `value` slots, below `parent`, in the cache
    namespace `extra_key` (None: the shared one)."""

    __slots__ = ("id", "children", "parent", "key", "value", "lock_ref", "last_access_time", "extra_key")

    def __init__(self, node_id: int, key: List[int], value: torch.Tensor,
                 parent: Optional[TreeNode], last_access_time: int, extra_key: Optional[Hashable] = None) -> None:
        self.id = node_id
        self.children: Dict[ChildKey, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.extra_key = extra_key

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


def _empty_slots(device: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64, device=device)


class RadixCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool_allocator: PagedTokenToKVPoolAllocator,
                 page_size: int, disable: bool = False) -> None:
        if page_size < 1:
            raise ValueError(f"RadixCache: page_size must be >= 1, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.device = token_to_kv_pool_allocator.device
        self.reset()

    # ------------------------------------------------------------------ tree basics

    def reset(self) -> None:
        self._next_id = 0
        # A logical clock instead of wall time: LRU order is then deterministic and testable.
        self._clock = 0
        self.root = self._new_node([], _empty_slots(self.device), None)
        self.root.lock_ref = 1  # permanently locked: never evicted, never counted
        self._evictable_size = 0
        self._protected_size = 0

    def _new_node(self, key: List[int], value: torch.Tensor, parent: Optional[TreeNode],
                  extra_key: Optional[Hashable] = None) -> TreeNode:
        node = TreeNode(self._next_id, key, value, parent, self._clock, extra_key)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _child_key(self, key: List[int], start: int = 0) -> ChildKey:
        """Children are indexed by their first page (first token when P == 1)."""
        if self.page_size == 1:
            return key[start]
        return tuple(key[start: start + self.page_size])

    def _index(self, parent: TreeNode, child_key: ChildKey, extra_key: Optional[Hashable]) -> ChildKey:
        """How `parent.children` indexes a child: under the root, with the namespace."""
        if parent is self.root and extra_key is not None:
            return (extra_key, child_key)
        return child_key

    def _index_of(self, node: TreeNode) -> ChildKey:
        assert node.parent is not None
        return self._index(node.parent, self._child_key(node.key), node.extra_key)

    def _match_len(self, node_key: List[int], key: List[int], start: int) -> int:
        """Common prefix length of `node_key` and `key[start:]`, floored to whole pages."""
        limit = min(len(node_key), len(key) - start)
        i = 0
        while i < limit and node_key[i] == key[start + i]:
            i += 1
        # A page is shared only when all of its tokens agree.
        return i - i % self.page_size

    def _page_floor(self, n: int) -> int:
        return n - n % self.page_size

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after `split_len` tokens; returns the new upper node."""
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.key)
        upper = self._new_node(child.key[:split_len], child.value[:split_len], parent, child.extra_key)
        # The upper part lies on every path through `child`, so it carries the same locks and age.
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        parent.children[self._index_of(upper)] = upper
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        child.parent = upper
        upper.children[self._child_key(child.key)] = child
        return upper

    # ------------------------------------------------------------------ public tree API

    def match_prefix(self, key: List[int], extra_key: Optional[Hashable] = None) -> MatchResult:
        if self.disable or len(key) < self.page_size:
            return MatchResult(_empty_slots(self.device), self.root)
        path = self._match_path(list(key[: self._page_floor(len(key))]), extra_key)
        indices = torch.cat([n.value for n in path]) if path else _empty_slots(self.device)
        return MatchResult(indices, path[-1] if path else self.root)

    def _match_path(self, key: List[int], extra_key: Optional[Hashable]) -> List[TreeNode]:
        """The nodes of the longest cached prefix of `key`, root excluded, access times refreshed; the
        last one split to end where the match does, so it covers exactly the match and can be locked
        alone."""
        now = self._tick()
        node = self.root
        path: List[TreeNode] = []
        pos = 0
        while pos < len(key):
            child = node.children.get(self._index(node, self._child_key(key, pos), extra_key))
            if child is None:
                break
            matched = self._match_len(child.key, key, pos)
            ends_inside = matched < len(child.key)
            if ends_inside:
                child = self._split(child, matched)
            child.last_access_time = now
            path.append(child)
            node = child
            pos += matched
            if ends_inside:
                break
        return path

    def insert(self, key: List[int], value: torch.Tensor, extra_key: Optional[Hashable] = None) -> int:
        if self.disable:
            return 0
        aligned = self._page_floor(len(key))
        if value.numel() < aligned:
            raise ValueError(f"insert: value has {value.numel()} slots for a key of {aligned} tokens")
        key = list(key[:aligned])
        value = value[:aligned].to(torch.int64)
        now = self._tick()
        node = self.root
        pos = 0
        while pos < aligned:
            child_key = self._index(node, self._child_key(key, pos), extra_key)
            child = node.children.get(child_key)
            if child is None:
                leaf = self._new_node(key[pos:], value[pos:], node, extra_key)
                leaf.last_access_time = now
                node.children[child_key] = leaf
                self._evictable_size += len(leaf.key)
                return pos
            matched = self._match_len(child.key, key, pos)
            if matched < len(child.key):
                child = self._split(child, matched)
            child.last_access_time = now
            node = child
            pos += matched
        return pos

    def evict(self, num_tokens: int) -> int:
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(heap)
        freed = 0
        released: List[torch.Tensor] = []
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            released.append(leaf.value)
            freed += len(leaf.key)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._index_of(leaf)]
            self._evictable_size -= len(leaf.key)
            leaf.parent = None
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        if released:
            # One free call: pages of different nodes are distinct, so nothing is freed twice.
            self.token_to_kv_pool_allocator.free(torch.cat(released))
        return freed

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and node.lock_ref == 0 and not node.children

    def inc_lock_ref(self, node: Optional[TreeNode]) -> int:
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root:
            if node is None:
                raise RuntimeError("inc_lock_ref: node is not attached to this tree (evicted or reset)")
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: Optional[TreeNode]) -> int:
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root:
            if node is None:
                raise RuntimeError("dec_lock_ref: node is not attached to this tree (evicted or reset)")
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref: {node} is not locked (unbalanced unlock)")
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        return sum(len(n.value) for n in self._nodes())

    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def sanity_check(self) -> None:
        """Raise AssertionError if the tree's structure or size counters are inconsistent."""
        evictable = protected = 0
        for node in self._nodes():
            if node is self.root:
                continue
            assert len(node.key) == len(node.value) > 0, f"{node}: key/value length mismatch"
            assert len(node.key) % self.page_size == 0, f"{node}: key not page aligned"
            assert node.parent is not None and node.parent.children.get(self._index_of(node)) is node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), f"{node}: lock below children"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable_size, f"evictable {self._evictable_size} != tree {evictable}"
        assert protected == self._protected_size, f"protected {self._protected_size} != tree {protected}"

    def pretty_print(self) -> str:
        lines = [f"RadixCache(page_size={self.page_size}, evictable={self._evictable_size}, "
                 f"protected={self._protected_size})"]

        def visit(node: TreeNode, depth: int) -> None:
            for child in sorted(node.children.values(), key=lambda n: n.id):
                shown = child.key[:8]
                more = "..." if len(child.key) > 8 else ""
                lines.append(f"{'  ' * depth}- key={shown}{more} len={len(child.key)} "
                             f"lock_ref={child.lock_ref} t={child.last_access_time}")
                visit(child, depth + 1)

        visit(self.root, 1)
        return "\n".join(lines)

    # ------------------------------------------------------------------ request-level API

    def cache_finished_req(self, req: CachedReq, is_insert: bool = True) -> None:
        if req.req_pool_idx is not None:
            row = req.req_pool_idx
            kv = self.req_to_token_pool.req_to_token[row, : req.kv_allocated_len].to(torch.int64)
            protected = req.cache_protected_len
            if is_insert and not self.disable:
                token_ids = list(req.origin_input_ids) + list(req.output_ids)
                # The last sampled token was never fed to the model, so it has no KV.
                committed = min(len(token_ids) - 1, req.kv_allocated_len)
                aligned = self._page_floor(max(committed, 0))
                new_prefix_len = self.insert(token_ids[:aligned], kv[:aligned].clone(), req.extra_key)
                # Duplicates (the tree already had them) and the unaligned/over-allocated tail go
                # in one call, so a page is never freed twice.
                to_free = torch.cat((kv[protected:new_prefix_len], kv[max(aligned, protected):]))
            else:
                to_free = kv[protected:]
            self.token_to_kv_pool_allocator.free(to_free)
            self.req_to_token_pool.free(row)
        self.dec_lock_ref(req.last_node)
        req.req_pool_idx = None
        req.last_node = None
        req.prefix_indices = _empty_slots(self.device)
        req.cache_protected_len = 0
        req.kv_allocated_len = 0

    def cache_unfinished_req(self, req: CachedReq) -> None:
        row = req.req_pool_idx
        fill_len = len(req.fill_ids)
        kv = self.req_to_token_pool.req_to_token[row, :fill_len].to(torch.int64)
        if self.disable:
            req.prefix_indices = kv
            return
        aligned = self._page_floor(fill_len)
        protected = req.cache_protected_len
        if aligned < protected:
            raise RuntimeError(f"cache_unfinished_req: fill length {fill_len} is below the request's "
                               f"cached prefix {protected}")
        new_prefix_len = self.insert(list(req.fill_ids[:aligned]), kv[:aligned].clone(), req.extra_key)
        if new_prefix_len > protected:
            self.token_to_kv_pool_allocator.free(kv[protected:new_prefix_len])
        match = self.match_prefix(list(req.fill_ids[:aligned]), req.extra_key)
        tree_slots = match.device_indices
        assert tree_slots.numel() == aligned, "the prefix just inserted must match in full"
        if aligned > protected:
            # Point the row at the tree's copy: the request's duplicates were just freed.
            self.req_to_token_pool.write((row, slice(protected, aligned)), tree_slots[protected:aligned])
        # Lock the new node before unlocking the old one so the shared path never looks evictable.
        self.inc_lock_ref(match.last_device_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat((tree_slots, kv[aligned:]))
        req.last_node = match.last_device_node
        req.cache_protected_len = aligned
