"""The scheduler's view of a model worker: what it calls, typed.

`TpModelWorker` (scheduler/tp_worker.py) is the implementation that runs a model; tests and
benchmarks plug in workers of their own (a fake next-token rule, a simulated device). The
scheduler depends only on this protocol.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Protocol, Sequence, Set, Tuple

import torch

if TYPE_CHECKING:
    from engine.layers.logits_processor import LogitsProcessorOutput
    from engine.layers.moe.expert_distribution import ExpertDistributionRecorder
    from engine.scheduler.tp_worker import EmbeddingBatchResult, GenerationBatchResult
    from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from engine.mem_cache.memory_pool import ReqToTokenPool
    from engine.model_executor.forward_batch_info import ModelWorkerBatch


class ModelWorker(Protocol):
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool_allocator: "PagedTokenToKVPoolAllocator"
    # The overlap relay: the last token sampled per request-pool row (scheduler/overlap_utils.py).
    output_tokens_buf: torch.Tensor

    def get_worker_info(self) -> Dict[str, Any]:
        """The limits the scheduler admits requests under (see tp_worker.worker_limits)."""

    @property
    def eos_token_ids(self) -> Set[int]: ...

    def forward_batch_generation(self, batch: "ModelWorkerBatch",
                                 delay_sample: bool = False) -> "GenerationBatchResult":
        """Run the forward (and sample, unless `delay_sample`) of one batch."""

    def sample_delayed(self, result: "GenerationBatchResult",
                       vocab_mask: Optional[torch.Tensor]) -> "GenerationBatchResult":
        """The sampling half of a forward run with `delay_sample=True`."""

    def forward_batch_embedding(self, batch: "ModelWorkerBatch") -> "EmbeddingBatchResult":
        """The pooled vectors of an embedding model's batch (scheduler/embedding.py)."""

    def forward_batch_verify(self, batch: "ModelWorkerBatch") -> "LogitsProcessorOutput":
        """A speculative verify forward: the logits of every position (engine/speculative/)."""

    def expert_recorder(self) -> Optional["ExpertDistributionRecorder"]:
        """A mixture-of-experts model's tokens-per-expert counter; only asked when get_worker_info
        has a "moe_layout" (scheduler/experts.py)."""

    # The control plane (scheduler/control.py).
    def update_weights_from_disk(self, model_path: str, load_format: Optional[str]) -> Tuple[bool, str]: ...

    def update_weights_from_tensor(self, named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[bool, str]: ...

    # Weight update groups with a trainer (distributed/weight_update_group.py).
    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str, backend: str) -> Tuple[bool, str]: ...

    def destroy_weights_update_group(self, group_name: str) -> Tuple[bool, str]: ...

    def check_distributed_update(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                                 shapes: Sequence[Sequence[int]]) -> Optional[str]:
        """Why this update cannot be received (no such group, bad metadata, too large), or None."""

    def update_weights_from_distributed(self, group_name: str, names: Sequence[str], dtypes: Sequence[str],
                                        shapes: Sequence[Sequence[int]], apply: bool) -> Tuple[bool, str]:
        """Receive the broadcast tensors; load them only if `apply`."""

    def rollback_weights(self) -> str: ...

    def commit_weights(self) -> None: ...

    def get_weights_by_name(self, name: str, truncate_size: int) -> Tuple[Optional[List[Any]], str]: ...

    def release_memory_occupation(self, tags: Iterable[str]) -> None: ...

    def resume_memory_occupation(self, tags: Iterable[str]) -> None: ...

    # LoRA adapters (engine/lora/; only with --enable-lora).
    def load_lora_adapter(self, name: str, path: str, pinned: bool) -> Tuple[bool, str]: ...

    def unload_lora_adapter(self, name: str) -> Tuple[bool, str]: ...

    def lora_uid(self, name: str) -> Optional[str]:
        """The uid the loaded adapter `name` is served under (None: not loaded)."""

    def loaded_lora_adapters(self) -> Dict[str, str]: ...
