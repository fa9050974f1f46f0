"""Process-group state for tensor parallelism.

The scheduler process calls `init_tp_group` once; layers ask `get_tp_rank()` / `get_tp_size()`.
Without initialisation (tests, tp_size 1) rank is 0, size is 1 and collectives are identities.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class _TpGroup:
    rank: int
    size: int
    group: Optional[dist.ProcessGroup]  # device collectives (gloo on CPU, NCCL on CUDA)
    cpu_group: Optional[dist.ProcessGroup]  # gloo, for broadcasting Python objects


_TP = _TpGroup(rank=0, size=1, group=None, cpu_group=None)


def init_tp_group(rank: int, size: int, group, cpu_group) -> None:
    global _TP
    _TP = _TpGroup(rank=rank, size=size, group=group, cpu_group=cpu_group)


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


def get_tp_cpu_group():
    return _TP.cpu_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    dist.all_reduce(x, group=_TP.group)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    return torch.cat(parts, dim=dim)
