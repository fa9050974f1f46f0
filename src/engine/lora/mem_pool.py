"""The adapter slots on the device: A and B buffers per layer per projection (SGLang's LoRAMemoryPool).

Slot 0 is "no adapter" and stays zero; slots 1..max_loras_per_batch hold the adapters a batch uses.
An adapter not resident is copied in when a batch needs it, into a free slot or the least recently
used one that the batch does not use (pinned adapters are never evicted). The scheduler never puts
more adapters in a batch than there are slots, so a batch always fits.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch

from engine.lora.adapter import LoRAAdapter, LoRATarget


class LoRAMemoryPool:
    def __init__(self, targets: Dict[Tuple[int, str], LoRATarget], num_slots: int, max_rank: int,
                 dtype: torch.dtype, device: str, native: bool = False) -> None:
        """`native`: also keep B as the native backend reads it (backend.kernel_b, and its sections as
        backend.native_b's)."""
        self.max_rank = max_rank
        self.num_slots = num_slots  # adapters; the buffers have one more (slot 0)
        self.a_buffers: Dict[Tuple[int, str], torch.Tensor] = {}
        self.b_buffers: Dict[Tuple[int, str], torch.Tensor] = {}
        for key, t in targets.items():
            self.a_buffers[key] = torch.zeros((num_slots + 1, len(t.subs) * max_rank, t.local_in), dtype=dtype,
                                              device=device)
            self.b_buffers[key] = torch.zeros((num_slots + 1, t.local_out, max_rank), dtype=dtype, device=device)
        # [slots, R, N] = B^T times the slot's scaling (no scaling op per layer), each row every section's
        # columns: what the native kernel reads (csrc/lora_delta.c); the torch path's expand of section i
        # multiplies its columns ([slots, R, n_i] views, b_native), one product per section.
        self.b_kernel: Dict[Tuple[int, str], torch.Tensor] = {
            key: torch.zeros((num_slots + 1, max_rank, t.local_out), dtype=dtype, device=device)
            for key, t in targets.items()} if native else {}
        self.b_native: Dict[Tuple[int, str], List[torch.Tensor]] = {
            key: [full[:, :, sub.offset:sub.offset + sub.size] for sub in targets[key].subs]
            for key, full in self.b_kernel.items()}
        self.scalings = torch.zeros(num_slots + 1, dtype=torch.float32, device=device)
        self._targets = targets
        self._slot_of: "OrderedDict[str, int]" = OrderedDict()  # uid -> slot, least recently used first
        self._pinned: Set[str] = set()

    def slot_of(self, uid: str) -> Optional[int]:
        return self._slot_of.get(uid)

    def resident(self) -> List[str]:
        return list(self._slot_of)

    def acquire(self, uids: Set[str], adapter_of: Callable[[str], LoRAAdapter]) -> Dict[str, int]:
        """A slot for each adapter of a batch, loading the missing ones (len(uids) <= num_slots)."""
        if len(uids) > self.num_slots:
            raise RuntimeError(f"a batch uses {len(uids)} LoRA adapters, more than the {self.num_slots} slots")
        for uid in uids:
            if uid in self._slot_of:
                self._slot_of.move_to_end(uid)
        for uid in uids:
            if uid not in self._slot_of:
                slot = self._free_slot(uids)
                self._load(slot, adapter_of(uid))
                self._slot_of[uid] = slot
        return {uid: self._slot_of[uid] for uid in uids}

    def _free_slot(self, keep: Set[str]) -> int:
        used = set(self._slot_of.values())
        for slot in range(1, self.num_slots + 1):
            if slot not in used:
                return slot
        for uid in self._slot_of:  # least recently used first
            if uid not in keep and uid not in self._pinned:
                return self._slot_of.pop(uid)
        raise RuntimeError("no LoRA slot can be freed: every slot holds a pinned adapter or one this batch uses")

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        rank, max_rank = adapter.config.rank, self.max_rank
        for key, target in self._targets.items():
            a_buf, b_buf = self.a_buffers[key][slot], self.b_buffers[key][slot]
            a_buf.zero_()
            b_buf.zero_()
            native = [b_i[slot] for b_i in self.b_native[key]] if self.b_native else []
            if self.b_kernel:
                self.b_kernel[key][slot].zero_()
            for i, entry in enumerate(adapter.weights.get(key, [None] * len(target.subs))):
                if entry is None:
                    continue
                a, b = entry
                sub = target.subs[i]
                a_buf[i * max_rank:i * max_rank + rank].copy_(a, non_blocking=True)
                b_buf[sub.offset:sub.offset + sub.size, :rank].copy_(b, non_blocking=True)
                if native:
                    native[i][:rank].copy_(b.t() * adapter.config.scaling)
        self.scalings[slot] = adapter.config.scaling
        if adapter.pinned:
            self._pinned.add(adapter.uid)

    def evict(self, uid: str) -> None:
        """Forget an unloaded adapter (its slot is reused; stale values are overwritten on load)."""
        self._slot_of.pop(uid, None)
        self._pinned.discard(uid)

    def pinned_count(self) -> int:
        return len(self._pinned)
