"""Starting one tensor-parallel group: this node's scheduler ranks, one process each.

Used with one DP rank (by the launcher) and for each replica (by the data-parallel controller).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from engine.launch.children import ChildProcesses
    from engine.port_args import PortArgs
    from engine.server_args import ServerArgs


def _run_scheduler(*args: Any) -> None:
    # A light trampoline: pickling it for spawn does not import the scheduler (and torch) here.
    from engine.scheduler.process import run_scheduler_process

    run_scheduler_process(*args)


def launch_tp_group(children: ChildProcesses, server_args: ServerArgs, port_args: PortArgs, dp_rank: Optional[int] = None,
                    gpu_offset: int = 0) -> str:
    """Start this node's scheduler ranks of one TP group; return the child name of its first rank."""
    tp_per_node = max(1, server_args.tp_size // server_args.nnodes)
    first_rank = server_args.node_rank * tp_per_node
    suffix = f"_DP{dp_rank}" if dp_rank is not None else ""
    for tp_rank in range(first_rank, first_rank + tp_per_node):
        gpu_id = gpu_offset + tp_rank - first_rank
        children.start(f"scheduler_TP{tp_rank}{suffix}", _run_scheduler,
                       (server_args, port_args, gpu_id, tp_rank, dp_rank))
    return f"scheduler_TP{first_rank}{suffix}"
