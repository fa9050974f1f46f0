"""The attention-backend interface every backend (torch_native, triton, flashinfer) implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from engine.layers.radix_attention import RadixAttention
    from engine.model_executor.forward_batch_info import ForwardBatch


class AttentionRunner(Protocol):
    """What a backend reads of the model runner that builds it (tests pass a bare namespace)."""

    @property
    def device(self) -> str: ...


class AttentionBackend(ABC):
    """Shapes: q is [num_tokens, num_heads * head_dim]; k and v are
    [num_tokens, num_kv_heads * head_dim]; the result is [num_tokens, num_heads * head_dim].
    With save_kv_cache the backend stores k and v at forward_batch.out_cache_loc first."""

    # A backend that sets this implements the three CUDA-graph methods below
    # (model_executor/cuda_graph_runner.py); the others are never captured.
    supports_cuda_graph: bool = False
    # Whether a tree mask (speculative tree drafts) is applied on every layer, windowed, soft-capped or
    # with sinks included; where it is not, speculative/speculator.py asks the backend's own rules.
    tree_mask_on_every_layer: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: "ForwardBatch") -> None:
        """Build per-batch metadata once, before the layers run."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: "RadixAttention",
        forward_batch: "ForwardBatch",
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    @abstractmethod
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        ...

    @abstractmethod
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True) -> torch.Tensor:
        ...

    def forward_extend_last_rows(self, q, k, v, layer: "RadixAttention", forward_batch: "ForwardBatch",
                                 save_kv_cache: bool = True) -> torch.Tensor:
        """forward_extend's output at each request's last row only, [bs, num_heads * head_dim]; every
        row's K/V is stored as by forward_extend. This default computes every row and keeps the last
        ones; a backend may attend from the last rows alone."""
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache).index_select(
            0, forward_batch.last_positions())

    # ------------------------------------------------------------------ CUDA graphs
    def init_cuda_graph_state(self, max_bs: int) -> None:
        """Static metadata buffers for batches of up to max_bs rows, once."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        """Point forward_batch.attn_metadata at the static buffers."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: "ForwardBatch") -> None:
        """Refresh the static buffers from forward_batch's (static) inputs."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
