"""Speculator: a decode step run as a verify step (SGLang's NGRAMWorker, and the verify half of its
StandaloneWorker / EAGLEWorker), whatever proposes the drafts (a `Drafter`).

The scheduler prepares the running batch's decode step as always (RunningSet.update: finished
requests dropped, retraction when the plain step does not fit, one KV slot per request). When the
batch is eligible, this collaborator then:
1. budgets each request's drafts: the drafter's maximum, never past its max_new_tokens or its row
   of the request-to-token table; the drafter proposes them now (NGRAM: from the request's own
   tokens) or on the forward thread (a draft model);
2. gives the drafts KV slots after the decode slot (ScheduleBatch.alloc_draft_slots; when the
   pool cannot hold them, the step verifies no drafts, which is a plain decode step);
3. on the forward thread: the drafter drafts if it has not yet, then the target runs once on
   (last token + drafts) per request, an extend-style TARGET_VERIFY forward whose positions
   continue the request's and whose logits are kept at every position; acceptance (verify.py),
   then the drafter brings its own state to the accepted tokens;
4. appends the accepted drafts and the bonus token one at a time with the usual finish checks (a
   stop token, stop string or max_new_tokens cuts the rest), then keeps the KV of the fed and
   accepted positions only (ScheduleBatch.keep_verified frees the rest), and releases a finished
   request's KV through the cache as a decode step does, so the radix cache only ever holds
   accepted tokens.

Eligible: every request samples as the verify step can reproduce exactly (sampling.py: penalties,
min_new_tokens, logit_bias, grammars and logprobs per verified position; not a seed, a custom logit
processor, hidden states or a grammar that cannot roll back), and the batch is not larger than
--speculative-batch-size-threshold; otherwise the batch takes the plain decode step, which is exact
anyway. Among eligible steps, the speculation
switch (switch.py) decodes plainly where the measured accept length does not pay for a verify step's
cost; a draft model runs no forward on plain steps (the drafter's `forward_plain`) and catches up on
the tokens it skipped at the request's next verify step. It runs in the normal (non-overlap) loop
only: drafting needs the previous step's tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from engine.scheduler.output import LogprobLists
from engine.scheduler.overlap_utils import write_relay
from engine.speculative.sampling import VerifySampling, chain_paths, chain_trees
from engine.speculative.sampling import supports as sampling_supports
from engine.speculative.step import Drafter, TreeDrafter, VerifyStep
from engine.speculative.switch import SpeculationSwitch
from engine.speculative.tree import DraftTree, TreeShape, accept_tree, path_moves, verify_layout
from engine.speculative.verify import VerifyOutcome, accept_drafts

if TYPE_CHECKING:
    from engine.disaggregation.kv_io import FeatureStore
    from engine.mem_cache.base_prefix_cache import BasePrefixCache
    from engine.mem_cache.memory_pool import MHATokenToKVPool
    from engine.configs.model_config import ModelConfig
    from engine.speculative.draft_model import DraftModelDrafter
    from engine.speculative.eagle import EagleDrafter
    from engine.speculative.features import FeatureKeeper
    from engine.model_executor.model_runner import ModelRunner
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.model_executor.forward_batch_info import ModelWorkerBatch
    from engine.scheduler.req import Req
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.scheduler.worker_protocol import ModelWorker
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)


@dataclass
class SpecStats:
    """Totals over every request's verify steps (the server's mean accept length)."""

    verify_steps: int = 0  # one per request per verify step
    accepted_drafts: int = 0
    proposed_drafts: int = 0
    emitted_tokens: int = 0
    draft_seconds: float = 0.0  # forward-thread drafting time of the verify steps

    def mean_accept_length(self) -> float:
        """Tokens per request per verify step (1.0: no draft ever accepted)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0


@dataclass
class TreeVerify:
    """What tree steps need beyond a chain's: the tree's shape, the drafter that grows trees, and the
    target's K/V pool, in which the accepted path is moved to chain order."""

    shape: TreeShape
    drafter: TreeDrafter
    target_pool: MHATokenToKVPool


class Speculator:
    def __init__(self, server_args: ServerArgs, worker: ModelWorker, tree_cache: BasePrefixCache,
                 drafter: Drafter, memory: Optional[Dict[str, int]] = None) -> None:
        """memory: the bytes of the target's and the draft's pools (/get_server_info)."""
        assert server_args.speculative_num_draft_tokens is not None  # ServerArgs sets the default
        self.max_drafts = server_args.speculative_num_draft_tokens - 1
        self.batch_size_threshold = server_args.speculative_batch_size_threshold
        self.worker = worker
        self.tree_cache = tree_cache
        self.drafter = drafter
        self.stats = SpecStats()
        self.tree: Optional[TreeVerify] = None  # set by build_speculator with --speculative-eagle-topk > 1
        self.memory = memory or {}
        self.switch = SpeculationSwitch(not server_args.disable_speculative_adaptive, _tp_agreement(server_args))
        # Where the wall time of the next decode step processed starts (see batch_processed).
        self._step_start: Optional[float] = None

    # ------------------------------------------------------------------ scheduling thread
    @staticmethod
    def eligible(req: Req) -> bool:
        """Whether the verify step reproduces this request's sampling exactly (see the module doc)."""
        return sampling_supports(req)

    def _speculates(self, reqs: Sequence[Req]) -> bool:
        """Whether the switch decides this decode batch (otherwise it decodes plainly, exactly)."""
        if self.batch_size_threshold is not None and len(reqs) > self.batch_size_threshold:
            return False  # large batches are compute-bound: drafts cost more than they save
        return all(self.eligible(r) for r in reqs)

    def wants_verify(self, running: Sequence[Req], last_batch: Optional[ScheduleBatch],
                     chunked: Optional[Req]) -> bool:
        """Whether the next decode step would verify (nothing changes), guessed before it is built:
        the running requests not known to have finished, and those of the last prefill, which join
        them. The overlap loop then settles the forward in flight first. A wrong guess costs speed,
        never exactness: `prepare` verifies only with nothing in flight."""
        reqs = {id(r): r for r in running if not r.finished()}
        if last_batch is not None and last_batch.forward_mode is not None and last_batch.forward_mode.is_extend():
            reqs.update((id(r), r) for r in last_batch.reqs if r is not chunked and not r.finished())
        batch = list(reqs.values())
        return bool(batch) and self._speculates(batch) and self.switch.would_verify(len(batch))

    def prepare(self, batch: ScheduleBatch, in_flight: bool = False) -> Optional[VerifyStep]:
        """The verify step of a decode-prepared batch, or None when the batch decodes plainly.
        in_flight: an earlier forward's result is not processed yet (overlap loop), so this step
        cannot draft from its tokens and decodes plainly."""
        if not in_flight:
            self._step_start = time.perf_counter()  # nothing before it is left to wait for
        if not self._speculates(batch.reqs):
            return None
        if in_flight and self.switch.would_verify(batch.batch_size()):
            # The loop's guess of this batch missed (Scheduler._begin_step): the switch's turn is left
            # for the next step, which settles first.
            return None
        if not self.switch.should_verify(batch.batch_size()):
            return None
        if self.tree is not None:
            return self._prepare_tree(batch, self.tree.shape)
        row_width = batch.req_to_token_pool.req_to_token.shape[1]
        # Never more than the request may still emit (the bonus token included) or its row holds.
        budgets = [max(0, min(self.max_drafts, req.max_new_tokens - len(req.output_ids) - 1, row_width - seq_len))
                   for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu)]
        proposed = self.drafter.propose(batch, budgets)
        draft_lens = [len(d) for d in proposed] if proposed is not None else budgets
        slots = batch.alloc_draft_slots(draft_lens)
        if slots is None and any(draft_lens):
            draft_lens = [0] * len(draft_lens)  # the pool is short: a plain step, through the same path
            proposed = None
        drafts = proposed if proposed is not None else [[] for _ in batch.reqs]
        input_ids: List[int] = []
        for req, d, k in zip(batch.reqs, drafts, draft_lens):
            input_ids.append(req.output_ids[-1])
            # Drafts of the forward thread are written there (Speculator.run); 0 holds their place.
            input_ids.extend(d if proposed is not None else [0] * k)
        worker_batch = batch.verify_worker_batch(input_ids, draft_lens, slots)
        if self.drafter.needs_target_hidden:
            worker_batch = dataclasses.replace(worker_batch, capture_hidden_states=True)
        return VerifyStep(worker_batch=worker_batch, drafts=drafts,
                          draft_lens=draft_lens, draft_on_forward_thread=proposed is None and any(draft_lens),
                          tokens=[(req.origin_input_ids, req.output_ids) for req in batch.reqs],
                          sampling=VerifySampling.of(batch.reqs))

    def process(self, batch: ScheduleBatch, step: VerifyStep) -> List[Req]:
        """Append each request's verified tokens (finish checks per token), keep the KV of what was
        accepted, release finished requests. Returns the requests to stream."""
        outcome = step.outcome
        assert outcome is not None  # run() filled it on the forward thread
        allocator = batch.token_to_kv_pool_allocator
        emit: List[Req] = []
        kept_lens: List[int] = []
        finished: List[Req] = []
        self.stats.draft_seconds += step.draft_seconds
        logprobs = LogprobLists(step.logprobs, batch) if step.logprobs is not None else None
        for i, (req, seq_len, drafts, tokens, accepted) in enumerate(zip(batch.reqs, batch.seq_lens_cpu, step.drafts,
                                                                         outcome.tokens, outcome.accepted)):
            appended = 0
            for token in tokens:
                req.output_ids.append(token)
                if logprobs is not None and step.logprob_rows[i] >= 0:
                    logprobs.collect_output(req, step.logprob_rows[i] + appended, token)
                appended += 1
                # As a plain decode step: the matcher takes the token, then the finish checks.
                req.accept_grammar_token(token)
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

    def batch_processed(self, batch: ScheduleBatch, step: Optional[VerifyStep]) -> None:
        """A generation batch's result was processed (`step`: it ran as a verify step). The switch
        learns from the decode steps it decides: their wall time from the previous result processed
        (or from their launch, when nothing was in flight then) to their own, which in the overlap
        loop is a plain step's share of the pipelined time and a verify step's whole synchronous
        cost (without a draft model's catch-up: a one-off per skipped token, not a cost of the step).
        After an idle spell the first batch is launched with nothing in flight, so idle time never
        counts: a decode step starts its own clock (prepare), a prefill's processing restarts it."""
        now = time.perf_counter()
        start, self._step_start = self._step_start, now
        if start is None or batch.forward_mode is None or not batch.forward_mode.is_decode():
            return
        if step is None:
            if self._speculates(batch.reqs):
                self.switch.record(batch.batch_size(), False, now - start, 0.0)
        elif any(step.draft_lens):  # a step without drafts (the pool was short) measures nothing
            self.switch.record(batch.batch_size(), True, max(0.0, now - start - step.catch_up_seconds),
                               self.emitted_tokens(step) / max(1, len(batch.reqs)))

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
                "spec_draft_tokens": self.stats.proposed_drafts, **self.switch.state(), **self.memory}

    # ------------------------------------------------------------------ forward thread
    def run(self, step: VerifyStep) -> VerifyStep:
        """Drafting (when the drafter does it here), the verify forward and the acceptance; the
        relay gets each row's newest token, so a plain decode step after this one reads the right
        input."""
        if step.tree_shape is not None:
            return self._run_tree(step)
        started = time.perf_counter()
        if step.draft_on_forward_thread:
            self.drafter.draft(step)
            fed = step.worker_batch.input_ids.tolist()
            ids: List[int] = []
            start = 0
            for d, k in zip(step.drafts, step.draft_lens):
                ids.append(fed[start])  # the last token, then the drafts in the places kept for them
                ids.extend(d)
                start += 1 + k
            step.worker_batch = dataclasses.replace(step.worker_batch, input_ids=torch.tensor(ids, dtype=torch.int64))
        drafted = time.perf_counter()
        wb = step.worker_batch
        output = self.worker.forward_batch_verify(wb)
        # An EAGLE3 target's features are its auxiliary hidden states, an EAGLE target's its final ones.
        step.target_hidden = output.aux_hidden_states if output.aux_hidden_states is not None else output.hidden_states
        assert wb.sampling_info is not None  # a generation batch always has one
        trees = chain_trees(step.drafts)
        if step.sampling is not None:  # penalties, logit_bias, grammar masks at every position
            step.sampling.apply(output.next_token_logits, wb.sampling_info, trees)
        outcome = accept_drafts(output.next_token_logits, step.drafts, wb.sampling_info, step.draft_probs)
        _check_same_across_tp(outcome)
        step.outcome = outcome
        if step.sampling is not None:
            step.logprobs, step.logprob_rows = step.sampling.emitted_logprobs(
                output.next_token_logits, trees, chain_paths(outcome.accepted), outcome.tokens)
        verified = time.perf_counter()
        self.drafter.after_verify(step)
        step.draft_seconds = (drafted - started) + (time.perf_counter() - verified)
        self._relay_last_tokens(step)
        return step

    def _relay_last_tokens(self, step: VerifyStep) -> None:
        wb, outcome = step.worker_batch, step.outcome
        assert outcome is not None and wb.sampling_info is not None  # accepted; a generation batch has one
        last = torch.tensor([t[-1] for t in outcome.tokens], dtype=torch.int64)
        # The penalty state and step counters take every emitted token (after the queued filters and
        # merges bring them to this batch's layout); tokens past a finish do not matter: the
        # request leaves the batch.
        rows = [i for i, t in enumerate(outcome.tokens) for _ in t]
        wb.sampling_info.update_after_verify(torch.tensor(rows, dtype=torch.int64),
                                             torch.tensor([x for t in outcome.tokens for x in t], dtype=torch.int64))
        write_relay(self.worker.output_tokens_buf, wb.req_pool_indices.to(self.worker.output_tokens_buf.device),
                    last.to(self.worker.output_tokens_buf.device))

    # ------------------------------------------------------------------ tree steps
    def _prepare_tree(self, batch: ScheduleBatch, shape: TreeShape) -> VerifyStep:
        """A tree step: a request drafts the whole tree or nothing. It takes shape.slots slots after
        its decode slot (the verified drafts' first, the draft's scratch for the fed nodes), when its
        row holds them and it may still emit two tokens; the tree's depth may pass max_new_tokens,
        whose check in `process` cuts the accepted tokens."""
        row_width = batch.req_to_token_pool.req_to_token.shape[1]
        budgets = [shape.slots if req.max_new_tokens - len(req.output_ids) > 1 and row_width - seq_len >= shape.slots
                   else 0 for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu)]
        slots = batch.alloc_draft_slots(budgets)
        if slots is None:
            budgets = [0] * len(budgets)  # the pool is short (or nothing drafts): a plain step
        verify_lens = [shape.num_drafts if b else 0 for b in budgets]
        picked: List[torch.Tensor] = []
        offset = 0
        for b, k in zip(budgets, verify_lens):
            if k:
                assert slots is not None  # budgets are zero without slots
                picked.append(slots[offset:offset + k])
            offset += b
        # The drafts are written on the forward thread (_run_tree); 0 holds their place.
        input_ids = [t for req, k in zip(batch.reqs, verify_lens) for t in [req.output_ids[-1]] + [0] * k]
        worker_batch = batch.verify_worker_batch(input_ids, verify_lens, torch.cat(picked) if picked else None)
        if self.drafter.needs_target_hidden:
            worker_batch = dataclasses.replace(worker_batch, capture_hidden_states=True)
        return VerifyStep(worker_batch=worker_batch, drafts=[[] for _ in batch.reqs], draft_lens=verify_lens,
                          draft_on_forward_thread=any(verify_lens), tree_shape=shape,
                          tokens=[(req.origin_input_ids, req.output_ids) for req in batch.reqs],
                          sampling=VerifySampling.of(batch.reqs))

    def _run_tree(self, step: VerifyStep) -> VerifyStep:
        """The drafter grows the trees, the target verifies them in one forward under the tree mask,
        the accepted path's K/V move to chain order (the rest is freed by keep_verified in `process`,
        as a chain's rejected drafts), and the drafter follows."""
        tree = self.tree
        assert tree is not None and step.tree_shape is not None  # a tree step comes from _prepare_tree
        started = time.perf_counter()
        wb = step.worker_batch
        assert wb.extend_prefix_lens is not None and wb.sampling_info is not None  # a verify batch has both
        trees: List[Optional[DraftTree]] = [None] * len(step.draft_lens)
        if step.draft_on_forward_thread:
            trees = tree.drafter.draft_tree(step, step.tree_shape)
        fed = wb.input_ids.tolist()
        starts = [i + sum(step.draft_lens[:i]) for i in range(len(step.draft_lens))]
        ids, positions, mask = verify_layout(trees, [fed[s] for s in starts], wb.extend_prefix_lens)
        step.trees = trees
        step.drafts = [t.tokens if t is not None else [] for t in trees]
        step.worker_batch = wb = dataclasses.replace(wb, input_ids=torch.tensor(ids, dtype=torch.int64),
                                                     positions=positions, spec_tree_mask=mask)
        drafted = time.perf_counter()
        output = self.worker.forward_batch_verify(wb)
        step.target_hidden = output.aux_hidden_states if output.aux_hidden_states is not None else output.hidden_states
        assert wb.sampling_info is not None  # kept by the replace above
        full_trees = [t if t is not None else DraftTree(tokens=[], parents=[]) for t in trees]
        if step.sampling is not None:  # penalties, logit_bias, grammar masks at every node
            step.sampling.apply(output.next_token_logits, wb.sampling_info, full_trees)
        accepted = accept_tree(output.next_token_logits, trees, wb.sampling_info)
        _check_same_across_tp(accepted.outcome)
        step.outcome, step.paths = accepted.outcome, accepted.paths
        if step.sampling is not None:
            step.logprobs, step.logprob_rows = step.sampling.emitted_logprobs(
                output.next_token_logits, full_trees, accepted.paths, accepted.outcome.tokens)
        src, dst = path_moves(accepted.paths, starts)
        if src:
            loc = wb.out_cache_loc
            tree.target_pool.move_kv(loc[torch.tensor(src)].to(loc.device), loc[torch.tensor(dst)].to(loc.device))
        verified = time.perf_counter()
        tree.drafter.after_verify_tree(step)
        step.draft_seconds = (drafted - started) + (time.perf_counter() - verified)
        self._relay_last_tokens(step)
        return step

    def forward_plain(self, worker_batch: ModelWorkerBatch, run_target: Callable[[ModelWorkerBatch], Any]) -> Any:
        """A plain forward of the target (prefill, mixed or decode step), the drafter kept in step."""
        return self.drafter.forward_plain(worker_batch, run_target)

    def transfer_features(self) -> Optional[FeatureStore]:
        """What a PD transfer carries beside the KV for this drafter: an EAGLE head's target features
        of every prompt position (kept by the prefill server's forwards, read by the decode server's
        head), or None (a STANDALONE draft or n-gram builds its state from the tokens)."""
        from engine.speculative.features import TargetFeatures

        return self.drafter if isinstance(self.drafter, TargetFeatures) else None


def _check_same_across_tp(outcome: VerifyOutcome) -> None:
    """The debug check of model_runner.CHECK_TP_SAMPLING for verify steps: every rank accepted the
    same drafts and drew the same last token (the ranks draw from identical logits with the same
    random stream, as the normal sampler does)."""
    from engine.distributed.parallel_state import assert_same_across_tp, get_tp_size
    from engine.model_executor import model_runner

    if model_runner.CHECK_TP_SAMPLING and get_tp_size() > 1:
        assert_same_across_tp(torch.tensor(outcome.accepted + [t[-1] for t in outcome.tokens], dtype=torch.int64),
                              "verified tokens (accepted drafts, last token)")


def _tp_agreement(server_args: ServerArgs) -> Optional[Callable[[bool], bool]]:
    """Under tensor parallelism, the switch's decision every rank takes: on only where every rank
    measured that speculation pays (one small gloo all-reduce; wall times differ by rank)."""
    if server_args.tp_size == 1:
        return None
    from engine.distributed.parallel_state import all_reduce_min_small_ints

    return lambda pays: bool(all_reduce_min_small_ints([int(pays)])[0])


def build_speculator(server_args: ServerArgs, worker: ModelWorker, tree_cache: BasePrefixCache,
                     on_forward_thread: Callable[[Callable[[], Any]], Any]) -> Speculator:
    """The speculator of --speculative-algorithm; a draft model is built with `on_forward_thread`
    (where the target was built: on the CPU the only thread that runs multi-threaded torch ops)."""
    algo = server_args.speculative_algorithm
    if algo == "NGRAM":
        from engine.speculative.ngram import NgramDrafter

        return Speculator(server_args, worker, tree_cache, NgramDrafter(server_args))
    from engine.scheduler.tp_worker import TpModelWorker

    if not isinstance(worker, TpModelWorker):
        raise ValueError(f"--speculative-algorithm {algo} needs the model worker (a draft model runs beside it)")
    path = server_args.speculative_draft_model_path
    assert path is not None  # ServerArgs requires it for the draft-model algorithms
    if server_args.disaggregation_mode == "prefill":
        # Only EAGLE-family algorithms stay on a prefill server (server_args_check.py): it keeps and sends
        # the target's features for its decode server's head, and never drafts, so no head is loaded.
        keeper = _feature_keeper(worker, path, algo == "EAGLE3")
        return Speculator(server_args, worker, tree_cache, keeper, _memory_report(worker, None, keeper))
    runner = on_forward_thread(lambda: worker.make_draft_runner(path, eagle_draft=algo == "EAGLE"))
    from engine.speculative.draft_model import DraftModelDrafter

    drafter: Union[EagleDrafter, DraftModelDrafter] = (
        _eagle_drafter(worker, runner, path, algo == "EAGLE3") if algo in ("EAGLE", "EAGLE3") else DraftModelDrafter(runner))
    speculator = Speculator(server_args, worker, tree_cache, drafter, _memory_report(worker, runner, drafter))
    steps, topk = server_args.speculative_num_steps, server_args.speculative_eagle_topk
    if topk is not None and topk > 1:
        assert steps is not None and server_args.speculative_num_draft_tokens is not None  # ServerArgs checked them
        assert worker.real_runner is not None  # make_draft_runner needs one
        _require_tree_attention(steps, worker.real_runner, runner)
        speculator.tree = TreeVerify(TreeShape(steps, topk, server_args.speculative_num_draft_tokens), drafter,
                                     worker.real_runner.token_to_kv_pool)
    return speculator


def _require_tree_attention(steps: int, *runners: ModelRunner) -> None:
    """Tree verifies and tree drafts attend under a tree mask. Plain layers take it on every backend
    ServerArgs lets through; a sliding window, a logit cap or sinks on the Triton kernel and on the native
    decode kernel's rows (torch_native on the CPU: layers/attention/kernel_rows.py), a tree of num_steps
    drafts deep inside every window. Refused at start-up, not at the first tree step."""
    from engine.layers.attention.kernel_rows import kernel_takes
    from engine.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from engine.layers.radix_attention import RadixAttention
    from engine.mem_cache.mla_pool import MLATokenToKVPool

    for runner in runners:
        pool = runner.token_to_kv_pool
        if isinstance(pool, MLATokenToKVPool):
            continue  # MLA layers (full attention, no cap or sinks) take the tree mask in mla_torch.py
        for layer in runner.model.modules():
            if not isinstance(layer, RadixAttention) or layer.is_plain:
                continue
            q = torch.empty(1, layer.tp_q_head_num * layer.head_dim, dtype=runner.dtype, device=runner.device)
            backend = runner.attn_backend
            if not (backend.tree_mask_on_every_layer or (
                    isinstance(backend, TorchNativeAttnBackend) and pool is not None
                    and kernel_takes(q, pool.get_key_buffer(layer.layer_id), layer))):
                raise ValueError("--speculative-eagle-topk > 1 (tree drafts) on a model with sliding-window, "
                                 "soft-capped or sink attention layers needs --attention-backend triton, or "
                                 "torch_native on the CPU with its native kernels (float32 / bfloat16); use "
                                 "--speculative-eagle-topk 1")
            if 0 < layer.sliding_window_size <= steps:
                raise ValueError(f"--speculative-num-steps {steps} grows tree drafts deeper than the model's "
                                 f"sliding window ({layer.sliding_window_size}); use fewer steps or "
                                 "--speculative-eagle-topk 1")


def _memory_report(worker: TpModelWorker, runner: Optional[ModelRunner], drafter: Drafter) -> Dict[str, int]:
    """The bytes of the target's K/V pool and of the draft's (its K/V, and an EAGLE head's stored
    features; a PD prefill server's features only, `runner` None), both sized from one budget
    (speculative/memory.py)."""
    from engine.speculative.features import TargetFeatures
    from engine.speculative.memory import pool_bytes

    assert worker.real_runner is not None  # make_draft_runner and _feature_keeper refused the simulated device
    target = worker.real_runner.token_to_kv_pool
    draft = runner.token_to_kv_pool if runner is not None else None
    features = drafter.features if isinstance(drafter, TargetFeatures) else None
    feature_bytes = 0 if features is None else features.numel() * features.element_size()
    return {"kv_pool_bytes": pool_bytes(target.k_buffer, target.v_buffer),
            "draft_kv_pool_bytes": (pool_bytes(draft.k_buffer, draft.v_buffer) if draft is not None else 0)
            + feature_bytes}


def _eagle_drafter(worker: TpModelWorker, runner: ModelRunner, path: str, eagle3: bool) -> EagleDrafter:
    """The EAGLE (or EAGLE3, or NEXTN's MTP) head of `runner`, sharing the target's embedding (and, but
    for EAGLE3's own, its lm_head); for EAGLE3 the target is set to capture the head's auxiliary layers."""
    from engine.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
    from engine.models.llama import LlamaForCausalLM
    from engine.models.llama_eagle import LlamaForCausalLMEagle
    from engine.models.llama_eagle3 import LlamaForCausalLMEagle3
    from engine.speculative.eagle import EagleDrafter

    feature_size, name = _eagle_features(worker, runner.model_config, path, eagle3)
    head = runner.model
    target = worker.real_runner.model if worker.real_runner is not None else None
    # _eagle_features checked the head's architecture and its target's.
    if isinstance(head, DeepseekV3ForCausalLMNextN):
        assert isinstance(target, DeepseekV2ForCausalLM)
        head.share_embed_and_head(target)
    else:
        assert isinstance(head, (LlamaForCausalLMEagle, LlamaForCausalLMEagle3)) and isinstance(target, LlamaForCausalLM)
        head.share_embed_and_head(target)
    return EagleDrafter(runner, feature_size, runner.dtype, name)


def _feature_keeper(worker: TpModelWorker, path: str, eagle3: bool) -> FeatureKeeper:
    """A PD prefill server's store of the target's features that the head at `path` reads (its config
    only: the head is not loaded), sized as the target's pool."""
    from engine.configs.model_config import ModelConfig
    from engine.speculative.features import FeatureKeeper

    target = worker.real_runner
    if target is None:
        raise ValueError("an EAGLE head needs a real target model (not --simulated-device-forward-ms)")
    config = ModelConfig.from_pretrained(path, dtype=str(target.dtype).removeprefix("torch."),
                                         context_length=target.model_config.context_len,
                                         device=worker.server_args.device, eagle_draft=not eagle3)
    feature_size, name = _eagle_features(worker, config, path, eagle3)
    pool = target.token_to_kv_pool
    assert pool is not None  # a real runner of a generative model has one
    return FeatureKeeper(pool.size + pool.page_size, feature_size, target.dtype, target.device, name)


def _eagle_features(worker: TpModelWorker, head: ModelConfig, path: str, eagle3: bool) -> Tuple[int, str]:
    """(feature width, feature name) of the head configured by `head` over the worker's target, which
    is checked to be the head's kind of target; for EAGLE3 the target is set to capture the head's
    auxiliary layers. The name travels in a PD pair's KV layout: both servers must agree on it."""
    from engine.models.deepseek_nextn import DeepseekV3ForCausalLMNextN
    from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
    from engine.models.llama import LlamaForCausalLM
    from engine.models.llama_eagle import LlamaForCausalLMEagle
    from engine.models.llama_eagle3 import LlamaForCausalLMEagle3
    from engine.models.registry import resolve_model_class

    head_class = resolve_model_class(head.architectures)
    target = worker.real_runner.model if worker.real_runner is not None else None
    if issubclass(head_class, DeepseekV3ForCausalLMNextN):  # NEXTN: the MTP layer reads the final hidden state
        if not isinstance(target, DeepseekV2ForCausalLM) or head.hidden_size != target.config.hidden_size:
            raise ValueError(f"the MTP layer of {path} needs the DeepSeek-V2/V3 target it was trained with (hidden "
                             f"size {head.hidden_size})")
        return head.hidden_size, "NEXTN final hidden states"
    algo, arch = ("EAGLE3", "LlamaForCausalLMEagle3") if eagle3 else ("EAGLE", "LlamaForCausalLMEagle")
    if not issubclass(head_class, LlamaForCausalLMEagle3 if eagle3 else LlamaForCausalLMEagle):
        raise ValueError(f"--speculative-draft-model-path {path} is not an {algo} head (config.json architectures "
                         f"{arch}), which --speculative-algorithm {algo} needs"
                         + ("" if eagle3 else ", nor a DeepSeek-V3 checkpoint with its MTP layer (NEXTN)"))
    if not isinstance(target, LlamaForCausalLM) or head.hidden_size != target.config.hidden_size:
        raise ValueError(f"the {algo} head {path} needs a Llama-family target of its hidden size ({head.hidden_size})")
    if not eagle3:
        return head.hidden_size, "EAGLE final hidden states"
    layers = eagle3_aux_layers(head.raw_config, target.config.num_hidden_layers)
    target.model.set_aux_layers_to_capture(layers)
    return 3 * head.hidden_size, f"EAGLE3 inputs of layers {', '.join(map(str, layers))}"


def eagle3_aux_layers(head_config: Dict[str, Any], num_layers: int) -> List[int]:
    """The target layers whose inputs an EAGLE3 head reads, as SGLang picks them: the head config's
    eagle_config.eagle_aux_hidden_state_layer_ids name layer outputs (so each + 1 is a layer input);
    without them, the inputs of layers 2, num_layers // 2 and num_layers - 3."""
    eagle_config = head_config.get("eagle_config")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    if ids is None:
        return [2, num_layers // 2, num_layers - 3]
    if not isinstance(ids, list) or len(ids) != 3 or not all(isinstance(i, int) for i in ids):
        raise ValueError(f"EAGLE3 head: eagle_aux_hidden_state_layer_ids must be 3 layer ids, got {ids!r}")
    return [i + 1 for i in ids]
