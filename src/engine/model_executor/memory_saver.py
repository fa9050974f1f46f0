"""Releasing and resuming the memory of a rank's model (SGLang's release/resume_memory_occupation).

Tags, as SGLang's (its constants.GPU_MEMORY_ALL_TYPES), with their meaning here:
- "kv_cache": the K/V buffers of the pool. Releasing frees them (the scheduler flushes the radix
  cache first: its content is gone); resuming allocates them again, zeroed.
- "weights": the parameters. Releasing moves every parameter to host memory (on the CPU it just
  keeps the tensor) and leaves an empty tensor in its place; resuming puts them back, so
  generation continues exactly as before. A quantized linear's weight is its packed one
  (--quantization, a pre-quantized checkpoint): it goes to host memory and back the same way. A training loop that wants new weights updates them
  after resuming "weights", as with SGLang.
- "cuda_graph": the captured CUDA graphs and their memory pools. Releasing drops them; they are
  captured again at the resume that leaves none of these three tags released. Without CUDA
  graphs (the CPU, --disable-cuda-graph) there is nothing to free.
- "weights_drafter": a speculative draft model's weights. This engine has no draft model, so
  there is nothing to free; the tag is accepted so that SGLang's full list works.

CUDA graphs captured the addresses of the K/V buffers and the weights: releasing either drops
them too. Each call is idempotent per tag.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, Iterable, Optional, Set, Union

import torch
from torch import nn

from engine.layers.block_fp8_linear import BlockFp8Weight
from engine.layers.int4 import Int4Weight
from engine.layers.linear import prepack_linear_weights
from engine.layers.quantization import QuantizedWeight
from engine.model_loader.weight_utils import clear_packed_weights

logger = logging.getLogger(__name__)

KV_CACHE = "kv_cache"
WEIGHTS = "weights"
WEIGHTS_DRAFTER = "weights_drafter"
CUDA_GRAPH = "cuda_graph"
MEMORY_TAGS = (KV_CACHE, WEIGHTS, WEIGHTS_DRAFTER, CUDA_GRAPH)
# Released, these leave no captured graph valid.
GRAPH_TAGS = frozenset({KV_CACHE, WEIGHTS, CUDA_GRAPH})
# Released, these leave nothing to run a forward with: the scheduler schedules no batch.
FORWARD_TAGS = frozenset({KV_CACHE, WEIGHTS})


class MemorySaver:
    def __init__(self, model: nn.Module, kv_pool: Any, device: str,
                 recapture_graphs: Callable[[], None], drop_graphs: Callable[[], None]) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.device = str(device)
        self.recapture_graphs = recapture_graphs
        self.drop_graphs = drop_graphs
        self.released: Set[str] = set()
        self._weights_backup: Dict[str, torch.Tensor] = {}
        # A quantized layer's packed weight is not a copy of a parameter but the weight itself.
        self._quantized_backup: Dict[str, Union[QuantizedWeight, Int4Weight, BlockFp8Weight]] = {}
        self._graphs_dropped = False

    def release(self, tags: Iterable[str]) -> None:
        tags = [t for t in tags if t not in self.released]
        if not tags:
            return
        if not self._graphs_dropped and GRAPH_TAGS.intersection(tags):
            self.drop_graphs()
            self._graphs_dropped = True
        if KV_CACHE in tags:
            self.kv_pool.release()
        if WEIGHTS in tags:
            self._release_weights()
        self.released.update(tags)
        self._empty_device_cache()
        logger.info("Released memory occupation: %s", ", ".join(sorted(tags)))

    def resume(self, tags: Iterable[str]) -> None:
        tags = [t for t in tags if t in self.released]
        if not tags:
            return
        if KV_CACHE in tags:
            self.kv_pool.resume()
        if WEIGHTS in tags:
            self._resume_weights()
        self.released.difference_update(tags)
        if self._graphs_dropped and not GRAPH_TAGS.intersection(self.released):
            self.recapture_graphs()
            self._graphs_dropped = False
        logger.info("Resumed memory occupation: %s", ", ".join(sorted(tags)))

    def _release_weights(self) -> None:
        for name, module in self.model.named_modules():
            packed = getattr(module, "packed_weight", None)
            if isinstance(packed, (QuantizedWeight, Int4Weight, BlockFp8Weight)):
                self._quantized_backup[name] = packed.to("cpu")
        clear_packed_weights(self.model)
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                # Pinned host memory makes the way back to the GPU fast; on the CPU the tensor is kept.
                host = param.data if param.device.type == "cpu" else param.data.to("cpu").pin_memory()
                self._weights_backup[name] = host
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def _resume_weights(self) -> None:
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.data = self._weights_backup.pop(name).to(param.device)
        for name, packed in self._quantized_backup.items():
            # The layers declare packed_weight; torch types module attributes as Tensor | Module.
            setattr(self.model.get_submodule(name), "packed_weight", packed.to(self.device))
        self._quantized_backup.clear()
        if self.device == "cpu":
            prepack_linear_weights(self.model)

    def _empty_device_cache(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def check_tags(tags: Optional[Iterable[str]]) -> Optional[str]:
    """An error message for unknown tags (None: all tags)."""
    unknown = sorted(set(tags or ()) - set(MEMORY_TAGS))
    if unknown:
        return f"Unknown memory tag(s) {', '.join(unknown)}: the tags are {', '.join(MEMORY_TAGS)}."
    return None
