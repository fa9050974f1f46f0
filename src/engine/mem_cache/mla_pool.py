"""The KV pool of a multi-head latent attention model (DeepSeek-V2/V3): SGLang's MLATokenToKVPool.

Per layer one buffer `[size + page_size, 1, kv_lora_rank + qk_rope_head_dim]`: each token's
normalised latent followed by its rotated rope key, one "head" shared by every query head. The
attention reads the whole row as K and its first kv_lora_rank values as V, so `v_buffer` is a view
into the same memory, never a second copy. Slots, pages, the allocator and the radix cache are those
of the MHA pool: only what a slot holds differs.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from engine.mem_cache.memory_pool import MHATokenToKVPool, quantize_fp8


class MLATokenToKVPool(MHATokenToKVPool):
    def __init__(self, size: int, page_size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int,
                 layer_num: int, device: str = "cpu", k_scales: Optional[Sequence[float]] = None) -> None:
        """An fp8 `dtype` (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) stores each row divided by its layer's
        k_scale (the latent and the rope key alike; default 1.0)."""
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        # head_num 1, head_dim = the whole row: what the pool's generic readers (bytes, shapes) see.
        super().__init__(size, page_size, dtype, 1, kv_lora_rank + qk_rope_head_dim, layer_num, device,
                         k_scales=k_scales)

    def _create_buffers(self) -> None:
        self.slots_released()
        shape = (self.size + self.page_size, 1, self.head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.layer_num)]
        self.v_buffer = [buf[..., :self.kv_lora_rank] for buf in self.k_buffer]

    def release(self) -> None:
        empty = torch.empty((0, 1, self.head_dim), dtype=self.dtype, device=self.device)
        self.k_buffer = [empty] * self.layer_num
        self.v_buffer = [empty[..., :self.kv_lora_rank]] * self.layer_num

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """cache_k [n, 1, kv_lora_rank + rope] is the whole row; cache_v (its latent part) is already in it."""
        rows = cache_k.reshape(-1, 1, self.head_dim)
        if self.is_fp8:  # through uint8 views: CPU index_copy_ has no fp8 kernel
            rows8 = quantize_fp8(rows, self.k_scales[layer_id], self.dtype).view(torch.uint8)
            self.k_buffer[layer_id].view(torch.uint8).index_copy_(0, loc, rows8)
            return
        self.k_buffer[layer_id].index_copy_(0, loc, rows.to(self.dtype))

    kv_planes = 1  # v_buffer is a view into k_buffer

    def layer_planes(self, layer_id: int) -> Tuple[torch.Tensor, ...]:
        return (self.k_buffer[layer_id],)

    def bytes_per_token(self) -> int:
        return self.layer_num * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()
