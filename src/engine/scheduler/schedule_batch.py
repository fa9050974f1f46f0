"""ScheduleBatch: a batch as the scheduler builds it, and its preparation for a forward.

Data flow: ScheduleBatch (this file, CPU-heavy, mutable) -> ModelWorkerBatch (immutable snapshot)
-> ForwardBatch (device tensors, built by the model runner).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, List, Optional, Tuple, TypeVar

import torch

from engine.scheduler.req import (  # noqa: F401  (re-exported: the SGLang vocabulary lives here)
    CLIP_MAX_NEW_TOKENS_ESTIMATION,
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MATCHED_STR,
    FINISH_MATCHED_TOKEN,
    Req,
)
from engine.scheduler.overlap_utils import RELAY_PLACEHOLDER
from engine.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch

if TYPE_CHECKING:
    from engine.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.mem_cache.memory_pool import ReqToTokenPool
    from engine.sampling.sampling_batch_info import SamplingBatchInfo

logger = logging.getLogger(__name__)

# After a retraction the new_token_ratio estimate assumes every survivor decodes this many more steps.
RETRACT_DECODE_STEPS = 20


def _i64(values: List[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


_T = TypeVar("_T")


def _prepared(value: Optional[_T]) -> _T:
    assert value is not None  # prepare_for_extend / prepare_for_decode set it before it is read
    return value


def _row(req: Req) -> int:
    assert req.req_pool_idx is not None  # every request of a batch has a row (_alloc_req_slots, PD pre-allocation)
    return req.req_pool_idx


@dataclass
class ScheduleBatch:
    reqs: List[Req]
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: PagedTokenToKVPoolAllocator
    tree_cache: BasePrefixCache
    vocab_size: int
    device: str = "cpu"

    forward_mode: Optional[ForwardMode] = None
    batch_is_full: bool = False

    # Per-request state for the forward (CPU lists are the source of truth; tensors are views for the worker)
    input_ids: Optional[torch.Tensor] = None
    req_pool_indices: Optional[torch.Tensor] = None
    seq_lens: Optional[torch.Tensor] = None
    seq_lens_cpu: List[int] = field(default_factory=list)
    out_cache_loc: Optional[torch.Tensor] = None
    prefix_lens: List[int] = field(default_factory=list)
    extend_lens: List[int] = field(default_factory=list)
    extend_num_tokens: int = 0
    extend_logprob_start_lens: List[int] = field(default_factory=list)
    extend_input_logprob_token_ids: Optional[torch.Tensor] = None
    relay_rows: Optional[torch.Tensor] = None  # rows whose placeholder input ids come from the relay

    return_logprob: bool = False
    top_logprobs_nums: List[int] = field(default_factory=list)
    token_ids_logprobs: List[Optional[List[int]]] = field(default_factory=list)  # token_ids_logprob per row
    return_hidden_states: bool = False
    sampling_info: Optional[SamplingBatchInfo] = None

    # The requests of a MIXED batch that ride along as decode rows.
    decoding_reqs: List[Req] = field(default_factory=list)
    # Logging of the prefill that built this batch
    log_input_tokens: int = 0
    log_hit_tokens: int = 0

    @classmethod
    def init_new(cls, reqs: List[Req], req_to_token_pool: ReqToTokenPool,
                 token_to_kv_pool_allocator: PagedTokenToKVPoolAllocator, tree_cache: BasePrefixCache,
                 vocab_size: int, device: str = "cpu") -> "ScheduleBatch":
        return cls(
            reqs=reqs,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
            tree_cache=tree_cache,
            vocab_size=vocab_size,
            device=device,
            return_logprob=any(r.return_logprob for r in reqs),
            return_hidden_states=any(r.return_hidden_states for r in reqs),
        )

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return len(self.reqs) == 0

    @property
    def page_size(self) -> int:
        return self.token_to_kv_pool_allocator.page_size

    # ------------------------------------------------------------------ memory helpers
    def _evict_for(self, num_tokens: int) -> None:
        allocator = self.token_to_kv_pool_allocator
        available = allocator.available_size()
        if available < num_tokens and self.tree_cache is not None:
            self.tree_cache.evict(num_tokens - available)
        # The hybrid sliding-window pool: the windowed layers' slots too (0 with one pool).
        windowed_missing = allocator.windowed_shortfall(num_tokens)
        if windowed_missing and self.tree_cache is not None:
            self.tree_cache.evict_windowed(windowed_missing)

    def _oom_message(self, what: str, need: int) -> str:
        evictable = self.tree_cache.evictable_size() if self.tree_cache is not None else 0
        return (f"{what} out of memory: need {need} tokens, available "
                f"{self.token_to_kv_pool_allocator.available_size()}, evictable {evictable}")

    def _alloc_req_slots(self) -> List[bool]:
        """Rows for the requests without one; per request, whether it got its row now."""
        need = [r for r in self.reqs if r.req_pool_idx is None]
        fresh = [r.req_pool_idx is None for r in self.reqs]
        if not need:
            return fresh
        rows = self.req_to_token_pool.alloc(len(need))
        if rows is None:
            raise RuntimeError("alloc_req_slots: no free request slot; max_running_requests is too large "
                               "for the request-to-token pool")
        for req, row in zip(need, rows):
            req.req_pool_idx = row
        return fresh

    def _alloc_extend_slots(self, prefix_lens: List[int], seq_lens: List[int]) -> torch.Tensor:
        allocator = self.token_to_kv_pool_allocator
        page = allocator.page_size
        if page == 1:
            self._evict_for(self.extend_num_tokens)
            out = allocator.alloc(self.extend_num_tokens)
        else:
            self._evict_for(self.extend_num_tokens + len(self.reqs) * page)
            last_loc = [
                int(self.req_to_token_pool.req_to_token[r.req_pool_idx, p - 1]) if p > 0 else -1
                for r, p in zip(self.reqs, prefix_lens)
            ]
            out = allocator.alloc_extend(_i64(prefix_lens), _i64(seq_lens), _i64(last_loc), self.extend_num_tokens)
        if out is None:
            raise RuntimeError(self._oom_message("Prefill", self.extend_num_tokens))
        return out

    # ------------------------------------------------------------------ extend
    def prepare_for_extend(self) -> None:
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        prefix_lens = [len(r.prefix_indices) for r in reqs]
        seq_lens = [len(r.fill_ids) for r in reqs]
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        input_ids: List[int] = []
        for r, p in zip(reqs, prefix_lens):
            input_ids.extend(r.fill_ids[p:])
        self.extend_num_tokens = sum(extend_lens)

        fresh = self._alloc_req_slots()
        # The hybrid sliding-window pool releases what left the windows first (a no-op otherwise).
        self.token_to_kv_pool_allocator.release_out_of_window(
            [_row(r) for r in reqs], prefix_lens, [r.cache_protected_len for r in reqs], fresh,
            self.req_to_token_pool.req_to_token)
        out_cache_loc = self._alloc_extend_slots(prefix_lens, seq_lens)

        table = self.req_to_token_pool.req_to_token
        pt = 0
        for r, p, s, e in zip(reqs, prefix_lens, seq_lens, extend_lens):
            if p > 0:
                table[r.req_pool_idx, :p] = r.prefix_indices.to(table.dtype)
            table[r.req_pool_idx, p:s] = out_cache_loc[pt:pt + e].to(table.dtype)
            pt += e
            r.kv_allocated_len = s
            if r.retraction_count == 0:  # a re-prefill after retraction is not a cache hit
                r.cached_tokens += max(p - r.already_computed, 0)
            r.already_computed = s

        self.input_ids = _i64(input_ids)
        self.relay_rows = None
        self.req_pool_indices = _i64([_row(r) for r in reqs])
        self.seq_lens_cpu = seq_lens
        self.seq_lens = _i64(seq_lens)
        self.out_cache_loc = out_cache_loc
        self.prefix_lens = prefix_lens
        self.extend_lens = extend_lens
        self.top_logprobs_nums = [r.top_logprobs_num for r in reqs]
        self.token_ids_logprobs = [r.token_ids_logprob for r in reqs]
        self._prepare_input_logprobs(prefix_lens, extend_lens)
        for r in reqs:
            r.is_retracted = False
        from engine.sampling.sampling_batch_info import SamplingBatchInfo

        self.sampling_info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device)

    def _prepare_input_logprobs(self, prefix_lens: List[int], extend_lens: List[int]) -> None:
        """Where input logprobs start in each extend, and the target id of every such position."""
        starts: List[int] = []
        targets: List[int] = []
        for r, p, e in zip(self.reqs, prefix_lens, extend_lens):
            if r.needs_input_logprobs():
                start = min(max(r.logprob_start_len - p, 0), e)
                for pos in range(p + start, p + e):
                    nxt = pos + 1
                    tok = r.origin_input_ids[nxt] if nxt < len(r.origin_input_ids) else 0
                    targets.append(min(max(tok, 0), self.vocab_size - 1))
            else:
                start = e
            starts.append(start)
        self.extend_logprob_start_lens = starts
        self.extend_input_logprob_token_ids = _i64(targets) if targets else None

    def prepare_for_prebuilt(self) -> None:
        """PD decode: the requests' KV arrived by transfer (or came back from a retraction backup).

        Fill in what a finished extend leaves behind, run nothing: the rows, the committed KV
        length of each request (its last output token has no KV yet: the next decode step
        computes it) and the sampling info. The batch then merges into the running batch.
        """
        reqs = self.reqs
        self.req_pool_indices = _i64([_row(r) for r in reqs])
        self.seq_lens_cpu = [r.kv_allocated_len for r in reqs]
        self.seq_lens = _i64(self.seq_lens_cpu)
        self.top_logprobs_nums = [r.top_logprobs_num for r in reqs]
        self.token_ids_logprobs = [r.token_ids_logprob for r in reqs]
        from engine.sampling.sampling_batch_info import SamplingBatchInfo

        self.sampling_info = SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.device)

    def mix_with_running(self, running_batch: "ScheduleBatch") -> None:
        """Append the (already decode-prepared) running requests as 1-token extends: MIXED."""
        self.forward_mode = ForwardMode.MIXED
        running_prefix = [s - 1 for s in running_batch.seq_lens_cpu]
        self.input_ids = torch.cat([_prepared(self.input_ids), _prepared(running_batch.input_ids)])
        self.relay_rows = running_batch.relay_rows
        self.out_cache_loc = torch.cat([_prepared(self.out_cache_loc), _prepared(running_batch.out_cache_loc)])
        self.prefix_lens = self.prefix_lens + running_prefix
        self.extend_lens = self.extend_lens + [1] * running_batch.batch_size()
        self.extend_num_tokens += running_batch.batch_size()
        self.extend_logprob_start_lens = self.extend_logprob_start_lens + [1] * running_batch.batch_size()
        self.decoding_reqs = list(running_batch.reqs)
        _prepared(self.sampling_info).merge_batch(_prepared(running_batch.sampling_info))
        self.reqs = self.reqs + running_batch.reqs
        self.req_pool_indices = torch.cat([_prepared(self.req_pool_indices), _prepared(running_batch.req_pool_indices)])
        self.seq_lens_cpu = self.seq_lens_cpu + running_batch.seq_lens_cpu
        self.seq_lens = _i64(self.seq_lens_cpu)
        self.top_logprobs_nums = self.top_logprobs_nums + [0] * running_batch.batch_size()
        self.token_ids_logprobs = self.token_ids_logprobs + [None] * running_batch.batch_size()

    # ------------------------------------------------------------------ decode
    def new_page_count_for_decode(self, indices: Optional[List[int]] = None) -> int:
        """Tokens the next decode step needs: one slot each (page 1), or a page for every
        request whose KV length sits on a page boundary."""
        lens = self.seq_lens_cpu if indices is None else [self.seq_lens_cpu[i] for i in indices]
        page = self.page_size
        if page == 1:
            return len(lens)
        return page * sum(1 for n in lens if n % page == 0)

    def check_decode_mem(self, indices: Optional[List[int]] = None) -> bool:
        need = self.new_page_count_for_decode(indices)
        self._evict_for(need)
        return self.token_to_kv_pool_allocator.available_size() >= need

    def prepare_for_decode(self) -> None:
        self.forward_mode = ForwardMode.DECODE
        bs = self.batch_size()
        allocator = self.token_to_kv_pool_allocator
        table = self.req_to_token_pool.req_to_token
        old_lens = self.seq_lens  # the tensor of seq_lens_cpu (every writer sets both)
        assert old_lens is not None  # a decode batch was prepared before
        rows = self.req_pool_indices
        allocator.release_out_of_window([_row(r) for r in self.reqs], self.seq_lens_cpu,
                                        [r.cache_protected_len for r in self.reqs], [False] * bs, table)
        self._evict_for(self.new_page_count_for_decode())
        if allocator.page_size == 1:
            out = allocator.alloc(bs)
        else:
            last_loc = table[rows, old_lens - 1].to(torch.int64)
            out = allocator.alloc_decode(old_lens + 1, last_loc)
        if out is None:
            raise RuntimeError(self._oom_message("Decode", bs))
        table[rows, old_lens] = out.to(table.dtype)
        for r in self.reqs:
            r.kv_allocated_len += 1
        # The ids sampled last step may still be in flight (overlap): read them from the relay.
        self.input_ids = torch.full((bs,), RELAY_PLACEHOLDER, dtype=torch.int64)
        self.relay_rows = self.req_pool_indices
        self.out_cache_loc = out
        # New objects, never in-place: a batch snapshot already handed to the worker keeps the old ones.
        self.seq_lens = old_lens + 1
        self.seq_lens_cpu = self.seq_lens.tolist()
        self.prefix_lens, self.extend_lens, self.extend_logprob_start_lens = [], [], []
        self.extend_num_tokens = 0
        self.extend_input_logprob_token_ids = None

    # ------------------------------------------------------------------ speculative verify
    def alloc_draft_slots(self, draft_lens: List[int]) -> Optional[torch.Tensor]:
        """After prepare_for_decode: slots for each request's drafts, at the positions after its
        decode slot (seq_len .. seq_len + k - 1), written to its row; None, with nothing allocated,
        when the pool cannot hold them even after eviction (the step then verifies no drafts).
        Drafts are opportunistic: retraction and admission budget the plain decode step only."""
        total = sum(draft_lens)
        if total == 0:
            return None
        allocator = self.token_to_kv_pool_allocator
        page = allocator.page_size
        lens = _prepared(self.seq_lens)
        new_lens = lens + _i64(draft_lens)
        if page == 1:
            need = total
        else:
            need = page * int(((new_lens + page - 1) // page - (lens + page - 1) // page).sum())
        self._evict_for(need)
        if allocator.available_size() < need:
            return None
        table = self.req_to_token_pool.req_to_token
        rows = _prepared(self.req_pool_indices)
        last_loc = table[rows, lens - 1].to(torch.int64)
        out = allocator.alloc_extend(lens, new_lens, last_loc, total)
        if out is None:
            return None
        offset = 0
        for r, n, k in zip(self.reqs, self.seq_lens_cpu, draft_lens):
            table[_row(r), n:n + k] = out[offset:offset + k].to(table.dtype)
            offset += k
            r.kv_allocated_len += k
        return out

    def verify_worker_batch(self, input_ids: List[int], draft_lens: List[int],
                            draft_slots: Optional[torch.Tensor]) -> ModelWorkerBatch:
        """The TARGET_VERIFY forward of a decode-prepared batch: each request extends its KV by its
        last token (the decode slot) and its drafts, every position's logits kept."""
        decode_slots = _prepared(self.out_cache_loc)
        parts: List[torch.Tensor] = []
        offset = 0
        for i, k in enumerate(draft_lens):
            parts.append(decode_slots[i:i + 1])
            if k:
                assert draft_slots is not None  # alloc_draft_slots gave slots for every draft
                parts.append(draft_slots[offset:offset + k])
                offset += k
        seq_lens = [n + k for n, k in zip(self.seq_lens_cpu, draft_lens)]
        extend_lens = [1 + k for k in draft_lens]
        return ModelWorkerBatch(
            forward_mode=ForwardMode.TARGET_VERIFY,
            input_ids=_i64(input_ids),
            req_pool_indices=_prepared(self.req_pool_indices),
            seq_lens=_i64(seq_lens),
            seq_lens_cpu=seq_lens,
            out_cache_loc=torch.cat(parts),
            sampling_info=_prepared(self.sampling_info).copy_for_forward(),
            extend_num_tokens=sum(extend_lens),
            extend_seq_lens=extend_lens,
            extend_prefix_lens=[n - 1 for n in self.seq_lens_cpu],
            extend_logprob_start_lens=list(extend_lens),
        )

    def keep_verified(self, kept_lens: List[int]) -> None:
        """After a verify step: each request keeps the KV of its first kept_lens[i] positions (the
        tokens it fed and accepted; its newest token has none yet, as after a decode step). The
        slots past them go back to the pool, whole pages only when paged (a request owns the rest
        of its last page, where its next decode slot goes), and its allocated length is exact."""
        allocator = self.token_to_kv_pool_allocator
        page = allocator.page_size
        table = self.req_to_token_pool.req_to_token
        freed: List[torch.Tensor] = []
        for r, kept in zip(self.reqs, kept_lens):
            end = r.kv_allocated_len
            start = -(-kept // page) * page  # the first position on a page of its own past `kept`
            if start < end:
                freed.append(table[_row(r), start:end].to(torch.int64))
            r.kv_allocated_len = kept
        if freed:
            allocator.free(torch.cat(freed))
        self.seq_lens_cpu = list(kept_lens)
        self.seq_lens = _i64(self.seq_lens_cpu)
        self.out_cache_loc = None

    def retract_decode(self, before_release: Optional[Callable[[Req], None]] = None
                       ) -> Tuple[List[Req], float, List[Req]]:
        """Free requests until the next decode step fits.

        Retract first the request with the fewest output tokens (ties: the longest prompt), always
        at least one, never the last one; if even the last one alone does not fit, abort it.
        `before_release(req)` runs for each retracted request before its KV is freed (a PD decode
        server backs the KV up: it cannot recompute a prompt it never prefilled).
        Returns (retracted, new_token_ratio, aborted).
        """
        order = sorted(range(self.batch_size()),
                       key=lambda i: (len(self.reqs[i].output_ids), -len(self.reqs[i].origin_input_ids)),
                       reverse=True)
        retracted: List[Req] = []
        aborted: List[Req] = []
        first = True
        while first or not self.check_decode_mem(order):
            if len(order) == 1:
                if not self.check_decode_mem(order):
                    req = self.reqs[order.pop()]
                    req.finished_reason = FINISH_ABORT(
                        "Out of memory even after retracting all other requests; "
                        "increase --max-total-tokens or shorten the request.", 500, "InternalServerError")
                    self.tree_cache.cache_finished_req(req, is_insert=False)
                    aborted.append(req)
                break
            first = False
            req = self.reqs[order.pop()]
            if before_release is not None:
                before_release(req)
            self._release_for_retract(req)
            # Use the freshly unlocked prefix memory at once if needed.
            self._evict_for(len(order) * RETRACT_DECODE_STEPS)
            retracted.append(req)
        self.filter_batch(keep_indices=sorted(order))
        survivors = self.reqs
        new_ratio = min(
            1.0,
            (sum(len(r.output_ids) for r in survivors) + RETRACT_DECODE_STEPS * len(survivors))
            / (sum(r.max_new_tokens for r in survivors) + 1),
        )
        return retracted, new_ratio, aborted

    def _release_for_retract(self, req: Req) -> None:
        """Free a running request's KV and row (its prefix is not inserted: SGLang's retraction);
        it keeps its output ids and is prefilled again later."""
        self.tree_cache.cache_finished_req(req, is_insert=False)
        req.reset_for_retract()

    def preempt(self, victims: List[Req], before_release: Optional[Callable[[Req], None]] = None) -> None:
        """Priority preemption: release `victims` (running requests) and drop them from the batch.
        `before_release` as in retract_decode."""
        chosen = {id(r) for r in victims}
        for req in victims:
            if before_release is not None:
                before_release(req)
            self._release_for_retract(req)
        self.filter_batch(keep_indices=[i for i, r in enumerate(self.reqs) if id(r) not in chosen])

    # ------------------------------------------------------------------ filter / merge
    def filter_batch(self, chunked_req_to_exclude: Optional[Req] = None,
                     keep_indices: Optional[List[int]] = None) -> None:
        if keep_indices is None:
            keep_indices = [i for i, r in enumerate(self.reqs)
                            if r.finished_reason is None and r is not chunked_req_to_exclude]
        if len(keep_indices) == len(self.reqs):
            return
        if not keep_indices:
            self.reqs = []
            self.seq_lens_cpu = []
            self.seq_lens = _i64([])
            _prepared(self.sampling_info).filter_batch([])
            return
        idx = _i64(keep_indices)
        self.reqs = [self.reqs[i] for i in keep_indices]
        self.req_pool_indices = _prepared(self.req_pool_indices)[idx]
        self.seq_lens_cpu = [self.seq_lens_cpu[i] for i in keep_indices]
        self.seq_lens = _i64(self.seq_lens_cpu)
        self.out_cache_loc = None
        self.top_logprobs_nums = [self.top_logprobs_nums[i] for i in keep_indices]
        self.token_ids_logprobs = [self.token_ids_logprobs[i] for i in keep_indices]
        self.return_logprob = any(r.return_logprob for r in self.reqs)
        self.return_hidden_states = any(r.return_hidden_states for r in self.reqs)
        _prepared(self.sampling_info).filter_batch(keep_indices)

    def merge_batch(self, other: "ScheduleBatch") -> None:
        _prepared(self.sampling_info).merge_batch(_prepared(other.sampling_info))
        self.req_pool_indices = torch.cat([_prepared(self.req_pool_indices), _prepared(other.req_pool_indices)])
        self.seq_lens_cpu = self.seq_lens_cpu + other.seq_lens_cpu
        self.seq_lens = _i64(self.seq_lens_cpu)
        self.out_cache_loc = None
        self.top_logprobs_nums = self.top_logprobs_nums + other.top_logprobs_nums
        self.token_ids_logprobs = self.token_ids_logprobs + other.token_ids_logprobs
        self.reqs = self.reqs + other.reqs
        self.return_logprob = self.return_logprob or other.return_logprob
        self.return_hidden_states = self.return_hidden_states or other.return_hidden_states

    # ------------------------------------------------------------------ worker snapshot
    def get_model_worker_batch(self) -> ModelWorkerBatch:
        forward_mode = _prepared(self.forward_mode)
        extend = forward_mode.is_extend()
        return ModelWorkerBatch(
            forward_mode=forward_mode,
            input_ids=_prepared(self.input_ids),
            req_pool_indices=_prepared(self.req_pool_indices),
            seq_lens=_prepared(self.seq_lens),
            seq_lens_cpu=list(self.seq_lens_cpu),
            out_cache_loc=_prepared(self.out_cache_loc),
            sampling_info=_prepared(self.sampling_info).copy_for_forward(),
            return_logprob=self.return_logprob,
            top_logprobs_nums=list(self.top_logprobs_nums) if self.return_logprob else None,
            token_ids_logprobs=list(self.token_ids_logprobs) if self.return_logprob else None,
            capture_hidden_states=self.return_hidden_states,
            extend_num_tokens=self.extend_num_tokens if extend else None,
            extend_seq_lens=list(self.extend_lens) if extend else None,
            extend_prefix_lens=list(self.prefix_lens) if extend else None,
            extend_logprob_start_lens=list(self.extend_logprob_start_lens) if extend else None,
            extend_input_logprob_token_ids=self.extend_input_logprob_token_ids if extend else None,
            relay_rows=self.relay_rows,
            # Embedding batches only (always extends): a decode step does not look at 1,000 requests for them.
            dimensions=[r.dimensions for r in self.reqs] if extend and any(r.dimensions for r in self.reqs) else None,
            lora_ids=[r.lora_id for r in self.reqs] if any(r.lora_id is not None for r in self.reqs) else None,
        )

    def copy(self) -> "ScheduleBatch":
        """What result processing needs, frozen at launch: the scheduler mutates the live batch
        (filter, merge, prepare_for_decode) while the forward of this one is in flight."""
        return ScheduleBatch(
            reqs=list(self.reqs),
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            tree_cache=self.tree_cache,
            vocab_size=self.vocab_size,
            device=self.device,
            forward_mode=self.forward_mode,
            seq_lens_cpu=list(self.seq_lens_cpu),
            prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens),
            extend_num_tokens=self.extend_num_tokens,
            extend_logprob_start_lens=list(self.extend_logprob_start_lens),
            return_logprob=self.return_logprob,
            top_logprobs_nums=list(self.top_logprobs_nums),
            token_ids_logprobs=list(self.token_ids_logprobs),
            return_hidden_states=self.return_hidden_states,
            decoding_reqs=list(self.decoding_reqs),
            log_input_tokens=self.log_input_tokens,
            log_hit_tokens=self.log_hit_tokens,
        )

    def __repr__(self) -> str:
        return f"ScheduleBatch(mode={self.forward_mode}, bs={self.batch_size()})"
