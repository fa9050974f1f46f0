"""The interface the scheduler uses for prefix caches (RadixCache, ChunkCache)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Hashable, List, Optional, Protocol

import torch


class CachedReq(Protocol):
    """The attributes of a request (the scheduler's `Req`) that the request-level operations read
    and write; declared here so that the caches never import the scheduler."""

    origin_input_ids: List[int]
    output_ids: List[int]
    fill_ids: List[int]  # tokens in the KV after this round
    req_pool_idx: Optional[int]  # its ReqToTokenPool row
    prefix_indices: torch.Tensor  # KV slots of its cached prefix
    last_node: Any  # the cache node that prefix ends at (locked while the request runs)
    cache_protected_len: int  # row positions owned by the cache
    kv_allocated_len: int  # row positions holding slots the request allocated or borrowed
    extra_key: Optional[Hashable]  # its cache namespace
    is_chunked: int  # its prefill chunks whose results are not processed yet (one may be in flight)


@dataclass(slots=True)
class MatchResult:
    """Result of `match_prefix`.

    `device_indices`: KV slots (int64) of the longest cached prefix of the key.
    `last_device_node`: the deepest tree node of that prefix; lock it to keep the prefix alive.
    """

    device_indices: torch.Tensor
    last_device_node: Any


class BasePrefixCache(abc.ABC):
    """KV prefix cache over `ReqToTokenPool` rows and a token-to-KV allocator.

    Request-level operations read and write a request's `CachedReq` attributes.
    """

    # True when requests never share prefixes (ChunkCache, or a disabled RadixCache).
    disable: bool = False

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop all cached entries (does not free their slots; pair with `allocator.clear()`)."""

    @abc.abstractmethod
    def match_prefix(self, key: List[int], extra_key: Optional[Hashable] = None) -> MatchResult:
        """Longest cached prefix of `key` in the namespace `extra_key` (None: the shared one)."""

    @abc.abstractmethod
    def insert(self, key: List[int], value: torch.Tensor, extra_key: Optional[Hashable] = None) -> int:
        """Cache `value` slots under `key` in namespace `extra_key`; returns the prefix length that
        was already cached."""

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` evictable slots if possible; returns how many were freed."""

    def evict_windowed(self, num_tokens: int) -> int:
        """Free at least `num_tokens` windowed-layer slots of the hybrid sliding-window pool if possible
        (SWARadixCache); returns how many were freed. Caches that hold none have nothing to free."""
        return 0

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> int:
        """Protect `node` and its ancestors from eviction; returns the change in evictable size."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> int:
        """Undo one `inc_lock_ref(node)`; returns the change in evictable size."""

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Tokens cached in unlocked nodes."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Tokens cached in locked nodes."""

    @abc.abstractmethod
    def total_size(self) -> int:
        """All tokens cached."""

    @abc.abstractmethod
    def cache_finished_req(self, req: CachedReq, is_insert: bool = True) -> None:
        """Release a finished (or aborted/retracted when `is_insert` is False) request's KV and row."""

    @abc.abstractmethod
    def cache_unfinished_req(self, req: CachedReq) -> None:
        """After a prefill chunk: make the processed prefix shareable and keep the row."""

    @abc.abstractmethod
    def pretty_print(self) -> str:
        """A human-readable dump for debugging."""
