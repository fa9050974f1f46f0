"""NGRAM speculative decoding (--speculative-algorithm NGRAM, engine/speculative/): greedy outputs
equal those without it token for token under every scheduling mode, drafts really are accepted on
a copying workload, rejected drafts leave no KV behind (the strict idle leak check runs after every
workload), and sampling keeps the target distribution (chi-square bounds that cannot fail by
chance: p < 1e-6)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch

from sched_utils import Harness, fast_lane
from utils_models import LetterTokenizer, build_tiny_model

from engine.server_args import ServerArgs, ServerArgsError
from engine.speculative.ngram import propose_ngram_drafts

N_NEW = 24
VOCAB = 2560  # the built-in model's
# Every batch of these tests verifies (the CPU default stops speculating past 4 requests).
NGRAM = dict(speculative_algorithm="NGRAM", speculative_batch_size_threshold=1024,
             disable_speculative_adaptive=True)


@pytest.fixture(scope="module")
def tiny():
    """The built-in model: its greedy outputs fall into repeating runs, which the drafter follows."""
    from engine.builtin_model import ensure_builtin_model

    return ensure_builtin_model()


def _harness(path: str, spec: bool, tokenizer=None, **kwargs) -> Harness:
    """tokenizer: the letters of LetterTokenizer unless given (constrained decoding needs the model's)."""
    from engine.scheduler.tp_worker import TpModelWorker

    total = kwargs.pop("max_total_tokens", 4096)
    page = kwargs.get("page_size", 1)
    worker_args = ServerArgs(model_path=path, device="cpu", max_total_tokens=total, page_size=page,
                             max_running_requests=16)
    return Harness(worker=TpModelWorker(worker_args), tokenizer=tokenizer or LetterTokenizer(), max_total_tokens=total,
                   **(NGRAM if spec else {}), **kwargs)


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(7)
    rand = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 33)]
    # Prompts that repeat text: the drafter finds their suffix earlier and proposes its continuation.
    repeated = [rand[1] * 3, (rand[0] + rand[2]) * 2 + rand[0][:3]]
    return rand + repeated


def _run(path: str, spec: bool, prompts: List[List[int]], sampling: Dict = None, **kwargs
         ) -> Tuple[Harness, List[List[int]], List[str]]:
    h = _harness(path, spec, **kwargs)
    params = dict(max_new_tokens=N_NEW, ignore_eos=True)
    params.update(sampling or {})
    rids = [h.submit(p, **params) for p in prompts]
    h.run_until_idle()  # ends with the strict idle leak check
    return h, [h.outputs[r].output_ids for r in rids], rids


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16),
    "page16-no-radix": dict(page_size=16, disable_radix_cache=True),
    "chunked-mixed": dict(chunked_prefill_size=8),
    "page16-chunked": dict(page_size=16, chunked_prefill_size=16),
    "retract": dict(max_total_tokens=128),
}


# Every mode in both loops: with overlap, plain steps are pipelined and a verify step settles first.
MODES = [(name, overlap) for name in CONFIGS for overlap in (False, True)]


@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("page16-chunked", False),
                                                           ("default", True), ("retract", True)}))
def test_greedy_outputs_equal_without_speculation(tiny, name, overlap):
    prompts = _prompts()
    _, plain, _ = _run(tiny, False, prompts, overlap=overlap, **CONFIGS[name])
    h, spec, _ = _run(tiny, True, prompts, overlap=overlap, **CONFIGS[name])
    assert spec == plain
    assert all(len(o) == N_NEW for o in spec)
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    if name == "default":
        # The tiny random model falls into loops the drafter follows: drafts are accepted.
        assert state["avg_spec_accept_length"] > 1.5
        assert state["spec_accepted_tokens"] > 0


@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
@pytest.mark.parametrize("overlap", [False, True])
def test_retraction_with_speculation_keeps_outputs(tiny, caplog, overlap):
    """A pool too small for eight requests at once: requests are retracted (their KV, drafts
    included, freed) and re-prefilled later, with the same greedy outputs."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, VOCAB, (12,), generator=gen).tolist() for _ in range(8)]
    _, plain, _ = _run(tiny, False, prompts, dict(max_new_tokens=40), max_total_tokens=96, overlap=overlap)
    with caplog.at_level("WARNING"):
        h, spec, _ = _run(tiny, True, prompts, dict(max_new_tokens=40), max_total_tokens=96, overlap=overlap)
    assert "Retract requests" in caplog.text
    assert spec == plain
    assert h.scheduler.internal_state()["spec_accepted_tokens"] > 0


def test_copy_workload_accepts_long_drafts(tiny):
    """The prompt is a prompt plus the first half of the target's own greedy output, so the
    reference continuation is the second half; that output repeats itself, and the drafts that
    copy it are accepted several at a time."""
    prompts = _prompts()[:3]
    _, full, _ = _run(tiny, False, prompts, dict(max_new_tokens=96))
    copy_prompts = [p + g[:48] for p, g in zip(prompts, full)]
    h, spec, _ = _run(tiny, True, copy_prompts, dict(max_new_tokens=48))
    assert spec == [g[48:] for g in full]
    state = h.scheduler.internal_state()
    assert state["avg_spec_accept_length"] > 3.0, state


def test_rejected_drafts_keep_outputs_and_free_their_kv(tiny):
    """Drafts that the target mostly rejects: the tokens the model emits appear in the prompt,
    followed by random tokens it does not continue with."""
    gen = torch.Generator().manual_seed(11)
    filler = torch.randint(0, VOCAB, (16,), generator=gen).tolist()
    _, (first,), _ = _run(tiny, False, [filler], dict(max_new_tokens=2))
    prompt = filler + [first[0]] + filler[:6] + [first[1]] + filler[6:12]
    _, plain, _ = _run(tiny, False, [prompt], dict(max_new_tokens=8))
    h, spec, _ = _run(tiny, True, [prompt], dict(max_new_tokens=8))
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_draft_tokens"] >= 2 * state["spec_accepted_tokens"] + 4, state
    # Nothing held: every slot is free or in the cache (the strict check ran at idle as well).
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"]


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 13])
def test_max_new_tokens_boundary_cuts_the_acceptance(tiny, max_new):
    prompts = _prompts()
    _, plain, _ = _run(tiny, False, prompts, dict(max_new_tokens=max_new))
    h, spec, rids = _run(tiny, True, prompts, dict(max_new_tokens=max_new))
    assert spec == plain
    assert all(len(o) == max_new for o in spec)
    assert all(h.outputs[r].finished_reason["type"] == "length" for r in rids)


def test_stop_token_and_stop_string_cut_the_acceptance(tiny):
    prompts = _prompts()
    _, base, _ = _run(tiny, False, prompts)
    # Stop on a token and on a string that appear in the middle of the greedy outputs.
    stop_id = base[3][10]
    stop_str = LetterTokenizer().decode(base[4][7:9])
    for sampling in (dict(stop_token_ids=[stop_id], ignore_eos=False), dict(stop=[stop_str])):
        h0, plain, rids0 = _run(tiny, False, prompts, sampling)
        h1, spec, rids1 = _run(tiny, True, prompts, sampling)
        assert spec == plain
        assert len(spec[3 if "stop_token_ids" in sampling else 4]) < N_NEW  # the stop really cut it
        assert [h1.outputs[r].finished_reason for r in rids1] == [h0.outputs[r].finished_reason for r in rids0]
        assert h1.scheduler.internal_state()["spec_accepted_tokens"] > 0


def test_abort_mid_request_frees_everything(tiny):
    h = _harness(tiny, True)
    prompt = _prompts()[3]
    keep = h.submit(prompt, max_new_tokens=N_NEW, ignore_eos=True)
    victim = h.submit(prompt, max_new_tokens=200, ignore_eos=True, stream=True)
    for _ in range(4):
        h.step()
    assert 0 < len(h.outputs[victim].output_ids) < 200
    h.abort(victim)
    h.run_until_idle()  # the strict leak check runs at idle
    assert h.outputs[victim].finished_reason["type"] == "abort"
    _, (plain,), _ = _run(tiny, False, [prompt])
    assert h.outputs[keep].output_ids == plain


def test_ineligible_requests_decode_plainly_and_stay_exact(tiny):
    """A sampling seed (its noise is keyed by the step counter: speculative/sampling.py keeps it
    plain) sends the batch down the plain decode path."""
    prompts = _prompts()
    _, plain, _ = _run(tiny, False, prompts, dict(sampling_seed=3))
    h, spec, _ = _run(tiny, True, prompts, dict(sampling_seed=3))
    assert spec == plain
    assert h.scheduler.internal_state()["spec_verify_ct"] == 0


def test_meta_counters_per_request(tiny):
    h, outs, rids = _run(tiny, True, _prompts())
    reqs_ct = h.scheduler.internal_state()["spec_verify_ct"]
    assert reqs_ct > 0
    for rid, out in zip(rids, outs):
        o = h.outputs[rid]
        assert o.completion_tokens == len(out)


# ---------------------------------------------------------------------------------------- drafter
def test_drafter_proposes_the_continuation_of_the_longest_latest_match():
    assert propose_ngram_drafts([1, 2, 3, 4, 1, 2], 1, 12, 3) == [3, 4, 1]
    # "1 2 3" occurs at the start; "2 3" alone also after 9: the longer match wins.
    assert propose_ngram_drafts([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 1, 12, 4) == [9, 2, 3, 7]
    # Equal lengths: the most recent occurrence.
    assert propose_ngram_drafts([4, 5, 4, 6, 4], 1, 12, 1) == [6]
    assert propose_ngram_drafts([5, 6, 7], 1, 12, 4) == []
    assert propose_ngram_drafts([1, 2, 1, 2], 3, 12, 4) == []  # no match of 3 tokens
    assert propose_ngram_drafts([1, 2, 3, 1, 2], 1, 12, 0) == []
    # The window caps the match: with max 1 only the last token is matched (its latest occurrence).
    assert propose_ngram_drafts([1, 2, 9, 2, 1, 2], 1, 1, 2) == [1, 2]


# ---------------------------------------------------------------------------------------- server args
def test_ngram_flags_defaults_and_bounds():
    args = ServerArgs(device="cpu", **NGRAM)
    assert args.speculative_num_draft_tokens == args.speculative_ngram_max_match_window_size == 12
    assert args.speculative_ngram_min_match_window_size == 1
    assert not args.disable_overlap_schedule  # plain steps overlap; verify steps settle first (issue 36)
    assert ServerArgs(device="cpu", speculative_algorithm="NGRAM").speculative_batch_size_threshold == 4
    assert not ServerArgs(device="cpu").disable_overlap_schedule  # the default path is unchanged
    for bad in (dict(speculative_num_draft_tokens=1), dict(speculative_num_draft_tokens=65),
                dict(speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=4),
                dict(speculative_algorithm="MEDUSA")):
        with pytest.raises(ServerArgsError):
            ServerArgs(device="cpu", **{**NGRAM, **bad})
    assert ServerArgs(device="cpu", tp_size=2, **NGRAM).speculative_algorithm == "NGRAM"  # every rank drafts alike


# ---------------------------------------------------------------------------------------- sampling
def _chi2_bound(df: int) -> float:
    """A chi-square value that a correct sampler exceeds with probability < 1e-6 (Wilson-Hilferty
    with z = 5.0, slightly conservative)."""
    z = 5.0
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(observed: Dict, expected: Dict) -> Tuple[float, int]:
    """Pearson's statistic over cells, pooling those expected below 5 into one."""
    stat, cells, pool_o, pool_e = 0.0, 0, 0.0, 0.0
    for key, e in expected.items():
        o = observed.get(key, 0)
        if e < 5:
            pool_o += o
            pool_e += e
            continue
        stat += (o - e) ** 2 / e
        cells += 1
    if pool_e > 0:
        stat += (pool_o - pool_e) ** 2 / max(pool_e, 1e-9)
        cells += 1
    assert all(k in expected for k in observed), "a token of probability 0 was emitted"
    return stat, max(cells - 1, 1)


def _sampling_info(n: int, vocab: int, **params):
    from engine.sampling.sampling_batch_info import SamplingBatchInfo
    from engine.sampling.sampling_params import SamplingParams

    def req():
        sp = SamplingParams(max_new_tokens=4, **params)
        sp.normalize(None)
        return SimpleNamespace(sampling_params=sp, origin_input_ids=[0], output_ids=[], eos_token_ids=set(),
                               custom_logit_processor=None)

    return SamplingBatchInfo.from_reqs([req() for _ in range(n)], vocab, "cpu")


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4),
                                    dict(temperature=1.3, top_p=0.8),
                                    dict(temperature=1.0, frequency_penalty=1.5, presence_penalty=0.5,
                                         logit_bias={"2": 1.0})])
@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
def test_rejection_sampling_keeps_the_target_distribution(params):
    """One draft per request, 20000 requests: the first token is distributed as p0 whatever the
    draft (accepted with p0(d), else drawn from p0 without d), the second, after an accepted
    draft, as p1. With penalties and a logit_bias (applied per position by VerifySampling), p1 is
    the distribution of a request whose output holds the draft: the draft, the most likely token at
    position 1, is penalised there (a step that applied the penalties of its start to every
    position, as SGLang's relaxed ones, draws it far too often)."""
    from engine.speculative.sampling import VerifySampling, chain_trees
    from engine.speculative.verify import accept_drafts, target_probs

    torch.manual_seed(0)
    vocab, n = 6, 20000
    base = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.0, 1.5, -0.5, 1.0, 0.2, 0.8]])
    logits = base.repeat(n, 1)
    draft = 1  # a likely token, often accepted
    info = _sampling_info(n, vocab, **params)
    adjusted = base.clone()
    if "frequency_penalty" in params:
        VerifySampling(adjusts_logits=True, grammars=[None] * n, logprobs=[None] * n,
                       outputs=[[]] * n).apply(logits, info, chain_trees([[draft]] * n))
        # The oracle: the plain sampler's adjustments of a request with no output, then with the draft.
        for row, output in enumerate([[], [draft]]):
            oracle = _sampling_info(1, vocab, **params)
            for token in output:
                oracle.update_after_sample(torch.tensor([token]))
            oracle.apply_logits_bias(adjusted[row:row + 1])
    out = accept_drafts(logits, [[draft]] * n, info)
    probs = target_probs(adjusted, _sampling_info(1, vocab, **params), torch.tensor([0]), torch.tensor([0, 0]))
    firsts: Dict[int, int] = {}
    seconds: Dict[int, int] = {}
    for toks in out.tokens:
        firsts[toks[0]] = firsts.get(toks[0], 0) + 1
        if toks[0] == draft:
            assert len(toks) == 2  # accepted draft, then the bonus
            seconds[toks[1]] = seconds.get(toks[1], 0) + 1
        else:
            assert len(toks) == 1
    exp1 = {t: n * float(probs[0, t]) for t in range(vocab) if probs[0, t] > 0}
    stat, df = _chi2(firsts, exp1)
    assert stat < _chi2_bound(df), (stat, df, firsts, exp1)
    n2 = firsts.get(draft, 0)
    exp2 = {t: n2 * float(probs[1, t]) for t in range(vocab) if probs[1, t] > 0}
    stat, df = _chi2(seconds, exp2)
    assert stat < _chi2_bound(df), (stat, df, seconds, exp2)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec_tiny_vocab"))
    hf = build_tiny_model(path, seed=5, vocab_size=12)
    return path, hf


# Sampling adjustments the verify step applies per position (speculative/sampling.py): the expected
# distribution takes them from the output tokens before each position. Strong penalties: a step
# that missed an accepted draft's count (SGLang's relaxed penalties) repeats it visibly often.
ADJUSTS = {"plain": {}, "penalty-bias": dict(frequency_penalty=2.0, presence_penalty=2.0,
                                             logit_bias={"4": 1.5, "9": -1.0})}


@pytest.mark.slow
@pytest.mark.parametrize("adjust", list(ADJUSTS))
def test_sampled_outputs_keep_the_target_distribution_end_to_end(tiny_vocab, adjust):
    """3000 sampled requests through the scheduler with NGRAM on a 12-token vocabulary: the
    prompt holds every token, so every verify step has drafts. Tokens 2 and 3 of each output
    (drawn by verify steps: accepted drafts, resampled or bonus tokens) follow transformers'
    distribution given the tokens before them (with a frequency penalty and a logit_bias: those
    of the plain sampler, the penalty counting the output tokens before the position)."""
    from engine.scheduler.tp_worker import TpModelWorker

    path, hf = tiny_vocab
    vocab, n, temperature = 12, 3000, 0.9
    prompt = [3, 1, 4, 0, 5, 9, 2, 6, 11, 8, 7, 10] * 2
    worker_args = ServerArgs(model_path=path, device="cpu", max_total_tokens=16384, max_running_requests=256)
    h = Harness(worker=TpModelWorker(worker_args), tokenizer=LetterTokenizer(), max_total_tokens=16384,
                max_running_requests=256, **NGRAM)
    rids = [h.submit(prompt, max_new_tokens=3, ignore_eos=True, temperature=temperature, **ADJUSTS[adjust])
            for _ in range(n)]
    h.run_until_idle()
    outs = [tuple(h.outputs[r].output_ids) for r in rids]
    assert all(len(o) == 3 for o in outs)
    assert h.scheduler.internal_state()["spec_draft_tokens"] > 0

    def dist(prefixes: List[Tuple[int, ...]]) -> Dict[Tuple[int, ...], torch.Tensor]:
        with torch.inference_mode():
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = hf(ids).logits[:, -1, :].float()
        logits = logits.clone()  # a normal tensor: updated in place below
        extra = ADJUSTS[adjust]
        for row, pre in enumerate(prefixes):
            for token, bias in extra.get("logit_bias", {}).items():
                logits[row, int(token)] += bias
            for token in pre:
                logits[row, token] -= extra.get("frequency_penalty", 0.0)
            for token in set(pre):
                logits[row, token] -= extra.get("presence_penalty", 0.0)
        probs = torch.softmax(logits / temperature, dim=-1)
        return dict(zip(prefixes, probs))

    for depth in (1, 2):
        counts: Dict[Tuple[int, ...], int] = {}
        for o in outs:
            counts[o[:depth]] = counts.get(o[:depth], 0) + 1
        p = dist(sorted(counts))
        observed: Dict[Tuple[int, ...], int] = {}
        for o in outs:
            observed[o[:depth + 1]] = observed.get(o[:depth + 1], 0) + 1
        # Given its prefix, each next token is a multinomial draw: one Pearson statistic per
        # prefix seen often enough, summed (independent given the prefix counts).
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


# ---------------------------------------------------------------------------------------- meta_info
def test_messages_carry_the_verify_counters_only_with_speculation(tiny):
    from engine.io_struct import BatchTokenIDOutput
    from engine.tokenizer.output_assembly import spec_meta_info

    for spec in (False, True):
        h = _harness(tiny, spec)
        msgs: List[BatchTokenIDOutput] = []
        outbox = h.scheduler.outbox

        def send(msg, outbox=outbox, msgs=msgs):
            msgs.append(msg)
            outbox.append(msg)

        h.scheduler.send_output = send
        rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in _prompts()]
        h.run_until_idle()
        final = {rid: (m, i) for m in msgs if isinstance(m, BatchTokenIDOutput)
                 for i, rid in enumerate(m.rids) if m.finished_reasons[i] is not None}
        for rid in rids:
            m, i = final[rid]
            if not spec:
                assert m.spec_verify_ct == [] and m.spec_accepted_tokens == []
                continue
            verify_ct, accepted, drafts = m.spec_verify_ct[i], m.spec_accepted_tokens[i], m.spec_draft_tokens[i]
            # Every output token but the prefill's came from a verify step: one bonus or resampled
            # token per step plus the accepted drafts.
            assert verify_ct + accepted == N_NEW - 1
            assert 0 <= accepted <= drafts
            meta = spec_meta_info(verify_ct, accepted, drafts, m.completion_tokens[i])
            assert meta["spec_verify_ct"] == verify_ct
            assert meta["spec_accept_length"] == N_NEW / verify_ct
    assert spec_meta_info(0, 0, 0, 1) == {"spec_verify_ct": 0, "spec_accept_rate": 0.0, "spec_accept_length": 0}
    assert spec_meta_info(4, 6, 8, 11) == {"spec_verify_ct": 4, "spec_accept_rate": 0.75, "spec_accept_length": 2.75,
                                          "spec_accept_token_num": 6, "spec_draft_token_num": 8}


@pytest.mark.parametrize("page_size,radix", [(1, True), (16, True), (16, False)])
def test_kv_is_conserved_at_every_step(tiny, page_size, radix):
    """At every step: free + evictable + protected + what live requests own is the whole pool, and
    each running request owns exactly its committed KV (its newest token has none yet), drafts
    included while they are verified and gone after."""
    from test_scheduler_invariants import kv_conservation

    gen = torch.Generator().manual_seed(4)
    shared = torch.randint(0, VOCAB, (20,), generator=gen).tolist()
    h = _harness(tiny, True, page_size=page_size, disable_radix_cache=not radix, max_total_tokens=512)
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
    assert h.scheduler.internal_state()["spec_accepted_tokens"] > 0


def test_greedy_requests_stay_exact_beside_sampled_ones(tiny):
    """A verify step whose batch mixes greedy and sampled rows: the greedy ones still return the
    tokens they return without speculation, the sampled ones run their full length."""
    prompts = _prompts()
    _, plain, _ = _run(tiny, False, prompts)
    h = _harness(tiny, True)
    greedy = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
    sampled = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True, temperature=1.0, top_p=0.9) for p in prompts]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in greedy] == plain
    assert all(len(h.outputs[r].output_ids) == N_NEW for r in sampled)
    assert h.scheduler.internal_state()["spec_accepted_tokens"] > 0
