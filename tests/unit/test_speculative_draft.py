"""Draft-model speculative decoding (--speculative-algorithm STANDALONE, engine/speculative/
draft_model.py): greedy outputs equal those without speculation token for token under every
scheduling mode; with the draft = the target every draft is accepted, which holds only if the
draft's K/V follow the target's exactly (prefill, cached prefixes, chunks, retraction, verify
steps); rejected drafts and finished, aborted or retracted requests leave nothing behind in either
pool (the strict idle leak check runs after every workload); sampling keeps the target
distribution with a draft distribution q (SGLang's min(1, p/q) rule, chi-square p < 1e-6)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from sched_utils import Harness, fast_lane
from test_speculative_ngram import VOCAB, _chi2, _chi2_bound, _prompts, _sampling_info
from utils_models import LetterTokenizer, build_tiny_model

from engine.server_args import ServerArgs, ServerArgsError

N_NEW = 24
STEPS = 3


@pytest.fixture(scope="module")
def tiny():
    from engine.builtin_model import ensure_builtin_model

    return ensure_builtin_model()


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A random 2-layer Llama with the built-in model's vocabulary: a poor draft (low acceptance)."""
    path = str(tmp_path_factory.mktemp("draft_small"))
    build_tiny_model(path, seed=3, vocab_size=VOCAB, max_position_embeddings=2048)
    return path


def _harness(target: str, draft: str = None, steps: int = STEPS, tokenizer=None, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    total = kwargs.pop("max_total_tokens", 4096)
    page = kwargs.get("page_size", 1)
    worker_args = ServerArgs(model_path=target, device="cpu", max_total_tokens=total, page_size=page,
                             max_running_requests=16)
    # Every batch verifies (the CPU default stops speculating past 4 requests, the switch where drafts do not pay).
    spec = dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=draft, speculative_num_steps=steps,
                speculative_batch_size_threshold=1024,
                disable_speculative_adaptive=True) if draft is not None else {}
    return Harness(worker=TpModelWorker(worker_args), tokenizer=tokenizer or LetterTokenizer(), max_total_tokens=total, **spec,
                   **kwargs)


def _run(target: str, draft: str, prompts: List[List[int]], sampling: Dict = None, **kwargs
         ) -> Tuple[Harness, List[List[int]], List[str]]:
    h = _harness(target, draft, **kwargs)
    params = dict(max_new_tokens=N_NEW, ignore_eos=True)
    params.update(sampling or {})
    rids = [h.submit(p, **params) for p in prompts]
    h.run_until_idle()  # ends with the strict idle leak check
    return h, [h.outputs[r].output_ids for r in rids], rids


def _waves(h: Harness, prompts: List[List[int]], sampling: Dict) -> List[List[int]]:
    """The prompts, then (once they finished) each prompt plus the first half of its output: the
    second wave's prefixes come from the radix cache, verified tokens included."""
    rids = [h.submit(p, **sampling) for p in prompts]
    h.run_until_idle()
    first = [h.outputs[r].output_ids for r in rids]
    rids2 = [h.submit(p + o[: len(o) // 2], **sampling) for p, o in zip(prompts, first)]
    h.run_until_idle()
    return first + [h.outputs[r].output_ids for r in rids2]


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16),
    "page16-no-radix": dict(page_size=16, disable_radix_cache=True),
    "chunked-mixed": dict(chunked_prefill_size=8),
    "page16-chunked": dict(page_size=16, chunked_prefill_size=16),
    "retract": dict(max_total_tokens=160),
}


# Every mode in both loops: with overlap, plain steps are pipelined and a verify step settles first.
MODES = [(name, overlap) for name in CONFIGS for overlap in (False, True)]


@pytest.mark.parametrize("name,overlap", MODES)
@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
def test_draft_equal_to_target_accepts_every_draft(tiny, name, overlap):
    """The draft is the target itself: it proposes the target's own greedy tokens only if its K/V
    are the target's at every position, so every draft of every verify step must be accepted
    (accept length num_steps + 1 whenever the budget allows num_steps drafts)."""
    prompts = _prompts()
    sampling = dict(max_new_tokens=N_NEW, ignore_eos=True)
    plain = _waves(_harness(tiny, overlap=overlap, **CONFIGS[name]), prompts, sampling)
    h = _harness(tiny, tiny, overlap=overlap, **CONFIGS[name])
    assert _waves(h, prompts, sampling) == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state
    # 23 tokens after the prefill's: 5 steps of 1 + 3, then one of 1 + 2 (the budget).
    if name in ("default", "no-radix", "page16", "page16-no-radix"):  # no mixed or retracted decode steps
        assert state["spec_verify_ct"] == 6 * 2 * len(prompts), state
        assert state["avg_spec_accept_length"] == pytest.approx(23 / 6)


@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("retract", False),
                                                           ("default", True), ("retract", True)}))
def test_small_random_draft_keeps_greedy_outputs(tiny, small_draft, name, overlap):
    prompts = _prompts()
    _, plain, _ = _run(tiny, None, prompts, overlap=overlap, **CONFIGS[name])
    h, spec, _ = _run(tiny, small_draft, prompts, overlap=overlap, **CONFIGS[name])
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    assert state["spec_accepted_tokens"] < state["spec_draft_tokens"]  # a poor draft: rejections happen


@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
def test_retraction_keeps_outputs_and_frees_both_pools(tiny, small_draft, caplog):
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (12,), generator=gen).tolist() for _ in range(8)]
    _, plain, _ = _run(tiny, None, prompts, dict(max_new_tokens=40), max_total_tokens=96)
    for draft in (tiny, small_draft):
        with caplog.at_level("WARNING"):
            h, spec, _ = _run(tiny, draft, prompts, dict(max_new_tokens=40), max_total_tokens=96)
        assert "Retract requests" in caplog.text
        assert spec == plain
        caplog.clear()
    state = h.scheduler.internal_state()
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"]


def test_draft_slots_are_the_targets(tiny):
    """The draft owns no slot: its runner shares the target's allocator and request rows (so the
    strict leak check of the one allocator covers the draft's K/V), its pool as large."""
    h = _harness(tiny, tiny)
    drafter = h.scheduler.spec.drafter
    assert drafter.runner.token_to_kv_pool_allocator is h.scheduler.token_to_kv_pool_allocator
    assert drafter.runner.req_to_token_pool is h.scheduler.req_to_token_pool
    assert drafter.runner.token_to_kv_pool is not h.worker.model_runner.token_to_kv_pool
    assert drafter.runner.token_to_kv_pool.size == h.scheduler.max_total_num_tokens


@pytest.mark.parametrize("page_size,radix", [(1, True), (16, False)])
def test_kv_is_conserved_at_every_step(tiny, small_draft, page_size, radix):
    from test_scheduler_invariants import kv_conservation

    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, VOCAB, (20,), generator=gen).tolist()
    h = _harness(tiny, small_draft, page_size=page_size, disable_radix_cache=not radix, max_total_tokens=512)
    for i in range(10):
        body = torch.randint(0, VOCAB, (int(torch.randint(1, 30, (1,), generator=gen)),), generator=gen).tolist()
        h.submit((shared if i % 2 else []) + body, max_new_tokens=int(torch.randint(1, 40, (1,), generator=gen)),
                 ignore_eos=True)
    steps = 0
    while h.scheduler.has_work():
        h.step()
        kv_conservation(h)
        for req in h.scheduler.running_batch.reqs:
            if not req.finished():
                assert req.kv_allocated_len == len(req.origin_input_ids) + len(req.output_ids) - 1
        steps += 1
        assert steps < 2000
    h.step()  # the strict idle check
    assert h.scheduler.internal_state()["spec_verify_ct"] > 0


@pytest.mark.parametrize("max_new", [1, 2, 3, 4, 5, 13])
def test_max_new_tokens_boundary(tiny, max_new):
    prompts = _prompts()
    _, plain, _ = _run(tiny, None, prompts, dict(max_new_tokens=max_new))
    h, spec, rids = _run(tiny, tiny, prompts, dict(max_new_tokens=max_new))
    assert spec == plain
    assert all(len(o) == max_new for o in spec)
    assert all(h.outputs[r].finished_reason["type"] == "length" for r in rids)


def test_stop_token_and_stop_string_cut_the_acceptance(tiny, small_draft):
    prompts = _prompts()
    _, base, _ = _run(tiny, None, prompts)
    stop_id = base[3][10]
    stop_str = LetterTokenizer().decode(base[4][7:9])
    for sampling in (dict(stop_token_ids=[stop_id], ignore_eos=False), dict(stop=[stop_str])):
        h0, plain, rids0 = _run(tiny, None, prompts, sampling)
        for draft in (tiny, small_draft):
            h1, spec, rids1 = _run(tiny, draft, prompts, sampling)
            assert spec == plain
            assert len(spec[3 if "stop_token_ids" in sampling else 4]) < N_NEW  # the stop really cut it
            assert [h1.outputs[r].finished_reason for r in rids1] == [h0.outputs[r].finished_reason for r in rids0]


def test_abort_mid_request_frees_everything(tiny, small_draft):
    h = _harness(tiny, small_draft)
    prompt = _prompts()[3]
    keep = h.submit(prompt, max_new_tokens=N_NEW, ignore_eos=True)
    victim = h.submit(prompt, max_new_tokens=200, ignore_eos=True, stream=True)
    for _ in range(4):
        h.step()
    assert 0 < len(h.outputs[victim].output_ids) < 200
    h.abort(victim)
    h.run_until_idle()  # the strict leak check runs at idle
    assert h.outputs[victim].finished_reason["type"] == "abort"
    _, (plain,), _ = _run(tiny, None, [prompt])
    assert h.outputs[keep].output_ids == plain


def test_ineligible_batches_decode_plainly_and_the_draft_follows(tiny):
    """Seeded requests take plain decode steps (the draft skips them); a later request that
    reuses their cached KV still has every draft accepted: the draft's catch-up K/V are right."""
    prompts = _prompts()
    h = _harness(tiny, tiny)
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True, sampling_seed=3) for p in prompts]
    h.run_until_idle()
    assert h.scheduler.internal_state()["spec_verify_ct"] == 0
    outs = [h.outputs[r].output_ids for r in rids]
    _, plain, _ = _run(tiny, None, prompts)
    assert outs == plain
    again = [h.submit(p + o[:12], max_new_tokens=8, ignore_eos=True) for p, o in zip(prompts, outs)]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in again] == [o[12:20] for o in outs]
    state = h.scheduler.internal_state()
    assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state


def test_greedy_requests_stay_exact_beside_sampled_ones(tiny, small_draft):
    prompts = _prompts()
    _, plain, _ = _run(tiny, None, prompts)
    h = _harness(tiny, small_draft)
    greedy = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
    sampled = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True, temperature=1.0, top_p=0.9) for p in prompts]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in greedy] == plain
    assert all(len(h.outputs[r].output_ids) == N_NEW for r in sampled)


@pytest.mark.parametrize("algo", ["STANDALONE", "NGRAM"])
def test_batches_above_the_threshold_decode_plainly(tiny, algo):
    """--speculative-batch-size-threshold 2 with 4 requests of different lengths: while more than 2
    run every step is a plain decode step, then verify steps take over; outputs stay exact and (draft
    = target) every draft is still accepted, so the draft followed the plain steps."""
    from engine.scheduler.tp_worker import TpModelWorker

    prompts = _prompts()[:4]
    lengths = [6, 10, 24, 30]
    plain = _harness(tiny)
    rids = [plain.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
    plain.run_until_idle()
    spec = dict(speculative_algorithm=algo, speculative_batch_size_threshold=2, disable_speculative_adaptive=True)
    if algo == "STANDALONE":
        spec.update(speculative_draft_model_path=tiny, speculative_num_steps=STEPS)
    h = Harness(worker=TpModelWorker(ServerArgs(model_path=tiny, device="cpu", max_total_tokens=4096,
                                                max_running_requests=16)),
                tokenizer=LetterTokenizer(), max_total_tokens=4096, **spec)
    rids2 = [h.submit(p, max_new_tokens=n, ignore_eos=True) for p, n in zip(prompts, lengths)]
    verify_batches: List[int] = []
    while h.scheduler.has_work():
        before = h.scheduler.internal_state()["spec_verify_ct"]
        batch = h.step()
        if h.scheduler.internal_state()["spec_verify_ct"] > before:
            verify_batches.append(batch.batch_size())
    h.step()  # the strict idle check
    assert [h.outputs[r].output_ids for r in rids2] == [plain.outputs[r].output_ids for r in rids]
    assert verify_batches and max(verify_batches) <= 2
    state = h.scheduler.internal_state()
    if algo == "STANDALONE":
        assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state
        # The radix cache now holds positions the draft skipped (decoded plainly above the threshold):
        # a request reusing them catches the draft up first, and every draft is still accepted.
        longest = plain.outputs[rids[3]].output_ids
        again = h.submit(prompts[3] + longest[:20], max_new_tokens=10, ignore_eos=True)
        verified = h.scheduler.internal_state()["spec_verify_ct"]
        while h.scheduler.internal_state()["spec_verify_ct"] == verified:
            h.step()
        # The draft is the target: after the catch-up its K/V equal the target's at every committed slot.
        (req,) = h.scheduler.running_batch.reqs
        slots = h.scheduler.req_to_token_pool.req_to_token[req.req_pool_idx, :req.kv_allocated_len].long()
        draft_pool = h.scheduler.spec.drafter.runner.token_to_kv_pool
        target_pool = h.worker.model_runner.token_to_kv_pool
        for layer in range(target_pool.layer_num):
            torch.testing.assert_close(draft_pool.k_buffer[layer][slots], target_pool.k_buffer[layer][slots],
                                       atol=1e-4, rtol=1e-4)
        h.run_until_idle()
        assert h.outputs[again].output_ids == longest[20:30]
        state = h.scheduler.internal_state()
        assert state["spec_accepted_tokens"] == state["spec_draft_tokens"], state


# ---------------------------------------------------------------------------------------- server args
def test_draft_model_flags_defaults_and_refusals(tiny):
    args = ServerArgs(device="cpu", speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny)
    # SGLang's STANDALONE defaults; a chain verifies num_steps + 1 tokens.
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    assert not args.disable_overlap_schedule  # the overlap loop, as a plain server's
    assert args.speculative_batch_size_threshold == 4  # the CPU default (benchmarks.md)
    args = ServerArgs(device="cpu", speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny,
                      speculative_num_steps=5, speculative_num_draft_tokens=9)
    assert args.speculative_num_draft_tokens == 6  # adjusted as SGLang does for topk 1
    base = dict(device="cpu", speculative_algorithm="STANDALONE", speculative_draft_model_path=tiny)
    for bad, match in ((dict(speculative_draft_model_path=None), "needs --speculative-draft-model-path"),
                       (dict(speculative_num_steps=2, speculative_eagle_topk=4), "topk 4 needs --speculative-num-draft-tokens"),
                       (dict(speculative_eagle_topk=1), "need --speculative-num-steps"),
                       (dict(speculative_num_steps=0), "must be in"),
                       (dict(speculative_num_steps=64), "must be in"),
                       (dict(speculative_batch_size_threshold=0), "threshold must be >= 1"),
                       (dict(enable_lora=True), "not supported yet with LoRA")):
        with pytest.raises(ServerArgsError, match=match):
            ServerArgs(**{**base, **bad})
    assert ServerArgs(**base, tp_size=2).speculative_num_steps == 3  # the draft is sharded like the target


def test_draft_with_another_vocabulary_is_refused(tiny, tmp_path):
    from engine.scheduler.tp_worker import TpModelWorker

    path = str(tmp_path / "other_vocab")
    build_tiny_model(path, seed=1, vocab_size=512, max_position_embeddings=2048)
    worker = TpModelWorker(ServerArgs(model_path=tiny, device="cpu", max_total_tokens=512))
    with pytest.raises(ValueError, match="vocabulary has 512 tokens, the target's 2560"):
        worker.make_draft_runner(path)


# ---------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8)])
@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
def test_rejection_sampling_with_draft_probabilities_keeps_the_target_distribution(params):
    """Two drafts per request drawn from a draft distribution q unlike p: the first emitted token is
    distributed as p0 (accepted with min(1, p0/q0), else drawn from max(p0 - q0, 0)), and after an
    accepted first draft the second as p1."""
    from engine.speculative.verify import accept_drafts, target_probs

    torch.manual_seed(0)
    vocab, n = 6, 20000
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 1.5, -0.5, 1.0, 0.2, 0.8],
                         [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    q = torch.tensor([[0.05, 0.1, 0.4, 0.3, 0.1, 0.05], [0.3, 0.1, 0.1, 0.1, 0.3, 0.1]])
    d = torch.multinomial(q, n, replacement=True).T  # [n, 2]: each request's drafts drawn from q
    logits = base.repeat(n, 1)
    out = accept_drafts(logits, d.tolist(), _sampling_info(n, vocab, **params), [q] * n)
    probs = target_probs(base, _sampling_info(1, vocab, **params), torch.tensor([0]), torch.tensor([0, 0, 0]))
    firsts: Dict[int, int] = {}
    seconds: Dict[int, int] = {}
    for drafts, toks, acc in zip(d.tolist(), out.tokens, out.accepted):
        assert toks[:acc] == drafts[:acc] and len(toks) == acc + 1
        firsts[toks[0]] = firsts.get(toks[0], 0) + 1
        if acc >= 1:
            seconds[toks[1]] = seconds.get(toks[1], 0) + 1
    exp1 = {t: n * float(probs[0, t]) for t in range(vocab) if probs[0, t] > 0}
    stat, df = _chi2(firsts, exp1)
    assert stat < _chi2_bound(df), (stat, df, firsts, exp1)
    n2 = sum(seconds.values())
    exp2 = {t: n2 * float(probs[1, t]) for t in range(vocab) if probs[1, t] > 0}
    stat, df = _chi2(seconds, exp2)
    assert stat < _chi2_bound(df), (stat, df, seconds, exp2)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("draft_tiny_vocab"))
    hf = build_tiny_model(path, seed=5, vocab_size=12)
    return path, hf


@pytest.mark.slow
def test_sampled_outputs_keep_the_target_distribution_end_to_end(tiny_vocab):
    """3000 sampled requests with the draft = the target on a 12-token vocabulary (q equals p up to
    rounding, so nearly every draft is accepted): tokens 2 and 3 of each output come from verify
    steps and follow transformers' distribution given the tokens before them."""
    from engine.scheduler.tp_worker import TpModelWorker

    path, hf = tiny_vocab
    vocab, n, temperature = 12, 3000, 0.9
    prompt = [3, 1, 4, 0, 5, 9, 2, 6, 11, 8, 7, 10]
    worker_args = ServerArgs(model_path=path, device="cpu", max_total_tokens=16384, max_running_requests=256)
    h = Harness(worker=TpModelWorker(worker_args), tokenizer=LetterTokenizer(), max_total_tokens=16384,
                max_running_requests=256, speculative_algorithm="STANDALONE", speculative_draft_model_path=path,
                speculative_num_steps=2, speculative_batch_size_threshold=1024,
                disable_speculative_adaptive=True)
    rids = [h.submit(prompt, max_new_tokens=3, ignore_eos=True, temperature=temperature) for _ in range(n)]
    h.run_until_idle()
    outs = [tuple(h.outputs[r].output_ids) for r in rids]
    assert all(len(o) == 3 for o in outs)
    state = h.scheduler.internal_state()
    assert state["spec_accepted_tokens"] > 0.9 * state["spec_draft_tokens"] > 0, state

    def dist(prefixes: List[Tuple[int, ...]]) -> Dict[Tuple[int, ...], torch.Tensor]:
        with torch.inference_mode():
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = hf(ids).logits[:, -1, :].float()
        return dict(zip(prefixes, torch.softmax(logits / temperature, dim=-1)))

    for depth in (1, 2):
        counts: Dict[Tuple[int, ...], int] = {}
        observed: Dict[Tuple[int, ...], int] = {}
        for o in outs:
            counts[o[:depth]] = counts.get(o[:depth], 0) + 1
            observed[o[:depth + 1]] = observed.get(o[:depth + 1], 0) + 1
        p = dist(sorted(counts))
        total_stat, total_df = 0.0, 0
        for pre, c in counts.items():
            if c < 100:
                continue
            expected = {pre + (t,): c * float(p[pre][t]) for t in range(vocab)}
            stat, df = _chi2({k: v for k, v in observed.items() if k[:depth] == pre}, expected)
            total_stat += stat
            total_df += df
        assert total_df >= 10, (depth, total_df)
        assert total_stat < _chi2_bound(total_df), (depth, total_stat, total_df)
