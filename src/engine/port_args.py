"""The endpoints of a server's ZMQ sockets (PortArgs), shared by every process it starts."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from engine.server_args import ServerArgs


@dataclass
class PortArgs:
    """Endpoints of the ZMQ sockets, all `ipc://` files in one private temporary directory."""

    ipc_dir: str
    tokenizer_ipc_name: str  # detokenizer -> tokenizer manager
    scheduler_input_ipc_name: str  # tokenizer manager -> scheduler (rank 0)
    detokenizer_ipc_name: str  # scheduler -> detokenizer
    rpc_ipc_name: str  # tokenizer manager <-> scheduler control calls
    nccl_port: int = 0
    # HTTP workers (--tokenizer-worker-num), each with a TokenizerManager and its own two sockets.
    tokenizer_worker_num: int = 1

    def tokenizer_ipc_names(self) -> List[str]:
        """Where each HTTP worker's TokenizerManager receives (index: its `http_worker`)."""
        return _per_worker(self.tokenizer_ipc_name, self.tokenizer_worker_num)

    def scheduler_input_ipc_names(self) -> List[str]:
        """Where each HTTP worker's TokenizerManager sends to scheduler rank 0 (or the DP controller)."""
        return _per_worker(self.scheduler_input_ipc_name, self.tokenizer_worker_num)

    @staticmethod
    def init_new(server_args: ServerArgs, dp_rank: Optional[int] = None) -> "PortArgs":
        ipc_dir = tempfile.mkdtemp(prefix="engine-ipc-")
        os.chmod(ipc_dir, 0o700)

        def ep(name: str) -> str:
            return f"ipc://{os.path.join(ipc_dir, name)}"

        return PortArgs(
            ipc_dir=ipc_dir,
            tokenizer_ipc_name=ep("tokenizer"),
            scheduler_input_ipc_name=ep("scheduler"),
            detokenizer_ipc_name=ep("detokenizer"),
            rpc_ipc_name=ep("rpc"),
            tokenizer_worker_num=server_args.tokenizer_worker_num,
        )


def _per_worker(endpoint: str, num_workers: int) -> List[str]:
    return [endpoint] if num_workers == 1 else [f"{endpoint}_{k}" for k in range(num_workers)]
