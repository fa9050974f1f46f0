"""EagleDrafter: an EAGLE head (models/llama_eagle.py) proposes the drafts from the target's own
features (SGLang's EAGLEWorker, chain drafting with topk 1).

The head at position i reads the token of position i + 1 and the target's feature (final hidden
state) at i, so it lags the target by one token. Its ModelRunner shares the target's slots as a
STANDALONE draft's does (draft_model.py), and this drafter keeps the target's feature of every slot
in `features` (written after every target forward that computes the slot: a copy of what the
forward returns). The head follows lazily, `valid` marking the slots where its K/V are exact (a
released slot is unmarked, whoever released it): for a request with committed K/V positions
0..n-1, the head's K/V must be exact at 0..n-2 when it drafts; position n-1 reads the request's
newest token, which has no K/V yet, and is written when that token is fed:
- a plain forward of the target (prefill chunk, mixed, plain decode: speculation off for the
  batch) only stores the features; the head's K/V of those positions are written by the request's
  next verify step before it drafts (`_catch_up`: one extend from the first unmarked position to
  n-2, reading the tokens one position on and the stored features);
- a verify step (last token at position m, k drafts): the head's first decode forward is at m - 1
  (the last token, the target's feature there), each next one at m, m + 1, ... feeding the previous
  draft with the head's own output as the feature; its K/V there are guesses until:
- after the acceptance of a drafts, the head's extend over m..m+a-1 (the accepted drafts, the
  target's features of the verify forward) makes them exact (SGLang's draft extend after decode);
  without drafts, position m - 1 is written then.
On a PD pair (disaggregation/kv_io.py) the prefill server keeps the features of the prompts it
computes and sends them with their K/V (its FeatureKeeper, features.py: no head loaded there; this
drafter is the transfer's FeatureStore on the decode side); the decode server stores them at the slots it received the prompt into, which are unmarked, so the
request's first verify step catches up over the whole prompt as after a local prefill.
A slot reached from the radix cache by another request keeps the head's K/V written for the request
that computed it: at the matched prefix's last position (p - 1) the head read that request's next
token, which may differ (lower acceptance at that position, never an inexact output: every token is
the target's; rewriting it would make two running requests that share the prefix undo each other).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional

import torch

from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
from engine.speculative.draft_model import _i64, _pick, _starts
from engine.speculative.features import TargetFeatures, captured_features
from engine.speculative.tree import DraftTree, TreeShape, fed_nodes_batch, grow_trees, newest_rows

if TYPE_CHECKING:
    from engine.layers.logits_processor import LogitsProcessorOutput
    from engine.model_executor.model_runner import ModelRunner
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.speculative.step import VerifyStep


class EagleDrafter(TargetFeatures):
    needs_target_hidden = True

    def __init__(self, runner: ModelRunner, feature_size: int, dtype: torch.dtype, feature_name: str = "EAGLE") -> None:
        """feature_size: the width of the target's feature (hidden; EAGLE3: 3 * hidden); feature_name:
        what the feature is (a PD pair's two servers must keep the same one)."""
        pool = runner.token_to_kv_pool
        # The target's feature at every slot (slot numbers are the target's; this draft shares them).
        super().__init__(pool.size + pool.page_size, feature_size, dtype, runner.device, feature_name)
        self.runner = runner
        # Per slot: whether the head's K/V there are exact (see the module doc).
        self.valid = torch.zeros(pool.size + pool.page_size, dtype=torch.bool, device=runner.device)
        self.req_to_token = runner.req_to_token_pool.req_to_token
        target_pool = runner.token_to_kv_pool_allocator.get_kvcache()
        assert target_pool is not None  # the target's allocator reports to its pool
        target_pool.release_listeners.append(self._released)

    # ------------------------------------------------------------------ scheduling thread
    def propose(self, batch: ScheduleBatch, budgets: List[int]) -> Optional[List[List[int]]]:
        return None  # drafted on the forward thread, `budgets[i]` drafts each

    # ------------------------------------------------------------------ forward thread
    def forward_plain(self, worker_batch: ModelWorkerBatch, run_target: Callable[[ModelWorkerBatch], Any]) -> Any:
        result = run_target(dataclasses.replace(worker_batch, capture_hidden_states=True))
        self.store_features(worker_batch.out_cache_loc, captured_features(result.logits_output))
        self._mark(worker_batch.out_cache_loc, False)  # the head's K/V there wait for its catch-up
        return result

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
        pool_rows = wb.req_pool_indices.tolist()
        greedy = (info.top_ks == 1).tolist()
        drafts: List[List[int]] = [[] for _ in lens]
        probs: List[List[torch.Tensor]] = [[] for _ in lens]
        guesses: List[Optional[torch.Tensor]] = [None] * len(lens)  # the head's last output per request
        for j in range(max(lens, default=0)):
            rows = [i for i, k in enumerate(lens) if k > j]
            m = [wb.extend_prefix_lens[i] for i in rows]  # the last token's position
            if j == 0:  # at m - 1: the last token with the target's feature there
                slots = torch.tensor([int(self.req_to_token[pool_rows[i], p - 1]) for i, p in zip(rows, m)])
                feats = self.features[slots.to(self.features.device)]
                ids = [fed[starts[i]] for i in rows]
            else:  # at m + j - 1: the previous draft with the head's own guess
                slots = wb.out_cache_loc[_i64([starts[i] + j - 1 for i in rows])]
                feats = torch.stack([g for g in (guesses[i] for i in rows) if g is not None])
                ids = [drafts[i][-1] for i in rows]
            batch = ModelWorkerBatch(
                forward_mode=ForwardMode.DECODE, input_ids=_i64(ids), req_pool_indices=wb.req_pool_indices[_i64(rows)],
                seq_lens=_i64([p + j for p in m]), seq_lens_cpu=[p + j for p in m], out_cache_loc=slots,
                capture_hidden_states=True)
            output = self._forward(batch, feats)
            assert output.hidden_states is not None  # captured
            tokens, row_probs = _pick(output.next_token_logits, info, rows, greedy)
            for r, i in enumerate(rows):
                drafts[i].append(tokens[r])
                guesses[i] = output.hidden_states[r]
                q = row_probs[r]
                if q is not None:
                    probs[i].append(q)
        step.drafts = drafts
        step.draft_probs = [torch.stack(p) if p else None for p in probs]

    def after_verify(self, step: VerifyStep) -> None:
        wb = step.worker_batch
        outcome = step.outcome
        assert outcome is not None and wb.extend_prefix_lens is not None and step.target_hidden is not None
        self.store_features(wb.out_cache_loc, step.target_hidden)
        fed = wb.input_ids.tolist()
        firsts: List[int] = []
        tokens: List[List[int]] = []
        for m, k, a, s in zip(wb.extend_prefix_lens, step.draft_lens, outcome.accepted, _starts(step.draft_lens)):
            # Without drafts the head has not read the last token yet (its first draft forward does).
            first = m if k > 0 else m - 1
            firsts.append(first)
            tokens.append(fed[s + first + 1 - m: s + a + 1])
        self._extend(wb.req_pool_indices.tolist(), firsts, tokens)
        self._mark_first_draft_forward(step)

    # ------------------------------------------------------------------ lazy following
    def _catch_up(self, step: VerifyStep) -> None:
        """Before drafting: the head's extend over each drafting request's positions from its first
        unmarked one to m - 2 (m: the last token's position), reading the tokens one position on."""
        wb = step.worker_batch
        assert wb.extend_prefix_lens is not None  # a verify batch
        pool_rows = wb.req_pool_indices.tolist()
        rows: List[int] = []
        firsts: List[int] = []
        tokens: List[List[int]] = []
        for i, (row, m, k) in enumerate(zip(pool_rows, wb.extend_prefix_lens, step.draft_lens)):
            if k == 0 or m < 2:
                continue
            stale = (~self.valid[self.req_to_token[row, :m - 1].to(torch.int64).to(self.valid.device)]).nonzero()
            if stale.numel():
                first = int(stale[0, 0])
                prompt, output = step.tokens[i]
                rows.append(row)
                firsts.append(first)
                tokens.append((prompt + output)[first + 1:m])
        if rows:
            self._extend(rows, firsts, tokens)

    def _mark_first_draft_forward(self, step: VerifyStep) -> None:
        """The first draft forward of a request with drafts wrote the head's exact K/V at m - 1 (the
        last token, the target's feature there)."""
        wb = step.worker_batch
        assert wb.extend_prefix_lens is not None  # a verify batch
        rows = [i for i, k in enumerate(step.draft_lens) if k > 0]
        if rows:
            pool_rows = wb.req_pool_indices.tolist()
            self._mark(torch.stack([self.req_to_token[pool_rows[i], wb.extend_prefix_lens[i] - 1] for i in rows]),
                       True)

    def _mark(self, slots: torch.Tensor, valid: bool) -> None:
        self.valid[slots.to(torch.int64).to(self.valid.device)] = valid

    def _released(self, slots: Optional[torch.Tensor]) -> None:
        """The target pool's release listener: the head's K/V of released slots are void."""
        if slots is None:
            self.valid.zero_()
        else:
            self._mark(slots, False)

    # ------------------------------------------------------------------ tree steps
    def draft_tree(self, step: VerifyStep, shape: TreeShape) -> List[Optional[DraftTree]]:
        """The root forward is the chain's first (at m - 1: the last token, the target's feature
        there); a leaf is fed with its parent's output as the feature (the root's, or the previous
        leaves'), at position m - 1 + depth, in the scratch slots at positions m .. (speculative/tree.py)."""
        wb = step.worker_batch
        prefix = wb.extend_prefix_lens
        assert prefix is not None  # a verify batch
        lens = step.draft_lens
        starts = _starts(lens)
        fed = wb.input_ids.tolist()
        pool_rows = wb.req_pool_indices.tolist()
        # Per drafting request: the head's output at its root, and at the leaves of the latest fed
        # forward (fed nodes fed_offset .. fed_offset + topk - 1), the parents of the next leaves.
        root_hidden: List[torch.Tensor] = []
        fed_hidden: List[torch.Tensor] = []
        fed_offset = [0]

        def root(rows: List[int]) -> torch.Tensor:
            slots = torch.tensor([int(self.req_to_token[pool_rows[i], prefix[i] - 1]) for i in rows])
            batch = ModelWorkerBatch(
                forward_mode=ForwardMode.DECODE, input_ids=_i64([fed[starts[i]] for i in rows]),
                req_pool_indices=wb.req_pool_indices[_i64(rows)], seq_lens=_i64([prefix[i] for i in rows]),
                seq_lens_cpu=[prefix[i] for i in rows], out_cache_loc=slots, capture_hidden_states=True)
            output = self._forward(batch, self.features[slots.to(self.features.device)])
            assert output.hidden_states is not None  # captured
            root_hidden.extend(output.hidden_states)
            return output.next_token_logits

        def fed_nodes(rows: List[int], tokens: List[List[int]], parents: List[List[int]],
                      depths: List[List[int]]) -> torch.Tensor:
            topk = shape.topk
            feats = torch.stack([root_hidden[r] if p < 0 else fed_hidden[r][p - fed_offset[0]]
                                 for r, ps in enumerate(parents) for p in ps[-topk:]])
            batch = dataclasses.replace(
                fed_nodes_batch([pool_rows[i] for i in rows], self.req_to_token, [prefix[i] - 1 for i in rows],
                                tokens, parents, depths, topk), capture_hidden_states=True)
            output = self._forward(batch, feats)
            assert output.hidden_states is not None  # captured
            fed_hidden[:] = list(output.hidden_states.view(len(rows), topk, output.hidden_states.shape[-1]))
            fed_offset[0] = len(tokens[0]) - topk
            return newest_rows(output.next_token_logits, len(rows), topk)

        drafting = [i for i, k in enumerate(lens) if k > 0]
        trees: List[Optional[DraftTree]] = [None] * len(lens)
        for i, tree in zip(drafting, grow_trees(shape, drafting, root, fed_nodes)):
            trees[i] = tree
        return trees

    def after_verify_tree(self, step: VerifyStep) -> None:
        """As after a chain step, over the accepted path (moved to chain order): the target's
        features of the root and the path's nodes at their new slots, then the head's extend over
        the accepted drafts (without drafts: its first read of the last token, at m - 1)."""
        wb = step.worker_batch
        paths = step.paths
        assert paths is not None and wb.extend_prefix_lens is not None and step.target_hidden is not None
        fed = wb.input_ids.tolist()
        rows: List[int] = []
        dst: List[int] = []
        firsts: List[int] = []
        tokens: List[List[int]] = []
        for m, k, path, s in zip(wb.extend_prefix_lens, step.draft_lens, paths, _starts(step.draft_lens)):
            rows.extend([s] + [s + node for node in path])
            dst.extend(range(s, s + 1 + len(path)))
            firsts.append(m if k > 0 else m - 1)
            tokens.append([fed[s + node] for node in path] if k > 0 else [fed[s]])
        self.store_features(wb.out_cache_loc[_i64(dst)], step.target_hidden[_i64(rows).to(step.target_hidden.device)])
        self._extend(wb.req_pool_indices.tolist(), firsts, tokens)

    # PD transfer (kv_io.FeatureStore): TargetFeatures's. Received features mark nothing: their slots were
    # released (unmarked) before they were reserved, and only their request touches them.

    # ------------------------------------------------------------------ helpers
    def _extend(self, pool_rows: List[int], firsts: List[int], tokens: List[List[int]]) -> None:
        """The head's extend of each request over positions firsts[i] .. firsts[i] + len(tokens[i]) - 1,
        reading tokens[i] and the target's features at those positions."""
        keep = [i for i, t in enumerate(tokens) if t]
        if not keep:
            return
        slots = torch.cat([self.req_to_token[pool_rows[i], firsts[i]:firsts[i] + len(tokens[i])] for i in keep])
        slots = slots.to(torch.int64)
        lens = [len(tokens[i]) for i in keep]
        seq_lens = [firsts[i] + len(tokens[i]) for i in keep]
        batch = ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND, input_ids=_i64([t for i in keep for t in tokens[i]]),
            req_pool_indices=_i64([pool_rows[i] for i in keep]), seq_lens=_i64(seq_lens), seq_lens_cpu=seq_lens,
            out_cache_loc=slots.cpu(), extend_num_tokens=sum(lens), extend_seq_lens=lens,
            extend_prefix_lens=[firsts[i] for i in keep])
        self._forward(batch, self.features[slots.to(self.features.device)])
        self._mark(slots, True)

    def _forward(self, batch: ModelWorkerBatch, features: torch.Tensor) -> LogitsProcessorOutput:
        forward_batch = ForwardBatch.init_new(batch, self.runner)
        forward_batch.spec_hidden_states = features
        return self.runner.forward(forward_batch)
