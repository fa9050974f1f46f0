"""Helpers for the GPU tests: tiny models sized for the GPU kernels, an in-process scheduler
driver, and transformers' greedy / teacher-forced references on CUDA."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from utils_models import build_tiny_model

from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
from engine.request_options import RequestOptions
from engine.server_args import ServerArgs

DEV = "cuda"
# Head dim 64 (a size the kernels meet in real models), GQA 2, three layers.
GPU_TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=1024)


def build_gpu_tiny_model(path: str, arch: str = "llama", seed: int = 0):
    """Write a random model to `path`; return transformers' float32 model on CUDA (eval)."""
    extra = {"rope_theta": 10000.0}
    hf = build_tiny_model(path, arch, seed=seed, **GPU_TINY, **extra)
    return hf.to(DEV).eval()


def make_prompts(lengths: Sequence[int], vocab: int, seed: int = 0) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy_cuda(model, prompt: Sequence[int], steps: int) -> List[int]:
    ids = torch.tensor([list(prompt)], device=DEV)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=steps,
                         min_new_tokens=steps, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs_of(model, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """[len(generated), vocab] float32 log-probabilities of each generated position, teacher-forced."""
    ids = torch.tensor([list(prompt) + list(generated)], device=DEV)
    logits = model(ids).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start:start + len(generated)], dim=-1)


@dataclass
class Output:
    output_ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    finished: bool = False


class SchedulerDriver:
    """The real Scheduler + TpModelWorker in this process, fed token ids, run to completion."""

    def __init__(self, model_path: str, **server_kwargs) -> None:
        from engine.scheduler.scheduler import Scheduler

        server_kwargs.setdefault("device", "cuda")
        server_kwargs.setdefault("log_level", "warning")
        server_kwargs.setdefault("strict_memory_check", True)
        # A fixed pool: several drivers live in one test process, and sizing from free memory
        # is exercised by the server test.
        server_kwargs.setdefault("max_total_tokens", 1 << 16)
        self.args = ServerArgs(model_path=model_path, **server_kwargs)
        self.scheduler = Scheduler(self.args)
        self.model_runner = self.scheduler.worker.model_runner
        self.overlap = not self.args.disable_overlap_schedule
        self.outputs: Dict[str, Output] = {}

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: Sequence[int],
                 return_logprob: bool = False) -> List[Output]:
        rids = []
        for i, (p, n) in enumerate(zip(prompts, max_new_tokens)):
            rid = f"req-{len(self.outputs)}-{i}"
            rids.append(rid)
            self.outputs[rid] = Output()
            self.scheduler.add_request(TokenizedGenerateReqInput(
                rid=rid, input_ids=list(p), options=RequestOptions(return_logprob=return_logprob),
                sampling_params={"max_new_tokens": int(n), "temperature": 0.0, "ignore_eos": True}))
        steps = 0
        while self.scheduler.has_work():
            self.scheduler.step_overlap() if self.overlap else self.scheduler.step()
            self._collect()
            steps += 1
            assert steps < 100_000, "scheduler did not finish"
        # One idle step runs the strict memory self-check.
        self.scheduler.step_overlap() if self.overlap else self.scheduler.step()
        self._collect()
        return [self.outputs[r] for r in rids]

    def _collect(self) -> None:
        for msg in self.scheduler.outbox:
            if not isinstance(msg, BatchTokenIDOutput):
                continue
            for i, rid in enumerate(msg.rids):
                out = self.outputs[rid]
                out.output_ids.extend(msg.output_ids[i])
                if msg.output_token_logprobs_val and msg.output_token_logprobs_val[i]:
                    out.logprobs.extend(msg.output_token_logprobs_val[i])
                out.finished = msg.finished_reasons[i] is not None
        self.scheduler.outbox.clear()

    def close(self) -> None:
        stream = getattr(self.scheduler, "forward_stream", None)
        if stream is not None:
            stream.shutdown()
        del self.scheduler, self.model_runner
        gc.collect()
        torch.cuda.empty_cache()


class ReplayCounter:
    """Wraps a ModelRunner's CudaGraphRunner.replay to count the decode steps served by graphs."""

    def __init__(self, model_runner) -> None:
        self.count = 0
        self.batch_sizes: List[int] = []
        runner = model_runner.cuda_graph_runner
        if runner is None:
            return
        inner = runner.replay

        def replay(forward_batch):
            self.count += 1
            self.batch_sizes.append(forward_batch.batch_size)
            return inner(forward_batch)

        runner.replay = replay


def flashinfer_available() -> bool:
    try:
        import flashinfer  # noqa: F401  (only whether it imports)
    except Exception:
        return False
    return True


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
