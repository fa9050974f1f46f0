"""CudaGraphRunner: decode forwards of common batch sizes, captured once as CUDA graphs and replayed.

A decode step of a small batch is a few hundred tiny kernels; launching them one by one from
Python costs more than running them. So at start-up the decode forward is captured for the batch
sizes in `get_batch_sizes_to_capture` (1, 2, 4, 8, 16, 24, 32, ... up to --cuda-graph-max-bs).
A batch of size b runs the graph of the smallest captured size >= b: its inputs are copied into
static buffers and the rows b.. are padding that touches nothing real (req_pool_idx 0, the reserved
row; seq_len 1; out_cache_loc 0, the reserved padding slot). The logits of the first b rows are
returned; sampling stays outside the graph, so every sampling option keeps working.

Capture and replay go through a tiny interface (`graph_factory`: `warmup(fn, runs)` and
`capture(fn) -> graph` with `graph.replay()`), so the padding, bucketing and slicing logic is
exercised on the CPU with a fake graph that simply re-runs the captured function over the same
static buffers (tests/unit/test_cuda_graph_runner.py).

The attention backend takes part through three methods (triton has them; torch_native and
flashinfer declare `supports_cuda_graph = False`, and then no graph is captured):
  init_cuda_graph_state(max_bs)                     static metadata buffers, once
  init_forward_metadata_capture_cuda_graph(fb)      fb.attn_metadata views the static buffers
  init_forward_metadata_replay_cuda_graph(fb)       refresh them from fb's (static) inputs
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from engine.layers.logits_processor import LogitsProcessorOutput
from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from engine.layers.attention.base_attn_backend import AttentionBackend
    from engine.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Two runs before capture: the first compiles Triton kernels and creates cuBLAS handles and
# workspaces, the second runs with everything cached, as the captured run will.
DEFAULT_WARMUP_RUNS = 2


def get_batch_sizes_to_capture(max_bs: int) -> List[int]:
    """1, 2, 4, 8, then every multiple of 8 from 16, up to max_bs (always included)."""
    if max_bs < 1:
        return []
    sizes = [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_batch_size(bs: int, capture_bs: List[int]) -> Optional[int]:
    """The smallest captured size that holds `bs` rows, None when none does."""
    i = bisect.bisect_left(capture_bs, bs)
    return capture_bs[i] if i < len(capture_bs) else None


def backend_supports_cuda_graph(backend: AttentionBackend) -> bool:
    return backend.supports_cuda_graph


class TorchCudaGraphFactory:
    """The real graphs: torch.cuda.CUDAGraph, all sharing one memory pool and one capture stream.

    Warm-up runs on the capture stream too, so that the per-stream state they create (cuBLAS
    workspaces) is the one the capture sees.
    """

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        # One pool for every size: captured largest first, the smaller graphs reuse its blocks.
        self.pool = torch.cuda.graph_pool_handle()

    def warmup(self, fn: Callable[[], None], runs: int) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(runs):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        torch.cuda.synchronize(self.device)

    def capture(self, fn: Callable[[], None]) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            fn()
        torch.cuda.synchronize(self.device)
        return graph


class CudaGraphRunner:
    def __init__(
        self,
        model_runner: ModelRunner,
        graph_factory: Any = None,
        batch_sizes: Optional[List[int]] = None,
        warmup_runs: int = DEFAULT_WARMUP_RUNS,
    ) -> None:
        """Capture at once. `batch_sizes` defaults to get_batch_sizes_to_capture of
        min(--cuda-graph-max-bs, request slots); `graph_factory` to real CUDA graphs."""
        self.model_runner = model_runner
        self.device = model_runner.device
        self.attn_backend = model_runner.attn_backend
        if not backend_supports_cuda_graph(self.attn_backend):
            raise ValueError(f"attention backend {type(self.attn_backend).__name__} does not support CUDA graphs")
        if batch_sizes is None:
            max_bs = min(model_runner.server_args.cuda_graph_max_bs, model_runner.req_to_token_pool.size)
            batch_sizes = get_batch_sizes_to_capture(max_bs)
        self.capture_bs: List[int] = sorted(set(batch_sizes))
        if not self.capture_bs or self.capture_bs[0] < 1:
            raise ValueError(f"no valid batch size to capture in {batch_sizes}")
        self.max_bs = self.capture_bs[-1]
        self.graph_factory = graph_factory if graph_factory is not None else TorchCudaGraphFactory(self.device)
        self.warmup_runs = warmup_runs
        self.graphs: Dict[int, Any] = {}
        self.forward_batches: Dict[int, ForwardBatch] = {}
        # Rows [0, _stale_upto) of the static inputs may hold a real request of an earlier batch.
        self._stale_upto = 0

        with torch.inference_mode():
            self._allocate_static_buffers()
            self.attn_backend.init_cuda_graph_state(self.max_bs)
            self.capture()

    # ------------------------------------------------------------------ set-up
    def _allocate_static_buffers(self) -> None:
        n, dev = self.max_bs, self.device
        # Every row starts as padding; replay overwrites the leading rows with the real batch.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
        # One logits buffer for every size: each graph ends by copying its logits here, so the
        # graphs need no per-size output memory.
        vocab = self.model_runner.model_config.vocab_size
        self.logits_buffer = torch.zeros(n, vocab, dtype=torch.float32, device=dev)

    def _static_forward_batch(self, bs: int) -> ForwardBatch:
        mr = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_sum=bs,
            req_to_token_pool=mr.req_to_token_pool,
            token_to_kv_pool=mr.token_to_kv_pool,
            attn_backend=self.attn_backend,
        )

    def capture(self) -> None:
        start = time.perf_counter()
        free_before = _free_device_memory(self.device)
        # Largest first: the shared pool then already holds blocks big enough for the rest.
        for bs in reversed(self.capture_bs):
            fb = self._static_forward_batch(bs)
            self.attn_backend.init_forward_metadata_capture_cuda_graph(fb)
            self.attn_backend.init_forward_metadata_replay_cuda_graph(fb)
            run = self._make_run(fb)
            self.graph_factory.warmup(run, self.warmup_runs)
            self.graphs[bs] = self.graph_factory.capture(run)
            self.forward_batches[bs] = fb
        used = free_before - _free_device_memory(self.device)
        logger.info(
            "Captured %d CUDA graphs (batch sizes %s) in %.1f s, using %.2f GB",
            len(self.capture_bs), _describe_sizes(self.capture_bs), time.perf_counter() - start, used / 1e9,
        )

    def _make_run(self, fb: ForwardBatch) -> Callable[[], None]:
        model, logits_buffer, bs = self.model_runner.model, self.logits_buffer, fb.batch_size

        def run() -> None:
            out = model.forward(fb.input_ids, fb.positions, fb)
            logits_buffer[:bs].copy_(out.next_token_logits)

        return run

    # ------------------------------------------------------------------ replay
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        # The graphs return logits only: a batch that wants hidden states runs eagerly.
        return (forward_batch.forward_mode.is_decode() and 0 < forward_batch.batch_size <= self.max_bs
                and not forward_batch.capture_hidden_states)

    def replay(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        raw_bs = forward_batch.batch_size
        bs = padded_batch_size(raw_bs, self.capture_bs)
        if bs is None:
            raise ValueError(f"batch size {raw_bs} is larger than the largest captured graph ({self.max_bs})")
        self._load_inputs(forward_batch, raw_bs, bs)
        static_fb = self.forward_batches[bs]
        self.attn_backend.init_forward_metadata_replay_cuda_graph(static_fb)
        self.graphs[bs].replay()
        # A view of the static buffer: valid until the next replay, which runs after this batch
        # was sampled (one stream, launch order).
        return LogitsProcessorOutput(next_token_logits=self.logits_buffer[:raw_bs])

    def _load_inputs(self, fb: ForwardBatch, raw_bs: int, bs: int) -> None:
        self.input_ids[:raw_bs].copy_(fb.input_ids)
        self.positions[:raw_bs].copy_(fb.positions)
        self.req_pool_indices[:raw_bs].copy_(fb.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(fb.seq_lens)
        self.out_cache_loc[:raw_bs].copy_(fb.out_cache_loc)
        # Only rows that an earlier, larger batch filled need to be turned back into padding.
        reset_end = min(bs, self._stale_upto)
        if reset_end > raw_bs:
            rows = slice(raw_bs, reset_end)
            self.input_ids[rows].zero_()
            self.positions[rows].zero_()
            self.req_pool_indices[rows].zero_()
            self.seq_lens[rows].fill_(1)
            self.out_cache_loc[rows].zero_()
        self._stale_upto = self._stale_upto if self._stale_upto > bs else raw_bs


def maybe_create_cuda_graph_runner(model_runner: ModelRunner) -> Optional[CudaGraphRunner]:
    """The runner for a CUDA ModelRunner, or None (logged) when graphs are off or unsupported."""
    args = model_runner.server_args
    if not str(model_runner.device).startswith("cuda") or args.disable_cuda_graph:
        return None
    backend = model_runner.attn_backend
    if not backend_supports_cuda_graph(backend):
        logger.info(
            "CUDA graphs disabled: the %s attention backend does not support them (use --attention-backend triton)",
            args.attention_backend,
        )
        return None
    if min(args.cuda_graph_max_bs, model_runner.req_to_token_pool.size) < 1:
        logger.info("CUDA graphs disabled: --cuda-graph-max-bs is below 1")
        return None
    return CudaGraphRunner(model_runner)


def _free_device_memory(device: str) -> int:
    if str(device).startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    return 0


def _describe_sizes(sizes: List[int]) -> str:
    if len(sizes) <= 6:
        return str(sizes)
    return f"[{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}]"
