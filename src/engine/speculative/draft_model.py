"""DraftModelDrafter: a smaller model beside the target proposes the drafts (SGLang's STANDALONE
speculative worker; chain drafting, topk 1).

The draft's KV lives in a pool of its own with the target's slot numbering: its ModelRunner is
built with `draft_of=` the target's (model_runner.py), so it shares the request-to-token rows and
the slot allocator and has a KV pool of the same size. A slot therefore holds the target's K/V in
the target's pool and the draft's K/V of the same token in the draft's pool, and whoever frees a
slot (finish, abort, retraction, rejected drafts, eviction from the radix cache) frees both: the
draft owns no slot and nothing of it can leak. `valid` marks the slots whose draft K/V belong to the
token whose target K/V the slot holds; a slot released to the allocator is unmarked then, whoever
freed it (the target pool's release listeners), so a slot handed out again starts stale. The draft
follows the target lazily:
- a plain forward of the target (prefill, mixed chunk, plain decode step: speculation is off for
  the batch) costs the draft nothing (`forward_plain` only unmarks the slots it writes); the next
  verify step of each request first writes the draft's K/V from its first stale position to its
  last committed one (one extend over the tokens, `_catch_up`), which covers prompts, prefixes
  another request decoded plainly, and prompts whose K/V arrived by transfer (PD decode);
- a verify step drafts with `num_steps` decode forwards of the draft (`draft`): the first feeds the
  last token (its decode slot), each next one the previous draft (the slots alloc_draft_slots gave),
  so the draft writes K/V for the last token and every draft but the last;
- after the acceptance (`after_verify`) the requests that accepted all their drafts feed the last
  draft once more, so its K/V, now committed, is the draft's too (SGLang's draft extend over the
  accepted tokens); the K/V of rejected drafts is freed with their slots by keep_verified.

Greedy requests draft the draft's argmax; sampled ones draw from the draft's distribution under the
request's own sampling parameters, and its probabilities go to the acceptance (verify.py), which
accepts with min(1, p/q) and resamples from max(p - q, 0).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch

from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
from engine.speculative.tree import DraftTree, TreeShape, fed_nodes_batch, grow_trees, newest_rows
from engine.speculative.verify import target_probs

if TYPE_CHECKING:
    from engine.model_executor.model_runner import ModelRunner
    from engine.sampling.sampling_batch_info import SamplingBatchInfo
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.speculative.step import VerifyStep


def _i64(values: List[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class DraftModelDrafter:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        pool = runner.token_to_kv_pool
        # Per slot: whether the draft's K/V there belong to the token whose target K/V the slot holds.
        self.valid = torch.zeros(pool.size + pool.page_size, dtype=torch.bool, device=runner.device)
        # Pages of one slot are whole slots: a plain forward writes freshly allocated slots only,
        # which their release already unmarked (forward_plain has nothing to do).
        self.slots_start_unmarked = pool.page_size == 1
        self.req_to_token = runner.req_to_token_pool.req_to_token
        target_pool = runner.token_to_kv_pool_allocator.get_kvcache()
        assert target_pool is not None  # the target's allocator reports to its pool
        target_pool.release_listeners.append(self._released)

    # ------------------------------------------------------------------ scheduling thread
    def propose(self, batch: ScheduleBatch, budgets: List[int]) -> Optional[List[List[int]]]:
        return None  # drafted on the forward thread, `budgets[i]` drafts each

    # ------------------------------------------------------------------ forward thread
    def draft(self, step: VerifyStep) -> None:
        wb = step.worker_batch
        info = wb.sampling_info
        assert info is not None and wb.extend_prefix_lens is not None  # a verify batch has both
        lens = step.draft_lens
        started = time.perf_counter()
        self._catch_up(step)
        step.catch_up_seconds = time.perf_counter() - started
        fed = wb.input_ids.tolist()
        starts = _starts(lens)
        greedy = (info.top_ks == 1).tolist()
        current = [fed[s] for s in starts]  # each request's input of the next draft forward
        drafts: List[List[int]] = [[] for _ in lens]
        probs: List[List[torch.Tensor]] = [[] for _ in lens]
        for j in range(max(lens, default=0)):
            rows = [i for i, k in enumerate(lens) if k > j]
            # Draft j + 1 of request i: input at position prefix + j, into the slot of that position.
            logits = self._decode(wb, rows, [current[i] for i in rows], [starts[i] + j for i in rows],
                                  [wb.extend_prefix_lens[i] + j + 1 for i in rows])
            tokens, row_probs = _pick(logits, info, rows, greedy)
            # The slot of position prefix + j now holds the draft's K/V of its input, which is the
            # committed token there if the drafts before it are accepted (keep_verified frees the rest).
            self._mark(wb.out_cache_loc[_i64([starts[i] + j for i in rows])], True)
            for r, i in enumerate(rows):
                drafts[i].append(tokens[r])
                current[i] = tokens[r]
                q = row_probs[r]
                if q is not None:
                    probs[i].append(q)
        step.drafts = drafts
        step.draft_probs = [torch.stack(p) if p else None for p in probs]

    def after_verify(self, step: VerifyStep) -> None:
        outcome = step.outcome
        wb = step.worker_batch
        assert outcome is not None and wb.extend_prefix_lens is not None  # run() accepted; a verify batch
        lens = step.draft_lens
        starts = _starts(lens)
        rows = [i for i, k in enumerate(lens) if k > 0 and outcome.accepted[i] == k]
        # The target alone wrote each request's last verified position (its last draft, or its last
        # token without drafts): stale for the draft unless written below.
        self._mark(wb.out_cache_loc[_i64([starts[i] + k for i, k in enumerate(lens)])], False)
        if not rows:
            return
        # The last draft was accepted: its K/V (position prefix + k) is committed for the target.
        self._decode(wb, rows, [step.drafts[i][-1] for i in rows], [starts[i] + lens[i] for i in rows],
                     [wb.extend_prefix_lens[i] + lens[i] + 1 for i in rows])
        self._mark(wb.out_cache_loc[_i64([starts[i] + lens[i] for i in rows])], True)

    needs_target_hidden = False

    # ------------------------------------------------------------------ tree steps
    def draft_tree(self, step: VerifyStep, shape: TreeShape) -> List[Optional[DraftTree]]:
        """The root (the last token, position m) is a decode into its slot, as a chain's first draft;
        the fed nodes go to the scratch slots at positions m + 1 .. (speculative/tree.py)."""
        wb = step.worker_batch
        prefix = wb.extend_prefix_lens
        assert prefix is not None  # a verify batch
        self._catch_up(step)
        lens = step.draft_lens
        starts = _starts(lens)
        fed = wb.input_ids.tolist()
        pool_rows = wb.req_pool_indices.tolist()

        def root(rows: List[int]) -> torch.Tensor:
            logits = self._decode(wb, rows, [fed[starts[i]] for i in rows], [starts[i] for i in rows],
                                  [prefix[i] + 1 for i in rows])
            self._mark(wb.out_cache_loc[_i64([starts[i] for i in rows])], True)
            return logits

        def fed_nodes(rows: List[int], tokens: List[List[int]], parents: List[List[int]],
                      depths: List[List[int]]) -> torch.Tensor:
            batch = fed_nodes_batch([pool_rows[i] for i in rows], self.req_to_token, [prefix[i] for i in rows],
                                    tokens, parents, depths, shape.topk)
            return newest_rows(self._forward(batch), len(rows), shape.topk)

        drafting = [i for i, k in enumerate(lens) if k > 0]
        trees: List[Optional[DraftTree]] = [None] * len(lens)
        for i, tree in zip(drafting, grow_trees(shape, drafting, root, fed_nodes)):
            trees[i] = tree
        return trees

    def after_verify_tree(self, step: VerifyStep) -> None:
        """The accepted path now lies at positions m + 1 .. of the target; the draft's K/V there are
        the scratch of the fed nodes: stale, so the request's next verify step writes them first
        (_catch_up). A request without drafts had its last token written by the target alone."""
        wb = step.worker_batch
        assert wb.extend_prefix_lens is not None and step.tree_shape is not None  # a tree verify batch
        stale: List[torch.Tensor] = []
        rows = wb.req_pool_indices.tolist()
        for i, (k, start, m) in enumerate(zip(step.draft_lens, _starts(step.draft_lens), wb.extend_prefix_lens)):
            if k == 0:
                stale.append(wb.out_cache_loc[start:start + 1])
            else:
                stale.append(self.req_to_token[rows[i], m + 1:m + 1 + step.tree_shape.slots].to(torch.int64))
        self._mark(torch.cat(stale), False)

    def forward_plain(self, worker_batch: ModelWorkerBatch, run_target: Callable[[ModelWorkerBatch], Any]) -> Any:
        # Caught up by each request's next verify step, if it has one. A slot can hold a rejected
        # draft's mark when its page was kept (page size > 1): unmarked here. With page size 1 the
        # index write is skipped: it was the one cost a plain step of a speculating server added
        # on the forward thread.
        if not self.slots_start_unmarked:
            self._mark(worker_batch.out_cache_loc, False)
        return run_target(worker_batch)

    # ------------------------------------------------------------------ helpers
    def _mark(self, slots: torch.Tensor, valid: bool) -> None:
        self.valid[slots.to(self.valid.device)] = valid

    def _released(self, slots: Optional[torch.Tensor]) -> None:
        """The target pool's release listener: released slots hold nothing of the draft's."""
        if slots is None:
            self.valid.zero_()
        else:
            self._mark(slots, False)

    def _catch_up(self, step: VerifyStep) -> None:
        """One draft extend over each drafting request's committed positions from its first stale
        one (the plain steps the draft skipped, a prefix another request decoded so)."""
        wb = step.worker_batch
        assert wb.extend_prefix_lens is not None  # a verify batch
        rows = wb.req_pool_indices.tolist()
        firsts: List[int] = []
        keep: List[int] = []
        for i, (row, committed, k) in enumerate(zip(rows, wb.extend_prefix_lens, step.draft_lens)):
            if k == 0 or committed == 0:
                continue
            stale = (~self.valid[self.req_to_token[row, :committed].to(torch.int64)]).nonzero()
            if stale.numel():
                keep.append(i)
                firsts.append(int(stale[0, 0]))
        if not keep:
            return
        ids: List[int] = []
        for i, first in zip(keep, firsts):
            prompt, output = step.tokens[i]
            ids.extend((prompt + output)[first:wb.extend_prefix_lens[i]])
        lens = [wb.extend_prefix_lens[i] - first for i, first in zip(keep, firsts)]
        seq_lens = [wb.extend_prefix_lens[i] for i in keep]
        slots = torch.cat([self.req_to_token[rows[i], first:wb.extend_prefix_lens[i]]
                           for i, first in zip(keep, firsts)]).to(torch.int64)
        self._forward(ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=_i64(ids), req_pool_indices=_i64([rows[i] for i in keep]),
            seq_lens=_i64(seq_lens), seq_lens_cpu=seq_lens, out_cache_loc=slots.cpu(), extend_num_tokens=len(ids),
            extend_seq_lens=lens, extend_prefix_lens=firsts))
        self._mark(slots, True)

    def _decode(self, wb: ModelWorkerBatch, rows: List[int], input_ids: List[int], slot_index: List[int],
                seq_lens: List[int]) -> torch.Tensor:
        """One draft decode forward of `rows` of the verify batch: token input_ids[r] at position
        seq_lens[r] - 1 into the slot wb.out_cache_loc[slot_index[r]]. The draft's logits, [rows, vocab]."""
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.DECODE,
            input_ids=_i64(input_ids),
            req_pool_indices=wb.req_pool_indices[_i64(rows)],
            seq_lens=_i64(seq_lens),
            seq_lens_cpu=seq_lens,
            out_cache_loc=wb.out_cache_loc[_i64(slot_index)],
        )
        return self._forward(batch)

    def _forward(self, batch: ModelWorkerBatch) -> torch.Tensor:
        forward_batch = ForwardBatch.init_new(batch, self.runner)
        return self.runner.forward(forward_batch).next_token_logits


def _starts(lens: List[int]) -> List[int]:
    """Each request's first row in the verify batch (its last token, then its drafts)."""
    starts: List[int] = []
    pos = 0
    for k in lens:
        starts.append(pos)
        pos += 1 + k
    return starts


def _pick(logits: torch.Tensor, info: SamplingBatchInfo, rows: List[int], greedy: List[bool]
          ) -> Tuple[List[int], List[Optional[torch.Tensor]]]:
    """The draft token of each row: the argmax (greedy requests) or a draw from the draft's
    distribution under the request's sampling parameters, returned with the token."""
    logits = logits[:, : info.vocab_size].float()
    tokens = logits.argmax(dim=-1).tolist()
    probs: List[Optional[torch.Tensor]] = [None] * len(rows)
    sampled = [r for r, i in enumerate(rows) if not greedy[i]]
    if sampled:
        device = logits.device
        q = target_probs(logits[_i64(sampled).to(device)], info, _i64([rows[r] for r in sampled]).to(device),
                         torch.arange(len(sampled), device=device))
        drawn = torch.multinomial(q, 1).squeeze(1).tolist()
        for n, r in enumerate(sampled):
            tokens[r] = int(drawn[n])
            probs[r] = q[n]
    return tokens, probs
