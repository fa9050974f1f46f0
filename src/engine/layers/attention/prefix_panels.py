"""Cascade prefixes' K^T and V panels kept from one decode step to the next (CPU, bfloat16).

decode_attention.c's cascade multiplies a group's query rows with its shared prefix over panels of the
prefix's K^T and V (attend_step.h, on AMX tiles or AVX512-BF16 registers). Packing them from the pool
every layer of every step costs as much as it saves, although a prefix's K/V cannot change while
requests decode on it: on the 2-core Intel Xeon with AMX, 8 groups x 16 requests over 1024-token
prefixes, the repacking was 35-45% of the kernel's time (5.6-6.6 -> 3.4-4.2 ms a layer with it
skipped); on the 2-core AMD EPYC Zen 4 the same case took 3.5-3.9 ms a layer packing afresh and 2.3
with kept panels. `PrefixPanels` gives each prefix (its pool slots) a buffer with one block per layer;
the kernel packs a layer's block at the prefix's first step and stamps it with the fill's token, and
later steps read it as it is, in order, the next step's panels prefetched.

A kept copy is the prefix's while none of its slots went back to the allocator since it was made:
the pool counts each slot's releases (`MHATokenToKVPool.slot_generation`), and a prefix whose
counts moved is packed again under a new token. The copies take at most `budget_bytes` (default
1/8 of the KV pool's bytes); the least recently used go first, and a prefix that does not fit is
packed afresh each step, as without this.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from engine.kernels import attention as attention_kernels
from engine.kernels import library
from engine.kernels.boundary import AttentionKernels

if TYPE_CHECKING:
    from engine.mem_cache.memory_pool import MHATokenToKVPool

# Without a budget given, kept panels take at most this share of the KV pool's bytes.
DEFAULT_BUDGET_SHARE = 1 / 8


@dataclass
class _Kept:
    buffer: torch.Tensor  # [layers, elems] int16: each layer's block (decode_attention.c's layout)
    generations: torch.Tensor  # the pool's slot_generation at those slots when `token` was drawn
    token: int
    last_step: int


class PrefixPanels:
    """The kept panels of one KV pool's cascade prefixes (one per attention backend)."""

    def __init__(self, budget_bytes: Optional[int] = None) -> None:
        self.budget_bytes = budget_bytes
        self._kept: Dict[Tuple[int, bytes], _Kept] = {}
        self._pool: Optional["MHATokenToKVPool"] = None
        self._used = 0
        self._step = 0
        self._tokens = itertools.count(1)

    @property
    def kept_bytes(self) -> int:
        return self._used

    def attach(self, cascade: attention_kernels.CascadeTables, prefixes: List[torch.Tensor],
               pool: "MHATokenToKVPool") -> None:
        """Sets cascade.kept / kept_tokens for the groups whose prefixes (`prefixes[g]`: slots, in the
        cascade's group order) get kept panels; leaves them None where the kernel would not use them
        (no AVX512-BF16, a head size it does not take, a pool that does not count releases)."""
        generation = pool.slot_generation
        lib = library.attention()
        if (generation is None or lib is None or pool.dtype != torch.bfloat16 or not prefixes
                or lib.kept_prefix_elems(1, pool.head_num, pool.head_dim) == 0):
            return
        if pool is not self._pool:  # another pool: nothing kept is its
            self.clear()
            self._pool = pool
        budget = self.budget_bytes
        if budget is None:
            budget = int(pool.bytes_per_token() * pool.size * DEFAULT_BUDGET_SHARE)
        self._step += 1
        addresses = torch.zeros(pool.layer_num, len(prefixes), dtype=torch.int64)
        tokens = torch.zeros(len(prefixes), dtype=torch.int64)
        buffers: List[torch.Tensor] = []
        for g, slots in enumerate(prefixes):
            kept = self._lookup(slots, generation, pool, lib, budget)
            if kept is None:
                continue
            kept.last_step = self._step
            addresses[:, g] = torch.tensor([row.data_ptr() for row in kept.buffer])
            tokens[g] = kept.token
            buffers.append(kept.buffer)
        if buffers:
            cascade.kept, cascade.kept_tokens, cascade.kept_buffers = addresses, tokens, tuple(buffers)

    def clear(self) -> None:
        self._kept.clear()
        self._used = 0

    def _lookup(self, slots: torch.Tensor, generation: torch.Tensor, pool: "MHATokenToKVPool", lib: AttentionKernels,
                budget: int) -> Optional[_Kept]:
        slots = slots.to(torch.int64).contiguous()
        key = (slots.numel(), slots.numpy().tobytes())
        now = generation.index_select(0, slots)
        kept = self._kept.get(key)
        if kept is not None:
            if not torch.equal(kept.generations, now):  # a slot was released since: pack again
                kept.generations, kept.token = now, next(self._tokens)
            return kept
        elems = int(lib.kept_prefix_elems(slots.numel(), pool.head_num, pool.head_dim))
        need = pool.layer_num * elems * 2
        if not self._make_room(need, budget):
            return None
        # Zeroed: no block's header may hold a token before the kernel stamps it (tokens start at 1).
        kept = _Kept(torch.zeros(pool.layer_num, elems, dtype=torch.int16), now, next(self._tokens), 0)
        self._kept[key] = kept
        self._used += need
        return kept

    def _make_room(self, need: int, budget: int) -> bool:
        """Drops the least recently used prefixes not used in this step until `need` more bytes fit."""
        if need > budget:
            return False
        idle = sorted((k for k, v in self._kept.items() if v.last_step < self._step),
                      key=lambda k: self._kept[k].last_step)
        for key in idle:
            if self._used + need <= budget:
                break
            self._used -= self._kept.pop(key).buffer.numel() * 2
        return self._used + need <= budget
