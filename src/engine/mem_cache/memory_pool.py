"""Physical memory: the request-to-token table and the per-layer K/V buffers."""

from __future__ import annotations

from typing import Callable, List, Optional, Union

import torch

from engine.kernels import ops as kernel_ops


class ReqToTokenPool:
    """`req_to_token[row, position] = kv slot` for every running request.

    Row 0 is reserved (padding rows of CUDA graphs point at it); rows 1..size are handed out.
    """

    def __init__(self, size: int, max_context_len: int, device: str = "cpu") -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.free_slots: List[int] = list(range(1, size + 1))
        self._is_free = [False] + [True] * size

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> Optional[List[int]]:
        if need_size > len(self.free_slots):
            return None
        rows = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        for r in rows:
            self._is_free[r] = False
        return rows

    def free(self, rows: Union[int, List[int]]) -> None:
        if isinstance(rows, int):
            rows = [rows]
        for r in rows:
            if not 1 <= r <= self.size:
                raise ValueError(f"ReqToTokenPool.free: row {r} is not a row of this pool (1..{self.size})")
            if self._is_free[r]:
                raise ValueError(f"ReqToTokenPool.free: row {r} is already free (double free)")
            self._is_free[r] = True
            self.free_slots.append(r)

    def write(self, index, values: torch.Tensor) -> None:
        self.req_to_token[index] = values

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + 1))
        self._is_free = [False] + [True] * self.size


class MHATokenToKVPool:
    """Per-layer K and V buffers `[size + page_size, kv_heads, head_dim]`.

    Slots 0..page_size-1 (page 0) are never handed out: padded tokens write their dummy K/V there.
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str = "cpu",
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        # On the CPU, how many times each slot went back to the allocator (every slot once more when
        # the buffers are made anew): a copy of some slots' K/V derived from them (PrefixPanels) is
        # still theirs while the slots' generations are what they were when it was made. None where
        # nothing is kept: another device, or an encoder's pool (size 0: its slots hold no K/V).
        self.slot_generation: Optional[torch.Tensor] = (
            torch.zeros(size + page_size, dtype=torch.int64) if str(device) == "cpu" and size > 0 else None)
        # Whoever keeps per-slot state derived from these K/V on any device (a speculative drafter's
        # marks of the slots whose draft K/V it wrote) hears of every release, whatever frees the slot.
        self.release_listeners: List[Callable[[Optional[torch.Tensor]], None]] = []
        self._create_buffers()

    def slots_released(self, slots: Optional[torch.Tensor] = None) -> None:
        """The allocator took `slots` (distinct; None: all) back: what they hold may be overwritten."""
        for listener in self.release_listeners:
            listener(slots)
        if self.slot_generation is None:
            return
        if slots is None:
            self.slot_generation += 1
        else:
            self.slot_generation[slots] += 1

    def _create_buffers(self) -> None:
        self.slots_released()
        shape = (self.size + self.page_size, self.head_num, self.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layer_num)]
        self.v_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layer_num)]

    def release(self) -> None:
        """Free the buffers (release_memory_occupation); nothing may run until resume()."""
        empty = torch.empty((0, self.head_num, self.head_dim), dtype=self.dtype, device=self.device)
        self.k_buffer = [empty] * self.layer_num
        self.v_buffer = [empty] * self.layer_num

    def resume(self) -> None:
        """Allocate the buffers again (zeroed: whatever was cached is gone)."""
        self._create_buffers()

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def slot_map(self, layer_id: int) -> Optional[torch.Tensor]:
        """The map kv_slots applies for this layer (int64, indexed by full slot), None where it keeps the
        slots as they are: what kernels reading req_to_token themselves (Triton) translate with."""
        return None

    def kv_slots(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """Where layer `layer_id` keeps the K/V of these (full-pool) slots: the same slots here; the
        hybrid sliding-window pool (swa_pool.py) keeps its windowed layers' K/V elsewhere."""
        return slots

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        if cache_k.dtype != self.dtype:
            cache_k = cache_k.to(self.dtype)
            cache_v = cache_v.to(self.dtype)
        k_pool, v_pool = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if kernel_ops.store_kv_usable(k_pool, cache_k, cache_v):
            # One call for K and V, reading them where they lie in the fused qkv output.
            kernel_ops.store_kv(k_pool, v_pool, loc, cache_k, cache_v)
            return
        # index_copy_ is several times faster than indexed assignment on the CPU.
        self.k_buffer[layer_id].index_copy_(0, loc, cache_k)
        self.v_buffer[layer_id].index_copy_(0, loc, cache_v)

    def bytes_per_token(self) -> int:
        return 2 * self.layer_num * self.head_num * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()
