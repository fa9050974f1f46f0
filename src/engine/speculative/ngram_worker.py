"""NgramSpeculator: a decode step run as an NGRAM verify step (SGLang's NGRAMWorker).

The scheduler prepares the running batch's decode step as always (RunningSet.update: finished
requests dropped, retraction when the plain step does not fit, one KV slot per request). When the
batch is eligible, this collaborator then:
1. drafts: for each request up to --speculative-num-draft-tokens - 1 tokens from its own prompt
   and output (ngram.py), never past its max_new_tokens or its row of the request-to-token table;
2. gives the drafts KV slots after the decode slot (ScheduleBatch.alloc_draft_slots; when the
   pool cannot hold them, the step verifies no drafts, which is a plain decode step);
3. runs the target once on (last token + drafts) per request, an extend-style TARGET_VERIFY
   forward whose positions continue the request's and whose logits are kept at every position;
4. accepts (verify.py), appends the accepted drafts and the bonus token one at a time with the
   usual finish checks (a stop token, stop string or max_new_tokens cuts the rest), then keeps the
   KV of the fed and accepted positions only (ScheduleBatch.keep_verified frees the rest), and
   releases a finished request's KV through the cache as a decode step does, so the radix cache
   only ever holds accepted tokens.

Eligible: every request samples without per-token state the verify step does not carry yet
(grammar, logprobs, hidden states, penalties, min_new_tokens, logit_bias, a seed, a custom logit
processor); otherwise the batch takes the plain decode step, which is exact anyway.
It runs in the normal (non-overlap) loop only: drafting needs the previous step's tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch

from engine.scheduler.overlap_utils import write_relay
from engine.speculative.ngram import propose_ngram_drafts
from engine.speculative.verify import VerifyOutcome, accept_drafts

if TYPE_CHECKING:
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.model_executor.forward_batch_info import ModelWorkerBatch
    from engine.scheduler.req import Req
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.scheduler.worker_protocol import ModelWorker
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class VerifyStep:
    """One verify step, from launch to result processing."""

    worker_batch: ModelWorkerBatch
    drafts: List[List[int]]
    outcome: Optional[VerifyOutcome] = None


@dataclass
class SpecStats:
    """Totals over every request's verify steps (the server's mean accept length)."""

    verify_steps: int = 0  # one per request per verify step
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    emitted_tokens: int = 0

    def mean_accept_length(self) -> float:
        """Tokens per request per verify step (1.0: no draft ever accepted)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0


class NgramSpeculator:
    def __init__(self, server_args: ServerArgs, worker: ModelWorker, tree_cache: BasePrefixCache) -> None:
        assert server_args.speculative_num_draft_tokens is not None  # ServerArgs sets NGRAM's default
        self.max_drafts = server_args.speculative_num_draft_tokens - 1
        self.min_window = server_args.speculative_ngram_min_match_window_size
        self.max_window = server_args.speculative_ngram_max_match_window_size
        self.worker = worker
        self.tree_cache = tree_cache
        self.stats = SpecStats()

    # ------------------------------------------------------------------ scheduling thread
    @staticmethod
    def eligible(req: Req) -> bool:
        """Whether the verify step reproduces this request's sampling exactly (see the module doc)."""
        sp = req.sampling_params
        return (req.grammar is None and not req.return_logprob and not req.return_hidden_states
                and req.custom_logit_processor is None and sp.sampling_seed is None and not sp.logit_bias
                and sp.frequency_penalty == 0.0 and sp.presence_penalty == 0.0 and sp.repetition_penalty == 1.0
                and sp.min_new_tokens == 0)

    def prepare(self, batch: ScheduleBatch) -> Optional[VerifyStep]:
        """The verify step of a decode-prepared batch, or None when the batch decodes plainly."""
        if not all(self.eligible(r) for r in batch.reqs):
            return None
        row_width = batch.req_to_token_pool.req_to_token.shape[1]
        drafts: List[List[int]] = []
        for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu):
            # Never more than the request may still emit (the bonus token included) or its row holds.
            budget = min(self.max_drafts, req.max_new_tokens - len(req.output_ids) - 1, row_width - seq_len)
            tokens = req.origin_input_ids + req.output_ids
            drafts.append(propose_ngram_drafts(tokens, self.min_window, self.max_window, budget))
        draft_lens = [len(d) for d in drafts]
        slots = batch.alloc_draft_slots(draft_lens)
        if slots is None and any(draft_lens):
            drafts = [[] for _ in drafts]  # the pool is short: a plain step, through the same path
            draft_lens = [0] * len(drafts)
        input_ids: List[int] = []
        for req, d in zip(batch.reqs, drafts):
            input_ids.append(req.output_ids[-1])
            input_ids.extend(d)
        return VerifyStep(worker_batch=batch.verify_worker_batch(input_ids, draft_lens, slots), drafts=drafts)

    def process(self, batch: ScheduleBatch, step: VerifyStep) -> List[Req]:
        """Append each request's verified tokens (finish checks per token), keep the KV of what was
        accepted, release finished requests. Returns the requests to stream."""
        outcome = step.outcome
        assert outcome is not None  # run() filled it on the forward thread
        allocator = batch.token_to_kv_pool_allocator
        emit: List[Req] = []
        kept_lens: List[int] = []
        finished: List[Req] = []
        for req, seq_len, drafts, tokens, accepted in zip(batch.reqs, batch.seq_lens_cpu, step.drafts,
                                                          outcome.tokens, outcome.accepted):
            appended = 0
            for token in tokens:
                req.output_ids.append(token)
                appended += 1
                req.check_finished()
                if req.finished():
                    break
            # Position seq_len - 1 held the last token; the accepted drafts among the appended
            # tokens follow it; the newest token has no KV yet.
            kept_lens.append(seq_len - 1 + appended)
            req.record_verify(accepted=min(accepted, appended), proposed=len(drafts))
            self.stats.verify_steps += 1
            self.stats.accepted_drafts += min(accepted, appended)
            self.stats.proposed_drafts += len(drafts)
            self.stats.emitted_tokens += appended
            if req.finished():
                finished.append(req)
            emit.append(req)
        allocator.free_group_begin()
        try:
            batch.keep_verified(kept_lens)
            for req in finished:
                self.tree_cache.cache_finished_req(req)
        finally:
            allocator.free_group_end()
        return emit

    def emitted_tokens(self, step: VerifyStep) -> int:
        assert step.outcome is not None
        return sum(len(t) for t in step.outcome.tokens)

    def reset_stats(self) -> None:
        """Start the server-wide totals afresh (benchmarks: measure after a warm-up)."""
        self.stats = SpecStats()

    def state(self) -> Dict[str, Any]:
        """What /get_server_info reports (SGLang's internal_states name)."""
        return {"avg_spec_accept_length": self.stats.mean_accept_length(),
                "spec_verify_ct": self.stats.verify_steps,
                "spec_accepted_tokens": self.stats.accepted_drafts,
                "spec_draft_tokens": self.stats.proposed_drafts}

    # ------------------------------------------------------------------ forward thread
    def run(self, step: VerifyStep) -> VerifyStep:
        """The verify forward and the acceptance; the relay gets each row's newest token, so a
        plain decode step after this one reads the right input."""
        wb = step.worker_batch
        logits = self.worker.forward_batch_verify(wb)
        assert wb.sampling_info is not None  # a generation batch always has one
        outcome = accept_drafts(logits, step.drafts, wb.sampling_info)
        last = torch.tensor([t[-1] for t in outcome.tokens], dtype=torch.int64)
        # The penalty/step state is brought to this batch's layout (queued filters and merges); the
        # eligible rows have no per-token sampling state, so one update per step is enough.
        wb.sampling_info.update_after_sample(last.to(wb.sampling_info.device))
        write_relay(self.worker.output_tokens_buf, wb.req_pool_indices.to(self.worker.output_tokens_buf.device),
                    last.to(self.worker.output_tokens_buf.device))
        step.outcome = outcome
        return step
