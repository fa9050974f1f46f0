"""Server arguments: one dataclass, turned into argparse flags with SGLang's names."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Optional

logger = logging.getLogger(__name__)

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue")


class ServerArgsError(ValueError):
    """An inconsistent or out-of-range server argument."""


@dataclass
class ServerArgs:
    # Model and tokenizer
    model_path: Optional[str] = None  # None: the built-in tiny model
    tokenizer_path: Optional[str] = None
    served_model_name: Optional[str] = None
    chat_template: Optional[str] = None
    dtype: str = "auto"
    context_length: Optional[int] = None
    trust_remote_code: bool = False
    skip_tokenizer_init: bool = False

    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: Optional[str] = None

    # Memory and scheduling
    mem_fraction_static: Optional[float] = None
    max_total_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    max_queued_requests: Optional[int] = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: Optional[int] = None
    page_size: int = 1
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    # SGLang's SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP (default off: prefills in a row overlap).
    disable_consecutive_prefill_overlap: bool = field(default=False, metadata={"help": (
        "With the overlap scheduler, process a prefill's result before launching the next prefill "
        "instead of during it: better time to first token for back-to-back prefills, slightly less "
        "throughput (SGLang's SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP).")})
    enable_mixed_chunk: bool = False
    stream_interval: int = 1

    # Execution
    device: str = "auto"
    attention_backend: Optional[str] = None
    random_seed: int = 0
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 160

    # Parallelism
    tp_size: int = 1
    dp_size: int = 1
    load_balance_method: str = "round_robin"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None

    # Observability and robustness
    log_level: str = "info"
    log_requests: bool = False
    enable_metrics: bool = False
    decode_log_interval: int = 40
    watchdog_timeout: float = 300.0
    strict_memory_check: bool = field(default=False, metadata={"help": (
        "Make the idle memory self-check fatal: a KV or request-slot leak stops the scheduler and "
        "the server exits non-zero with the leak in its log (the tests run this way). Without it "
        "each distinct leak is logged once as an ERROR and the server keeps serving.")})

    def __post_init__(self) -> None:
        self.resolve_defaults()
        self.check()

    # ------------------------------------------------------------------ defaults
    def resolve_defaults(self) -> None:
        if self.device == "auto":
            self.device = _default_device()
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device == "cuda" else "torch_native"
        if self.served_model_name is None:
            self.served_model_name = self.model_path or "engine-builtin"
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.88 if self.device == "cuda" else 0.3
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192 if self.device == "cuda" else 2048

    def check(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ServerArgsError(msg)

        need(self.dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        need(self.device in ("cpu", "cuda"), f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        need(
            self.attention_backend in ATTENTION_BACKENDS,
            f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}",
        )
        need(
            not (self.device == "cpu" and self.attention_backend == "flashinfer"),
            "--attention-backend flashinfer needs --device cuda",
        )
        need(
            self.schedule_policy in SCHEDULE_POLICIES,
            f"--schedule-policy must be one of {', '.join(SCHEDULE_POLICIES)}, got {self.schedule_policy!r}",
        )
        need(
            self.load_balance_method in LOAD_BALANCE_METHODS,
            f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}",
        )
        need(self.page_size >= 1 and (self.page_size & (self.page_size - 1)) == 0,
             f"--page-size must be a power of two >= 1, got {self.page_size}")
        need(1 <= self.port <= 65535, f"--port must be in [1, 65535], got {self.port}")
        need(self.tp_size >= 1, f"--tp-size must be >= 1, got {self.tp_size}")
        need(self.dp_size >= 1, f"--dp-size must be >= 1, got {self.dp_size}")
        need(self.nnodes >= 1, f"--nnodes must be >= 1, got {self.nnodes}")
        need(0 <= self.node_rank < self.nnodes,
             f"--node-rank must be in [0, --nnodes), got {self.node_rank} with --nnodes {self.nnodes}")
        need(self.nnodes == 1 or self.dist_init_addr is not None,
             "--dist-init-addr is required when --nnodes > 1")
        need(self.context_length is None or self.context_length > 0,
             f"--context-length must be > 0, got {self.context_length}")
        need(0.0 < self.mem_fraction_static < 1.0,
             f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        need(self.max_total_tokens is None or self.max_total_tokens >= 2 * self.page_size,
             f"--max-total-tokens must be >= 2 pages, got {self.max_total_tokens}")
        need(self.max_running_requests is None or self.max_running_requests >= 1,
             f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        need(self.max_queued_requests is None or self.max_queued_requests >= 1,
             f"--max-queued-requests must be >= 1, got {self.max_queued_requests}")
        need(self.max_prefill_tokens >= 1, f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")
        need(self.chunked_prefill_size == -1 or self.chunked_prefill_size >= self.page_size,
             f"--chunked-prefill-size must be -1 (off) or >= --page-size, got {self.chunked_prefill_size}")
        need(self.schedule_conservativeness > 0,
             f"--schedule-conservativeness must be > 0, got {self.schedule_conservativeness}")
        need(self.stream_interval >= 1, f"--stream-interval must be >= 1, got {self.stream_interval}")
        need(self.decode_log_interval >= 1,
             f"--decode-log-interval must be >= 1, got {self.decode_log_interval}")
        need(self.watchdog_timeout > 0, f"--watchdog-timeout must be > 0, got {self.watchdog_timeout}")
        need(self.log_level.lower() in ("debug", "info", "warning", "error", "critical"),
             f"--log-level must be debug|info|warning|error|critical, got {self.log_level!r}")
        need(not (self.enable_mixed_chunk and self.chunked_prefill_size == -1),
             "--enable-mixed-chunk needs chunked prefill (--chunked-prefill-size > 0)")

    # ------------------------------------------------------------------ argparse
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help") if f.metadata else None
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=f.default, help=help_text)
                continue
            kind = _ARG_TYPES.get(f.name, str)
            kwargs = dict(type=kind, default=f.default, help=help_text)
            if f.name in _CHOICES:
                kwargs["choices"] = _CHOICES[f.name]
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names})

    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _default_device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:  # pragma: no cover - torch missing is a broken install
        return "cpu"


_ARG_TYPES = {
    "port": int,
    "context_length": int,
    "mem_fraction_static": float,
    "max_total_tokens": int,
    "max_running_requests": int,
    "max_queued_requests": int,
    "max_prefill_tokens": int,
    "chunked_prefill_size": int,
    "page_size": int,
    "schedule_conservativeness": float,
    "stream_interval": int,
    "random_seed": int,
    "cuda_graph_max_bs": int,
    "tp_size": int,
    "dp_size": int,
    "nnodes": int,
    "node_rank": int,
    "decode_log_interval": int,
    "watchdog_timeout": float,
}

_CHOICES = {
    "dtype": DTYPES,
    "device": DEVICES,
    "attention_backend": ATTENTION_BACKENDS,
    "schedule_policy": SCHEDULE_POLICIES,
    "load_balance_method": LOAD_BALANCE_METHODS,
}


@dataclass
class PortArgs:
    """Endpoints of the ZMQ sockets, all `ipc://` files in one private temporary directory."""

    ipc_dir: str
    tokenizer_ipc_name: str  # detokenizer -> tokenizer manager
    scheduler_input_ipc_name: str  # tokenizer manager -> scheduler (rank 0)
    detokenizer_ipc_name: str  # scheduler -> detokenizer
    rpc_ipc_name: str  # tokenizer manager <-> scheduler control calls
    nccl_port: int = 0

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
        )
