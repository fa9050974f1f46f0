"""A TP group on one machine listens on loopback only: the rendezvous store (rank 0) and the gloo
sockets of both ranks. Two spawned ranks join through init_distributed_environment, as the
scheduler processes do, and report their listening sockets (psutil) while the group is up."""

from __future__ import annotations

import ipaddress
import multiprocessing
import traceback
from typing import Any, Dict, List, Tuple

import pytest

from engine.utils.network_utils import get_free_port

pytestmark = pytest.mark.slow  # two spawned ranks join a gloo group

TP = 2


def _rank(rank: int, port: int, results: Any) -> None:
    try:
        import psutil
        import torch
        import torch.distributed as dist

        from engine.distributed import parallel_state as ps

        ps.init_distributed_environment(rank, TP, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=60)
        total = ps.tensor_model_parallel_all_reduce(torch.tensor([rank + 1.0]))
        listening = [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        dist.barrier(group=ps.get_tp_cpu_group())  # both ranks looked while the other was up
        results.put((rank, {"sum": total.item(), "listening": listening}))
        ps.destroy_distributed_environment()
    except Exception:
        results.put((rank, {"error": traceback.format_exc()}))


@pytest.fixture(scope="module")
def ranks() -> Dict[int, Dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in range(TP)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in range(TP))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, result in got.items():
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    got[-1] = {"port": port}
    return got


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def test_the_group_works(ranks) -> None:
    assert ranks[0]["sum"] == ranks[1]["sum"] == 3.0


def test_the_rendezvous_store_listens_on_loopback_only(ranks) -> None:
    port = ranks[-1]["port"]
    store: List[Tuple[str, int]] = [addr for addr in ranks[0]["listening"] if addr[1] == port]
    assert store == [("127.0.0.1", port)], ranks[0]["listening"]


def test_no_rank_listens_beyond_loopback(ranks) -> None:
    for rank in range(TP):
        exposed = [addr for addr in ranks[rank]["listening"] if not _loopback(addr[0])]
        assert not exposed, f"rank {rank} listens on {exposed}"
