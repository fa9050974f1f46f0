"""Process-group state for tensor parallelism.

The scheduler process calls `init_distributed_environment` once (or a test calls `init_tp_group`
with groups it made); layers ask `get_tp_rank()` / `get_tp_size()`. Without initialisation
(tests, tp_size 1) rank is 0, size is 1 and collectives are identities.

Two groups per TP group: `group` carries the model's collectives (NCCL on CUDA, gloo on the CPU)
and `cpu_group` (always gloo) carries the scheduler's per-iteration broadcast of received
messages. They are separate so that the overlap loop's forward thread (all-reduces) and the
scheduling thread (broadcasts) never share a communicator.

A group on one machine rendezvouses at 127.0.0.1: rank 0 hosts the rendezvous TCPStore on a
socket bound to that loopback address (torch's own `tcp://` rendezvous listens on every interface
whatever host it is given), and the gloo groups' sockets are bound to the loopback interface. A
group across machines (--dist-init-addr) rendezvouses as torch does: its store and sockets must be
reachable from the other nodes, so it runs on a trusted network only (docs/security.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterator, List, Optional
from urllib.parse import urlparse

import psutil

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# How long a rank waits for its peers at start-up and in a collective before giving up (the
# default of --dist-timeout).
DIST_TIMEOUT_S = 600.0


@dataclass
class _TpGroup:
    rank: int
    size: int
    group: Optional[dist.ProcessGroup]  # device collectives (gloo on CPU, NCCL on CUDA)
    cpu_group: Optional[dist.ProcessGroup]  # gloo, for broadcasting Python objects


@dataclass
class CommStats:
    """Seconds spent inside the model's collectives (all-reduce, all-gather) since the last reset."""

    seconds: float = 0.0
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0


_TP = _TpGroup(rank=0, size=1, group=None, cpu_group=None)
comm_stats = CommStats()


def init_tp_group(rank: int, size: int, group, cpu_group) -> None:
    global _TP
    _TP = _TpGroup(rank=rank, size=size, group=group, cpu_group=cpu_group)


def init_distributed_environment(tp_rank: int, tp_size: int, init_method: str, device: str,
                                 timeout_s: float = DIST_TIMEOUT_S) -> None:
    """Join the TP group of `tp_size` ranks rendezvousing at `init_method` (tcp://host:port).

    At tp_size 1 nothing is created: the collectives stay identities.
    """
    if tp_size == 1:
        init_tp_group(0, 1, None, None)
        return
    backend = "nccl" if device.startswith("cuda") else "gloo"
    timeout = timedelta(seconds=timeout_s)
    start = time.perf_counter()
    host = loopback_host(init_method)
    if host is None:
        dist.init_process_group(backend=backend, init_method=init_method, world_size=tp_size, rank=tp_rank,
                                timeout=timeout)
        cpu_group = dist.new_group(ranks=list(range(tp_size)), backend="gloo", timeout=timeout)
    else:
        store = loopback_store(host, urlparse(init_method).port or 0, tp_rank, tp_size, timeout)
        with _gloo_on_loopback(host):
            dist.init_process_group(backend=backend, store=store, world_size=tp_size, rank=tp_rank, timeout=timeout)
            cpu_group = dist.new_group(ranks=list(range(tp_size)), backend="gloo", timeout=timeout)
    init_tp_group(tp_rank, tp_size, dist.group.WORLD, cpu_group)
    logger.info("TP rank %d/%d joined the %s group at %s in %.2fs", tp_rank, tp_size, backend, init_method,
                time.perf_counter() - start)


def loopback_host(init_method: str) -> Optional[str]:
    """The loopback address of a `tcp://` rendezvous on this machine; None for any other."""
    url = urlparse(init_method)
    if url.scheme != "tcp" or url.hostname is None or url.port is None:
        return None
    if url.hostname == "localhost":
        return "127.0.0.1"
    try:
        return url.hostname if ipaddress.ip_address(url.hostname).is_loopback else None
    except ValueError:  # a host name: other machines may be meant to reach it
        return None


def loopback_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The group's rendezvous store: rank 0 serves it on a socket bound to `host` only (torch would
    bind the port on every interface), the other ranks connect to it."""
    if rank != 0:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world_size))
        # The store's server owns the descriptor from here (detach: closing `sock` leaves it open).
        return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout,
                             master_listen_fd=sock.detach())


@contextlib.contextmanager
def _gloo_on_loopback(host: str) -> Iterator[None]:
    """Gloo groups created inside bind the loopback interface instead of the one the machine's
    host name resolves to. torch reads GLOO_SOCKET_IFNAME when it creates a gloo group, so the
    variable is set only meanwhile (a later group, e.g. with a trainer on another machine, is not
    confined); a value the user set wins."""
    name = next((nic for nic, addrs in psutil.net_if_addrs().items() if any(a.address == host for a in addrs)), None)
    if name is None or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def destroy_distributed_environment() -> None:
    global _TP
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP = _TpGroup(rank=0, size=1, group=None, cpu_group=None)


def get_tp_rank() -> int:
    return _TP.rank


def get_tp_size() -> int:
    return _TP.size


@dataclass(frozen=True)
class ExpertLayout:
    """How a mixture-of-experts layer splits its experts over the TP group (SGLang's --ep-size): the
    group is ep_size blocks of tp_size // ep_size consecutive ranks; block i holds experts
    [i * E / ep_size, (i + 1) * E / ep_size), each of them with its intermediate dimension sharded
    over the ranks of the block. ep_size 1 is pure TP of the experts, ep_size == tp_size pure EP."""

    ep_size: int = 1

    @property
    def moe_tp_size(self) -> int:
        return get_tp_size() // self.ep_size

    @property
    def ep_rank(self) -> int:
        return get_tp_rank() // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return get_tp_rank() % self.moe_tp_size


_EXPERTS = ExpertLayout()


def set_expert_parallel_size(ep_size: int) -> None:
    """Set by the ModelRunner (from --ep-size) before it builds the model."""
    global _EXPERTS
    if ep_size < 1 or get_tp_size() % ep_size:
        raise ValueError(f"--ep-size {ep_size} must divide --tp-size {get_tp_size()}")
    _EXPERTS = ExpertLayout(ep_size)


def get_expert_layout() -> ExpertLayout:
    return _EXPERTS


def get_tp_group():
    return _TP.group


def get_tp_cpu_group():
    return _TP.cpu_group


# ---------------------------------------------------------------------- model collectives
def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP.size == 1:
        return x
    start = time.perf_counter()
    dist.all_reduce(x, group=_TP.group)
    comm_stats.seconds += time.perf_counter() - start
    comm_stats.calls += 1
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP.size == 1:
        return x
    start = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(parts, x.contiguous(), group=_TP.group)
    out = torch.cat(parts, dim=dim)
    comm_stats.seconds += time.perf_counter() - start
    comm_stats.calls += 1
    return out


def assert_same_across_tp(x: torch.Tensor, what: str) -> None:
    """Debug check: every rank holds the same tensor (e.g. the sampled token ids)."""
    if _TP.size == 1:
        return
    gathered = [torch.empty_like(x) for _ in range(_TP.size)]
    dist.all_gather(gathered, x.contiguous(), group=_TP.group)
    for rank, other in enumerate(gathered):
        if not torch.equal(other, gathered[0]):
            raise AssertionError(f"{what} differ between TP rank 0 and rank {rank}: "
                                 f"{gathered[0].tolist()} vs {other.tolist()}")


# ---------------------------------------------------------------------- scheduler collectives (CPU)
def all_reduce_min_int(value: int) -> int:
    """The minimum of an integer over the TP group (the KV pool size every rank can hold)."""
    if _TP.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP.cpu_group)
    return int(t.item())


def all_reduce_min_small_ints(values: List[int]) -> List[int]:
    """Element-wise minimum over the TP group of small non-negative ints (one uint8 gloo call).

    PD disaggregation reduces its per-request transfer polls with it, so every rank moves a
    request between queues in the same iteration and one failed rank fails it everywhere.
    """
    if _TP.size == 1 or not values:
        return list(values)
    t = torch.tensor(values, dtype=torch.uint8)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP.cpu_group)
    return t.tolist()


def all_gather_objects(value: Any) -> List[Any]:
    """Every rank's picklable `value`, in rank order (one gloo all_gather_object; rare paths only)."""
    if _TP.size == 1:
        return [value]
    out: List[Any] = [None] * _TP.size
    dist.all_gather_object(out, value, group=_TP.cpu_group)
    return out


def broadcast_bytes_list(items: Optional[List[bytes]]) -> List[bytes]:
    """Rank 0's list of byte strings, on every rank (others pass None).

    The header's size, the header (count and lengths), then one payload of all the bytes: three
    gloo broadcasts per scheduler iteration, two when the list is empty.
    """
    items = list(items or [])  # ranks other than 0 pass None and fill theirs below
    if _TP.size == 1:
        return items
    group = _TP.cpu_group
    if _TP.rank == 0:
        header = torch.tensor([len(items)] + [len(b) for b in items], dtype=torch.int64)
        count = torch.tensor([header.numel()], dtype=torch.int64)
    else:
        count = torch.zeros(1, dtype=torch.int64)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(count, src=src, group=group)
    if _TP.rank != 0:
        header = torch.zeros(int(count.item()), dtype=torch.int64)
    dist.broadcast(header, src=src, group=group)
    lengths = header[1:].tolist()
    total = sum(lengths)
    if total == 0:
        return [b"" for _ in lengths] if _TP.rank != 0 else items
    if _TP.rank == 0:
        payload = torch.frombuffer(bytearray(b"".join(items)), dtype=torch.uint8)
    else:
        payload = torch.empty(total, dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    if _TP.rank == 0:
        return items
    data = payload.numpy().tobytes()
    out, offset = [], 0
    for n in lengths:
        out.append(data[offset:offset + n])
        offset += n
    return out


def gather_objects_to_rank0(obj: Any) -> Optional[List[Any]]:
    """Every rank's `obj` on rank 0 (a list by rank), None elsewhere."""
    if _TP.size == 1:
        return [obj]
    group = _TP.cpu_group
    assert group is not None  # init_tp_group sets it whenever size > 1
    out: Optional[List[Any]] = [None] * _TP.size if _TP.rank == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(group, 0), group=group)
    return out
