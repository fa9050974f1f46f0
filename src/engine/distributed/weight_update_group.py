"""Process groups between a trainer and this server's ranks (SGLang's init_weights_update_group).

An RL trainer (verl, slime, OpenRLHF) pushes new weights by broadcasting them from its rank 0 over
a torch.distributed group that it shares with every TP rank of the server (rank `rank_offset +
tp_rank`). Both sides build that group with `init_custom_process_group`, SGLang's recipe: a
rendezvous at the trainer's `tcp://master_address:master_port` (the trainer, rank 0, hosts the
TCPStore), the group's keys under the prefix `group_name`, and a group that is not the process's
default group (a server with TP > 1 already has one, and a trainer has its own). The keys and
ranks are laid out as SGLang's, so a trainer written for SGLang joins this server unchanged.

torch offers no public call for a second "world" (new_group needs every rank of the default
group), so `init_custom_process_group` uses the private `_new_process_group_helper`, as SGLang,
vLLM and OpenRLHF do; the ranks map onto themselves so that `broadcast(src=0)` means the trainer.

`WeightUpdateGroups` is one rank's set of such groups by name, and receives the broadcast tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName  # a NewType of str in recent torch

logger = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo")
# The dtypes a trainer may broadcast in (torch's names; "torch.<name>" is accepted too).
DTYPES: Dict[str, torch.dtype] = {
    "float32": torch.float32, "float": torch.float32, "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "float64": torch.float64, "double": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8, "uint8": torch.uint8, "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
    "bool": torch.bool,
}
MAX_TENSOR_DIMS = 8


def parse_dtype(name: str) -> Optional[torch.dtype]:
    """The torch dtype a trainer names ("bfloat16" or "torch.bfloat16"); None if unknown."""
    return DTYPES.get(name[len("torch."):] if name.startswith("torch.") else name)


def init_custom_process_group(backend: str, init_method: Optional[str] = None,
                              timeout: timedelta = timedelta(minutes=30), world_size: int = -1, rank: int = -1,
                              store: Optional[dist.Store] = None, group_name: str = "weight_update_group",
                              ) -> dist.ProcessGroup:
    """Join the group of `world_size` ranks that rendezvous at `init_method` (tcp://host:port) as
    rank `rank`; rank 0 hosts the store. Or, with `store`, meet through that store instead (a
    trainer that wants its TCPStore on a socket it bound itself). SGLang's signature; blocks
    until every rank has joined or `timeout`."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    if store is None:
        assert init_method is not None, "init_custom_process_group needs an init_method or a store"
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefixed = PrefixStore(group_name, store)
    # An empty rank list builds a group of its own (as for a default group) beside any existing one.
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), prefixed,
                                         group_name=cast("GroupName", group_name), timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the trainer broadcasts: its checkpoint name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def tensor_specs(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
                 ) -> Tuple[List[TensorSpec], Optional[str]]:
    """The specs of an update_weights_from_distributed request, or ([], why they cannot be received)."""
    if not (len(names) == len(dtypes) == len(shapes)):
        return [], (f"names, dtypes and shapes must have the same length, got {len(names)}, {len(dtypes)} and "
                    f"{len(shapes)}.")
    specs: List[TensorSpec] = []
    for name, dtype_name, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dtype_name)
        if dtype is None:
            return [], f"Unknown dtype {dtype_name!r} for {name!r}: one of {', '.join(DTYPES)}."
        if len(shape) > MAX_TENSOR_DIMS or any(size < 0 for size in shape):
            return [], (f"Shape {list(shape)} of {name!r} is not a tensor shape (at most {MAX_TENSOR_DIMS} "
                        "sizes, each >= 0).")
        specs.append(TensorSpec(name, dtype, tuple(shape)))
    return specs, None


class WeightUpdateGroups:
    """One rank's groups with trainers, by group name."""

    def __init__(self, tp_rank: int, device: torch.device, timeout: timedelta) -> None:
        self.tp_rank = tp_rank
        self.device = device
        self.timeout = timeout
        self.groups: Dict[str, Tuple[dist.ProcessGroup, str]] = {}  # name -> (group, backend)

    def init(self, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
             backend: str) -> Tuple[bool, str]:
        if backend not in BACKENDS:
            return False, f"backend {backend!r} is not one of {', '.join(BACKENDS)}."
        if backend == "nccl" and self.device.type != "cuda":
            return False, f"backend 'nccl' needs CUDA; this server runs on {self.device.type}: use 'gloo'."
        if group_name in self.groups:
            return False, (f"The weight update group {group_name!r} already exists: destroy it first "
                           "(/destroy_weights_update_group).")
        rank = rank_offset + self.tp_rank
        if not 0 < rank < world_size:
            return False, (f"This server's rank {rank} (rank_offset {rank_offset} + TP rank {self.tp_rank}) is not "
                           f"among ranks 1..{world_size - 1} of world_size {world_size} (rank 0 is the trainer).")
        init_method = f"tcp://[{master_address}]:{master_port}" if ":" in master_address \
            else f"tcp://{master_address}:{master_port}"
        logger.info("Joining weight update group %r at %s as rank %d of %d (%s)", group_name, init_method, rank,
                    world_size, backend)
        try:
            group = init_custom_process_group(backend, init_method, timeout=self.timeout, world_size=world_size,
                                              rank=rank, group_name=group_name)
        except Exception as e:  # noqa: BLE001 - an unreachable or misconfigured trainer is the caller's error
            logger.error("Failed to join weight update group %r: %s", group_name, e)
            return False, f"Failed to initialize custom process group: {e}."
        self.groups[group_name] = (group, backend)
        return True, "Succeeded to initialize custom process group."

    def destroy(self, group_name: str) -> Tuple[bool, str]:
        entry = self.groups.pop(group_name, None)
        if entry is None:
            return False, f"The group to be destroyed does not exist: no weight update group {group_name!r}."
        try:
            dist.destroy_process_group(entry[0])
        except Exception as e:  # noqa: BLE001 - the group is forgotten either way
            return False, f"Failed to destroy custom process group: {e}."
        return True, "Succeeded to destroy custom process group."

    def destroy_all(self) -> None:
        for name in list(self.groups):
            self.destroy(name)

    def missing(self, group_name: str) -> Optional[str]:
        if group_name in self.groups:
            return None
        return (f"The weight update group {group_name!r} is not initialized: call /init_weights_update_group "
                "first.")

    def receive(self, group_name: str, specs: Sequence[TensorSpec]) -> List[Tuple[str, torch.Tensor]]:
        """The tensors rank 0 broadcasts, in `specs` order (into device memory over NCCL, host
        memory over gloo). Raises if the group fails (a timeout, a peer gone)."""
        group, backend = self.groups[group_name]
        device = self.device if backend == "nccl" else torch.device("cpu")
        received = [(spec.name, torch.empty(spec.shape, dtype=spec.dtype, device=device)) for spec in specs]
        works = [dist.broadcast(tensor, src=0, group=group, async_op=True) for _, tensor in received]
        for work in works:
            assert work is not None  # async_op=True always returns a Work
            work.wait()
        return received
