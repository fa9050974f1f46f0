"""Tensor-parallel communication helpers. At tp_size 1 every collective is the identity."""

from engine.distributed.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "get_tp_rank",
    "get_tp_size",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
