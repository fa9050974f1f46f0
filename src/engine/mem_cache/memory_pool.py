"""Physical memory: the request-to-token table and the per-layer K/V buffers."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from engine.kernels import ops as kernel_ops

# --kv-cache-dtype: SGLang's names of the KV pool's element types; auto keeps the model's dtype.
KV_CACHE_DTYPES: Dict[str, Optional[torch.dtype]] = {
    "auto": None, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
FP8_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element type for --kv-cache-dtype `name` (a ValueError names the choices)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    chosen = KV_CACHE_DTYPES[name]
    return model_dtype if chosen is None else chosen


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in the fp8 `dtype`, rounded to nearest; values past the format's largest finite one
    are clamped to it (a NaN or inf in the pool would spread to every query that reads the slot)."""
    limit = torch.finfo(dtype).max
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp(-limit, limit).to(dtype)  # not clamp_: x.float() of a float32 x is x itself


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Pool elements as `dtype`: fp8 ones times their layer's scale (exact when scale is 1.0: every fp8
    value is a bfloat16, float16 and float32 value), others only cast."""
    if not is_fp8(x.dtype) or scale == 1.0:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


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
    With an fp8 `dtype` (--kv-cache-dtype fp8_e5m2 / fp8_e4m3) each element is one byte: the K/V of
    layer l are stored as k / k_scales[l] (v / v_scales[l]) rounded to fp8, and readers multiply by the
    scale again (`dequantize`, or inside their kernels). The buffers have the fp8 dtype; writes go
    through uint8 views, since CPU index_copy_ has no fp8 kernel.
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
        k_scales: Optional[Sequence[float]] = None,
        v_scales: Optional[Sequence[float]] = None,
    ) -> None:
        """k_scales / v_scales: one per layer (fp8 only; default 1.0), as the checkpoint gives them."""
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        self.k_scales = _layer_scales(k_scales, layer_num, "k_scales")
        self.v_scales = _layer_scales(v_scales, layer_num, "v_scales")
        if not is_fp8(dtype) and any(s != 1.0 for s in self.k_scales + self.v_scales):
            raise ValueError(f"KV scales apply to an fp8 KV cache only, not to {dtype}")
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

    # The buffers per layer that hold distinct data (layer_planes): K and V here; an MLA pool's one row.
    kv_planes = 2

    def layer_planes(self, layer_id: int) -> Tuple[torch.Tensor, ...]:
        """The buffers of a layer whose contents are what the pool stores (what a PD transfer or a backup
        copies): K and V."""
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    @property
    def is_fp8(self) -> bool:
        return is_fp8(self.dtype)

    def kv_scales(self, layer_id: int) -> Tuple[float, float]:
        """(k_scale, v_scale) of a layer: what its stored elements are multiplied by when read."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def read_k(self, layer_id: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows taken from layer `layer_id`'s K buffer, as `dtype` (dequantized)."""
        return dequantize(rows, self.k_scales[layer_id], dtype)

    def read_v(self, layer_id: int, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(rows, self.v_scales[layer_id], dtype)

    def as_stored(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """K/V of this forward as the pool gives them back (rounded through fp8 in an fp8 pool; as they are
        otherwise): attention reads every key as stored, the new tokens' too, so that a prompt's result
        does not depend on how it was split (chunked prefill, a cached prefix, PD)."""
        if not self.is_fp8:
            return k, v
        ks, vs = self.kv_scales(layer_id)
        return (dequantize(quantize_fp8(k, ks, self.dtype), ks, k.dtype),
                dequantize(quantize_fp8(v, vs, self.dtype), vs, v.dtype))

    def slot_map(self, layer_id: int) -> Optional[torch.Tensor]:
        """The map kv_slots applies for this layer (int64, indexed by full slot), None where it keeps the
        slots as they are: what kernels reading req_to_token themselves (Triton) translate with."""
        return None

    def kv_slots(self, layer_id: int, slots: torch.Tensor) -> torch.Tensor:
        """Where layer `layer_id` keeps the K/V of these (full-pool) slots: the same slots here; the
        hybrid sliding-window pool (swa_pool.py) keeps its windowed layers' K/V elsewhere."""
        return slots

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        if self.is_fp8:
            k8 = quantize_fp8(cache_k, self.k_scales[layer_id], self.dtype).view(torch.uint8)
            v8 = quantize_fp8(cache_v, self.v_scales[layer_id], self.dtype).view(torch.uint8)
            self.k_buffer[layer_id].view(torch.uint8).index_copy_(0, loc, k8)
            self.v_buffer[layer_id].view(torch.uint8).index_copy_(0, loc, v8)
            return
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

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's K/V of slots `src` copied to slots `dst` (all read before any is written, so
        the two may overlap): the accepted path of a speculative tree moved into chain order. Over
        layer_planes (an MLA pool's V is a view of its K: moving it too would read latents another move
        already overwrote), through uint8 views in an fp8 pool (CPU index_copy_ has no fp8 kernel)."""
        for layer in range(self.layer_num):
            # kv_slots: the hybrid sliding-window pool's windowed layers move through their own slots.
            from_slots, to_slots = self.kv_slots(layer, src), self.kv_slots(layer, dst)
            for plane in self.layer_planes(layer):
                buf = plane.view(torch.uint8) if self.is_fp8 else plane
                buf.index_copy_(0, to_slots, buf.index_select(0, from_slots))

    def bytes_per_token(self) -> int:
        return 2 * self.layer_num * self.head_num * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()


def _layer_scales(scales: Optional[Sequence[float]], layer_num: int, what: str) -> List[float]:
    if scales is None:
        return [1.0] * layer_num
    out = [float(s) for s in scales]
    if len(out) != layer_num:
        raise ValueError(f"{what}: {len(out)} values for {layer_num} layers")
    bad = [s for s in out if not (s > 0.0 and s < float("inf"))]
    if bad:
        raise ValueError(f"{what} must be finite and > 0, got {bad[0]}")
    return out
