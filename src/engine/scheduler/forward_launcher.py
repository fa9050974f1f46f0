"""Launching a batch's forward where forwards run (the forward stream), and counting them.

A batch with constrained requests samples under its vocabulary mask, which needs every earlier
token accepted by the matchers. When an earlier result is still unprocessed (overlap), the forward
is launched at once and its sampling is delayed: the loop calls `sample_if_delayed` after it has
processed that result. With speculative decoding an eligible decode batch runs as a verify step
instead (speculative/speculator.py), synchronously and only when no earlier result is in flight (its
drafts need the tokens; the overlap loop settles first where the switch will verify); with a draft
model the drafter runs every plain forward with the target's (its K/V follow the target's).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Optional, Union

from engine.constrained.vocab_mask import build_vocab_mask
from engine.scheduler.overlap_utils import DelayedSample, ForwardStream, PendingResult
from engine.speculative.speculator import Speculator
from engine.speculative.step import VerifyStep

if TYPE_CHECKING:
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.scheduler.worker_protocol import ModelWorker

# What a launch returns: the result itself (normal loop), or a handle on it (overlap loop).
Launched = Union[Any, PendingResult, DelayedSample, VerifyStep]


class ForwardLauncher:
    def __init__(self, worker: ModelWorker, forward_stream: ForwardStream, is_generation: bool, vocab_size: int,
                 spec: Optional[Speculator]) -> None:
        self.worker = worker
        self.forward_stream = forward_stream
        self.is_generation = is_generation
        self.vocab_size = vocab_size
        self.spec = spec
        # Testing aid (like SGLang's forward_sleep_time): every forward sleeps this long first.
        self.forward_sleep_s = float(os.environ.get("ENGINE_TEST_FORWARD_SLEEP_S", "0"))
        self.forward_ct = 0  # forwards launched
        # Prompt and output positions this rank computed in extend forwards (a PD decode server
        # computes none: its prompts arrive by transfer).
        self.num_extend_tokens_computed = 0

    def launch(self, batch: ScheduleBatch, overlap: bool, results_in_flight: bool) -> Launched:
        """Run the forward now (`overlap` False: its result) or launch it on the forward stream
        (a handle); `results_in_flight`: an earlier forward's result is not processed yet."""
        self.forward_ct += 1
        assert batch.forward_mode is not None  # the batches to run are prepared (prepare_for_*)
        if self.spec is not None and batch.forward_mode.is_decode():
            # With a forward in flight the step cannot draft from its tokens: it decodes plainly.
            step = self.spec.prepare(batch, in_flight=overlap and results_in_flight)
            if step is not None:
                return self._run_verify(self.spec, step)
        if batch.forward_mode.is_extend():
            self.num_extend_tokens_computed += batch.extend_num_tokens
        worker_batch = batch.get_model_worker_batch()
        sleep_s, worker, is_generation = self.forward_sleep_s, self.worker, self.is_generation
        spec = self.spec if is_generation else None
        delay_sample = False
        if any(req.grammar is not None for req in batch.reqs):
            if overlap and results_in_flight:
                delay_sample = True
            else:
                assert worker_batch.sampling_info is not None  # a generation batch always has one
                worker_batch.sampling_info.vocab_mask = build_vocab_mask(batch.reqs, self.vocab_size)

        def forward() -> Any:
            if sleep_s > 0:  # the testing aid: a slow (or hung) forward, on the forward thread
                time.sleep(sleep_s)
            if not is_generation:
                return worker.forward_batch_embedding(worker_batch)
            if spec is not None:  # a drafter follows every plain forward of the target
                return spec.forward_plain(
                    worker_batch, lambda batch: worker.forward_batch_generation(batch, delay_sample=delay_sample))
            if delay_sample:
                return worker.forward_batch_generation(worker_batch, delay_sample=True)
            return worker.forward_batch_generation(worker_batch)

        # The pending result keeps worker_batch's tensors alive until it is processed (the CUDA
        # caching allocator must not hand them out while the forward still reads them).
        pending = self.forward_stream.launch(forward, inputs=worker_batch)
        if delay_sample:
            return DelayedSample(pending, worker.sample_delayed, self.forward_stream)
        return pending if overlap else pending.result()

    def _run_verify(self, spec: Speculator, step: VerifyStep) -> VerifyStep:
        """A speculative verify step, run at once in either loop (nothing is in flight: its result
        is processed before the next batch is built, since its accepted tokens set that batch's lengths)."""
        sleep_s = self.forward_sleep_s

        def verify() -> VerifyStep:
            if sleep_s > 0:  # the testing aid, as for every forward
                time.sleep(sleep_s)
            return spec.run(step)

        return self.forward_stream.run_in_order(verify).result()

    def sample_if_delayed(self, batch: ScheduleBatch, launched: Launched) -> None:
        """Sample a launched batch whose sampling waits for its mask (every older result has been
        processed by now, so its matchers are current)."""
        if isinstance(launched, DelayedSample) and launched.sampled is None:
            launched.launch_sample(build_vocab_mask(batch.reqs, self.vocab_size))
