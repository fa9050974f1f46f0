"""Overlap scheduling support: the pool-indexed token relay and the forward stream.

The relay: `output_tokens_buf[req_pool_idx]` holds the last token sampled for the request in that
request-pool row. A decode row is launched with a placeholder id (-1) and its request's row; the
worker gathers the real id from the relay at forward entry, and writes the sampled ids back after
sampling. So the scheduler can launch step N+1 before it has seen the tokens of step N.

The forward stream runs forwards in launch order, off the scheduling thread:
- CPU: one worker thread (torch releases the GIL, so scheduling really runs in parallel); a job's
  completion is the `copy_done` signal. The model is built on this thread too (`call`), and the
  scheduler process keeps its own thread to one OpenMP thread (`limit_omp_threads_of_this_thread`),
  so the process has a single OpenMP team (each thread that runs a parallel region gets its own).
  Measured: a 2-core decode step 1.5x slower with a second, idle team; the likely mechanism is
  libgomp cutting its spin-waits short once it manages more threads than there are cores, so
  every parallel region pays a futex wake-up.
- CUDA: a forward stream plus a copy stream; `copy_done` is an event recorded after the sampled
  ids were copied to pinned host memory.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterator, List, Optional

import torch

RELAY_PLACEHOLDER = -1


def resolve_relay_input_ids(input_ids: torch.Tensor, relay_rows: Optional[torch.Tensor],
                            output_tokens_buf: torch.Tensor) -> torch.Tensor:
    """Fill the placeholder ids (in order) with the relay entries of `relay_rows`."""
    if relay_rows is None or relay_rows.numel() == 0:
        return input_ids
    ids = input_ids.clone()
    ids[ids == RELAY_PLACEHOLDER] = output_tokens_buf[relay_rows]
    return ids


def write_relay(output_tokens_buf: torch.Tensor, req_pool_indices: torch.Tensor,
                next_token_ids: torch.Tensor) -> None:
    output_tokens_buf[req_pool_indices] = next_token_ids


class PendingResult:
    """A launched forward whose result is read only after `copy_done`.

    It also keeps what the forward reads and writes on the device referenced until the scheduler
    drops it, after processing its result: `inputs` (the worker batch: out_cache_loc, input ids,
    sampling tensors...) and, on CUDA, the device tensor of the sampled ids that the copy stream
    reads. The CUDA caching allocator hands a freed block at once to the next allocation of the
    stream that allocated it; without these references the next batch, prepared on the
    scheduling stream while this forward runs, could be given memory the forward stream or the
    copy stream still reads (SGLang keeps launched batches alive in `batch_record_buf` for the
    same reason). On the CPU the references are harmless and make the mechanism testable.
    """

    def __init__(self, future: Future, copy_done: Any = None, inputs: Any = None,
                 device_outputs: Optional[List[Any]] = None) -> None:
        self._future = future
        self._copy_done = copy_done
        self.inputs = inputs
        self.device_outputs: List[Any] = device_outputs if device_outputs is not None else []

    def result(self) -> Any:
        out = self._future.result()
        if self._copy_done is not None:
            self._copy_done.synchronize()
        return out

    def launched_value(self) -> Any:
        """The job's return value without waiting for its device work (for a job that runs
        after it on the forward stream, hence after it on the device too)."""
        return self._future.result()


class DelayedSample:
    """A launched forward whose sampling waits for its vocabulary mask (constrained decoding).

    The overlap loop launches step N+1 before processing step N; the grammar mask of N+1 needs
    N's tokens accepted by the matchers, so N+1 samples only when `launch_sample` is called,
    after N was processed. The sampling job queues behind the forward on the forward stream.
    """

    def __init__(self, forward: PendingResult, sample: Callable[[Any, Any], Any], stream: "ForwardStream") -> None:
        self.forward = forward
        self._sample = sample
        self._stream = stream
        self.sampled: Optional[PendingResult] = None

    def launch_sample(self, vocab_mask: Any) -> None:
        forward = self.forward  # kept by this object, with the forward's inputs, until processed
        self.sampled = self._stream.launch(lambda: self._sample(forward.launched_value(), vocab_mask),
                                           inputs=vocab_mask)

    def result(self) -> Any:
        if self.sampled is None:
            raise RuntimeError("the result of a delayed-sampling forward was read before its sampling was launched")
        return self.sampled.result()


class ForwardStream:
    """Runs forward jobs in launch order, off the scheduling thread."""

    def __init__(self, device: str) -> None:
        self.device = str(device)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="forward")
        self.is_cuda = self.device.startswith("cuda")
        if self.is_cuda:
            self.forward_stream = torch.cuda.Stream()
            self.copy_stream = torch.cuda.Stream()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the forward thread now and return its result (e.g. building the model)."""
        return self.executor.submit(fn).result()

    def launch(self, fn: Callable[[], Any], inputs: Any = None) -> PendingResult:
        """Queue `fn` (a forward over `inputs`, kept alive by the returned PendingResult)."""
        if not self.is_cuda:
            return PendingResult(self.executor.submit(_in_inference_mode, fn), inputs=inputs)
        # The forward must see everything the scheduler queued on its own stream (req_to_token
        # writes, H2D copies) before launching.
        scheduled = torch.cuda.Event()
        scheduled.record(torch.cuda.current_stream())
        copy_done = torch.cuda.Event()
        device_outputs: List[Any] = []
        future = self.executor.submit(self._run_cuda, fn, scheduled, copy_done, device_outputs)
        return PendingResult(future, copy_done, inputs=inputs, device_outputs=device_outputs)

    def run_in_order(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the forward stream after every forward launched before it (PD decode: KV
        restores and relay writes for rows and slots an in-flight forward may still touch)."""
        if not self.is_cuda:
            return self.executor.submit(_in_inference_mode, fn)
        scheduled = torch.cuda.Event()
        scheduled.record(torch.cuda.current_stream())

        def run() -> Any:
            with torch.inference_mode(), torch.cuda.stream(self.forward_stream):
                self.forward_stream.wait_event(scheduled)
                out = fn()
                done = torch.cuda.Event()
                done.record(self.forward_stream)
            done.synchronize()
            return out

        return self.executor.submit(run)

    def fence(self) -> Callable[[], bool]:
        """A check that turns true once every forward launched so far has finished."""
        future = self.run_in_order(lambda: None)
        return future.done

    def _run_cuda(self, fn: Callable[[], Any], scheduled: Any, copy_done: Any, device_outputs: List[Any]) -> Any:
        with torch.inference_mode(), torch.cuda.stream(self.forward_stream):
            self.forward_stream.wait_event(scheduled)
            result = fn()
            forward_done = torch.cuda.Event()
            forward_done.record(self.forward_stream)
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(forward_done)
            if result.next_token_ids is not None:  # None: delayed sampling, or an embedding batch
                # The copy stream reads this tensor after the forward thread moves on: keep it.
                device_outputs.append(result.next_token_ids)
                result.next_token_ids = result.next_token_ids.to("cpu", non_blocking=True)
            copy_done.record(self.copy_stream)
        return result

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)


def _in_inference_mode(fn: Callable[[], Any]) -> Any:
    with torch.inference_mode():
        return fn()


def limit_omp_threads_of_this_thread(n: int = 1) -> bool:
    """Set the calling thread's OpenMP thread count (torch.set_num_threads sets every thread's).

    The scheduling thread runs only small tensor ops; with one OpenMP thread it never starts a
    team of its own next to the forward thread's. A no-op where torch does not use libgomp.
    """
    try:
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(n)
    except (OSError, AttributeError):
        return False
    return True


@contextmanager
def scheduling_thread() -> Iterator[None]:
    """In-process use (benchmarks): run an in-process Scheduler from this thread as the scheduler
    process runs it, with one OpenMP thread here, restoring the count afterwards."""
    before = torch.get_num_threads()
    limit_omp_threads_of_this_thread(1)
    try:
        yield
    finally:
        limit_omp_threads_of_this_thread(before)
