"""LoRAManager: the adapters of one TP rank (SGLang's LoRAManager), owned by its ModelRunner.

It owns the loaded adapters (host memory, this rank's shards), the device pool of adapter slots and
the segments of the forward in progress. Load and unload run where the forwards run (the control
plane puts them on the model thread); `prepare` runs at the start of every forward.

Adapters are known by name (what requests send as lora_path) and served by uid: each load gets a
new uid, so a name unloaded and loaded again (maybe from another path) is a new adapter and never
shares cached KV with the old one (the uid is part of the radix-cache namespace).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Dict, List, Optional, Set, Tuple

import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter, find_targets, read_adapter
from engine.lora.backend import LoRABatchInfo, NativeShape, build_batch_info, kernel_usable, pick_backend
from engine.lora.layers import LoRABatchState, LoRAProjection
from engine.lora.lora_config import (
    DEFAULT_MAX_LORA_RANK,
    LORA_MODULES,
    MAX_LOADED_LORAS,
    LoRAError,
    check_adapter_fits,
    check_lora_name,
    parse_lora_path_arg,
    read_lora_config,
)
from engine.lora.mem_pool import LoRAMemoryPool

if TYPE_CHECKING:
    from engine.model_executor.forward_batch_info import ForwardBatch
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, server_args: ServerArgs, dtype: torch.dtype, device: str) -> None:
        self.max_rank = server_args.max_lora_rank or DEFAULT_MAX_LORA_RANK
        self.target_modules = list(server_args.lora_target_modules or LORA_MODULES)
        self.max_loaded = server_args.max_loaded_loras or MAX_LOADED_LORAS
        self.dtype, self.device = dtype, device
        self.targets = find_targets(model, self.target_modules)
        backend = pick_backend(server_args.lora_backend, device)
        # On the CPU the small LoRA products run in float32: torch's bfloat16 matmuls there are several
        # times slower (no native bf16 GEMM on most CPUs), and the pool is small.
        pool_dtype = torch.float32 if device == "cpu" else dtype
        self.pool = LoRAMemoryPool(self.targets, server_args.max_loras_per_batch, self.max_rank, pool_dtype, device,
                                   native=backend == "torch_native")
        # The native path's per-forward workspace fits the widest projection (backend.NativeRows).
        self.native: Optional[NativeShape] = None
        if backend == "torch_native" and self.targets:
            self.native = NativeShape(max(t.local_out for t in self.targets.values()),
                                      max(len(t.subs) for t in self.targets.values()) * self.max_rank, pool_dtype)
        self.state = LoRABatchState()
        for key, target in self.targets.items():
            sections = [(s.offset, s.size) for s in target.subs]
            projection = LoRAProjection(self.pool.a_buffers[key], self.pool.b_buffers[key], sections, self.max_rank,
                                        self.state, backend, self.pool.b_native.get(key), self.pool.b_kernel.get(key))
            target.module.attach_lora(projection)
        self.adapters: Dict[str, LoRAAdapter] = {}  # by name
        self._by_uid: Dict[str, LoRAAdapter] = {}
        self._loads = 0
        for item in server_args.lora_paths or []:
            spec = parse_lora_path_arg(item)
            self.load(spec.name, spec.path, spec.pinned)  # a LoRAError here is a start-up error
        logger.info("LoRA: %d projections, %d slots, max rank %d, backend %s, adapters: %s", len(self.targets),
                    self.pool.num_slots, self.max_rank, backend, ", ".join(self.adapters) or "none")

    # ------------------------------------------------------------------ adapters
    def load(self, name: str, path: str, pinned: bool = False) -> LoRAAdapter:
        check_lora_name(name)
        if name in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded; unload it first")
        if len(self.adapters) >= self.max_loaded:
            raise LoRAError(f"{len(self.adapters)} LoRA adapters are loaded, the most --max-loaded-loras allows; "
                            "unload one first")
        if pinned and self.pool.pinned_count() + 1 >= self.pool.num_slots:
            raise LoRAError(f"pinning {name!r} would leave no slot of --max-loras-per-batch "
                            f"{self.pool.num_slots} for unpinned adapters")
        config = read_lora_config(path)
        check_adapter_fits(config, path, self.max_rank, self.target_modules)
        self._loads += 1
        adapter = read_adapter(name, f"{name}#{self._loads}", path, config, pinned, self.targets,
                               self.pool.a_buffers[next(iter(self.pool.a_buffers))].dtype)
        self.adapters[name] = adapter
        self._by_uid[adapter.uid] = adapter
        logger.info("LoRA adapter %r loaded from %s (rank %d, %s)", name, path, config.rank,
                    ", ".join(sorted(config.target_modules)))
        return adapter

    def unload(self, name: str) -> None:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        del self._by_uid[adapter.uid]
        self.pool.evict(adapter.uid)
        logger.info("LoRA adapter %r unloaded", name)

    def uid_of(self, name: str) -> Optional[str]:
        adapter = self.adapters.get(name)
        return adapter.uid if adapter is not None else None

    def loaded(self) -> List[Tuple[str, str]]:
        return [(a.name, a.path) for a in self.adapters.values()]

    # ------------------------------------------------------------------ forward
    def prepare(self, forward_batch: ForwardBatch) -> None:
        """The segments of this forward (every token's and each request's last row), its adapters
        copied into slots."""
        uids = forward_batch.lora_ids
        if uids is None:
            self.state.set(None, None)
            return
        wanted: Set[str] = {u for u in uids if u is not None}
        missing = [u for u in wanted if u not in self._by_uid]
        if missing:
            # The scheduler refuses unloading adapters that requests use: this is a bug, not input.
            raise RuntimeError(f"a batch uses LoRA adapters that are not loaded: {missing}")
        slots = self.pool.acquire(wanted, self._by_uid.__getitem__)
        per_request = [0 if u is None else slots[u] for u in uids]
        device = torch.device(self.device)
        scalings = self.pool.scalings
        # The native kernel where it serves (decided per forward: its family's switch may change).
        kernel = self.native is not None and kernel_usable(self.dtype, self.native.dtype, self.device)
        last_rows = build_batch_info(per_request, scalings, device, self.native, kernel)
        if forward_batch.forward_mode.is_extend():
            lens = forward_batch.extend_seq_lens_cpu
            assert lens is not None  # set for every extend
            per_token = [slot for slot, n in zip(per_request, lens) for _ in range(n)]
            tokens: LoRABatchInfo = build_batch_info(per_token, scalings, device, self.native, kernel)
        else:
            tokens = last_rows
        self.state.set(tokens, last_rows)
