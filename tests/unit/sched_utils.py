"""A deterministic fake model worker and a harness that drives the Scheduler in-process."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence

import pytest
import torch

from engine.detokenizer.detokenizer_manager import DetokenizerManager
from engine.io_struct import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from engine.request_options import OPTION_FIELDS, RequestOptions
from engine.scheduler.overlap_utils import resolve_relay_input_ids, write_relay
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.tp_worker import GenerationBatchResult, worker_limits
from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from engine.mem_cache.memory_pool import ReqToTokenPool
from engine.server_args import ServerArgs

VOCAB = 1000
EOS = 999
# Harness.submit takes every request option (request_options.py) next to the sampling params.
REQUEST_FIELDS = tuple(OPTION_FIELDS)


class FakeTokenizer:
    """Token id i decodes to one lowercase letter; EOS decodes to nothing."""

    eos_token_id = EOS

    def decode(self, ids, **kwargs) -> str:
        return "".join("" if i == EOS else chr(ord("a") + i % 26) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - ord("a") for c in text]

    def batch_decode(self, sequences, **kwargs):
        return [self.decode(ids) for ids in sequences]


@dataclass
class ForwardRecord:
    mode: str
    bs: int
    extend_lens: Optional[List[int]]
    rows: List[int]


class FakeWorker:
    """next token = (last input token of the request + 1) % (VOCAB - 1), EOS never unless forced."""

    def __init__(self, max_total_tokens: int = 4096, page_size: int = 1, max_running: int = 32,
                 context_len: int = 2048, next_token: Optional[Callable[[int], int]] = None) -> None:
        self.req_to_token_pool = ReqToTokenPool(max_running, context_len)
        if page_size == 1:
            self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(max_total_tokens, torch.float32, "cpu", None)
        else:
            self.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
                max_total_tokens, page_size, torch.float32, "cpu", None)
        self.max_total_tokens = max_total_tokens
        self.page_size = page_size
        self.max_running = max_running
        self.context_len = context_len
        self.eos_token_ids = {EOS}
        self.next_token = next_token or (lambda last: (last + 1) % (VOCAB - 1))
        self.records: List[ForwardRecord] = []
        self.control_calls: List[tuple] = []
        self.output_tokens_buf = torch.zeros(max_running + 1, dtype=torch.int64)

    def get_worker_info(self) -> Dict:
        return worker_limits(self.max_total_tokens, self.context_len, self.req_to_token_pool.size,
                             None, VOCAB, self.page_size, "cpu")

    def forward_batch_generation(self, batch) -> GenerationBatchResult:
        ids = resolve_relay_input_ids(batch.input_ids, batch.relay_rows, self.output_tokens_buf).tolist()
        if batch.forward_mode.is_extend():
            ends = torch.cumsum(torch.tensor(batch.extend_seq_lens), 0).tolist()
            last = [ids[e - 1] for e in ends]
        else:
            last = ids
        self.records.append(ForwardRecord(batch.forward_mode.name, batch.batch_size,
                                          batch.extend_seq_lens, batch.req_pool_indices.tolist()))
        nxt = torch.tensor([self.next_token(t) for t in last], dtype=torch.int64)
        write_relay(self.output_tokens_buf, batch.req_pool_indices, nxt)
        return GenerationBatchResult(logits_output=None, next_token_ids=nxt)

    # The control plane's calls (SchedulerControl), recorded: there is no model behind them.
    def release_memory_occupation(self, tags) -> None:
        self.control_calls.append(("release", sorted(tags)))

    def resume_memory_occupation(self, tags) -> None:
        self.control_calls.append(("resume", sorted(tags)))

    def update_weights_from_disk(self, model_path, load_format):
        self.control_calls.append(("update", model_path))
        return True, "Succeeded to update model weights."

    def commit_weights(self) -> None:
        pass


@dataclass
class ReqOutput:
    output_ids: List[int] = field(default_factory=list)
    finished_reason: Optional[dict] = None
    emissions: List[List[int]] = field(default_factory=list)  # output_ids delta of each emission
    emitted_lengths: List[int] = field(default_factory=list)  # completion_tokens at each emission
    cached_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: List[float] = field(default_factory=list)  # output token logprobs, then input ones
    text: str = ""  # the detokenizer's deltas, concatenated (Harness(detokenize=True))
    hidden_states: List = field(default_factory=list)  # return_hidden_states entries
    token_ids_logprobs: List = field(default_factory=list)  # token_ids_logprob, output positions
    input_token_ids_logprobs: List = field(default_factory=list)
    logprob_ids: List[int] = field(default_factory=list)  # output_token_logprobs_idx
    top_logprobs: List = field(default_factory=list)  # (values, ids) per output position (top_logprobs_num)
    embedding: Optional[bytes] = None  # an embedding request's float32 vector


class Harness:
    def __init__(self, worker: Optional[FakeWorker] = None, tokenizer=None, overlap: bool = False,
                 detokenize: bool = False, transfer_network=None, **server_kwargs) -> None:
        server_kwargs.setdefault("device", "cpu")
        server_kwargs["disable_overlap_schedule"] = not overlap
        self.overlap = overlap
        server_kwargs.setdefault("strict_memory_check", True)
        server_kwargs.setdefault("chunked_prefill_size", -1)
        self.args = ServerArgs(**server_kwargs)
        self.worker = worker or FakeWorker()
        tokenizer = tokenizer or FakeTokenizer()
        self.scheduler = Scheduler(self.args, worker=self.worker, tokenizer=tokenizer,
                                   transfer_network=transfer_network)
        # The scheduler's messages also go through a real DetokenizerManager, as in the server.
        self.detokenizer = DetokenizerManager(tokenizer) if detokenize else None
        self.outputs: Dict[str, ReqOutput] = {}
        self.counter = 0
        self.finish_order: List[str] = []  # rids in the order they finished
        self.replies: List = []  # control replies the scheduler sent

    def submit(self, input_ids: List[int], rid: Optional[str] = None, stream: bool = False, **sampling) -> str:
        """Sampling params, plus any request option (return_logprob, priority, ...)."""
        if rid is None:
            rid = f"r{self.counter}"
            self.counter += 1
        sampling.setdefault("temperature", 0.0)
        sampling.setdefault("max_new_tokens", 8)
        fields = {name: sampling.pop(name) for name in list(sampling) if name in REQUEST_FIELDS}
        self.scheduler.add_request(TokenizedGenerateReqInput(
            rid=rid, input_ids=list(input_ids), sampling_params=sampling, stream=stream,
            options=RequestOptions(**fields)))
        self.outputs.setdefault(rid, ReqOutput())
        return rid

    def submit_embedding(self, input_ids: List[int], rid: Optional[str] = None,
                         dimensions: Optional[int] = None) -> str:
        if rid is None:
            rid = f"e{self.counter}"
            self.counter += 1
        self.scheduler.add_request(TokenizedEmbeddingReqInput(rid=rid, input_ids=list(input_ids),
                                                              dimensions=dimensions))
        self.outputs.setdefault(rid, ReqOutput())
        return rid

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.scheduler.add_request(AbortReq(rid=rid, abort_all=abort_all))

    def control(self, msg):
        """Send a control request, run one step, return its reply."""
        self.scheduler.add_request(msg)
        before = len(self.replies)
        self.step()
        assert len(self.replies) == before + 1, "no reply to the control request"
        return self.replies[-1]

    def step(self):
        batch = self.scheduler.step_overlap() if self.overlap else self.scheduler.step()
        self._collect()
        return batch

    def _collect(self) -> None:
        for msg in self.scheduler.outbox:
            if isinstance(msg, BatchEmbeddingOutput):
                self._collect_embeddings(msg)
                continue
            if not isinstance(msg, BatchTokenIDOutput):
                self.replies.append(msg)  # control replies
                continue
            texts = self.detokenizer.handle_batch_token_id_out(msg).output_strs if self.detokenizer else None
            for i, rid in enumerate(msg.rids):
                out = self.outputs.setdefault(rid, ReqOutput())
                assert out.finished_reason is None, f"{rid} emitted after it finished"
                out.output_ids.extend(msg.output_ids[i])
                if texts is not None:
                    out.text += texts[i]
                out.emissions.append(list(msg.output_ids[i]))
                out.emitted_lengths.append(msg.completion_tokens[i])
                out.finished_reason = msg.finished_reasons[i]
                out.cached_tokens = msg.cached_tokens[i]
                out.prompt_tokens = msg.prompt_tokens[i]
                out.completion_tokens = msg.completion_tokens[i]
                if msg.output_token_logprobs_val and msg.output_token_logprobs_val[i]:
                    out.logprobs.extend(msg.output_token_logprobs_val[i])
                if msg.output_token_logprobs_idx and msg.output_token_logprobs_idx[i]:
                    out.logprob_ids.extend(msg.output_token_logprobs_idx[i])
                if msg.output_top_logprobs_val and msg.output_top_logprobs_val[i]:
                    out.top_logprobs.extend(zip(msg.output_top_logprobs_val[i], msg.output_top_logprobs_idx[i]))
                if msg.input_token_logprobs_val and msg.input_token_logprobs_val[i]:
                    out.logprobs.extend(v for v in msg.input_token_logprobs_val[i] if v is not None)
                if msg.output_hidden_states and msg.output_hidden_states[i]:
                    out.hidden_states.extend(msg.output_hidden_states[i])
                if msg.output_token_ids_logprobs_val and msg.output_token_ids_logprobs_val[i]:
                    out.token_ids_logprobs.extend(msg.output_token_ids_logprobs_val[i])
                if msg.input_token_ids_logprobs_val and msg.input_token_ids_logprobs_val[i]:
                    out.input_token_ids_logprobs.extend(msg.input_token_ids_logprobs_val[i])
                if out.finished_reason is not None:
                    self.finish_order.append(rid)
        self.scheduler.outbox.clear()

    def _collect_embeddings(self, msg: BatchEmbeddingOutput) -> None:
        for i, rid in enumerate(msg.rids):
            out = self.outputs.setdefault(rid, ReqOutput())
            assert out.finished_reason is None, f"{rid} reported twice"
            out.finished_reason = msg.finished_reasons[i]
            out.embedding = msg.embeddings[i]
            out.prompt_tokens = msg.prompt_tokens[i]
            out.cached_tokens = msg.cached_tokens[i]

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_work():
            self.step()
            steps += 1
            assert steps < max_steps, "scheduler did not become idle"
        # One more idle step runs the memory self-check.
        self.step()
        return steps

    def modes(self) -> List[str]:
        return [r.mode for r in self.worker.records]


def fast_lane(values: Sequence[Any], fast: Collection[Any]) -> List[Any]:
    """Parametrize values, all but those in `fast` marked slow (the full suite runs every one; the fast
    lane keeps one case per idea)."""
    return [v if v in fast else pytest.param(*(v if isinstance(v, tuple) else (v,)), marks=pytest.mark.slow)
            for v in values]
