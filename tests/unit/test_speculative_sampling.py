"""Speculative decoding of requests with logprobs, a grammar, penalties, min_new_tokens or logit_bias
(engine/speculative/sampling.py): greedy outputs and logprobs equal those without speculation
(NGRAM and STANDALONE, through the existing harnesses of test_speculative_ngram / _draft), every
sampled constrained output parses, and the per-position pieces match an oracle rebuilt from the
tokens (penalty state from SamplingBatchInfo.from_reqs, grammar masks from fresh matchers)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch

from sched_utils import fast_lane
from test_speculative_draft import _run as draft_run
from test_speculative_ngram import VOCAB, _prompts
from test_speculative_ngram import _run as ngram_run
from test_speculative_tree import _run as tree_run

# TREE: STANDALONE with tree drafts (--speculative-eagle-topk 2), in the full suite.
ALGOS = fast_lane(["NGRAM", "STANDALONE", "TREE"], {"NGRAM", "STANDALONE"})


@pytest.fixture(scope="module")
def tiny():
    from engine.builtin_model import ensure_builtin_model

    return ensure_builtin_model()


def _spec_run(algo: str, tiny: str, prompts: List[List[int]], sampling: Dict, **kwargs):
    """With speculation: NGRAM, or STANDALONE with the target as its own draft, in chains or trees
    (its drafts are the target's unpenalised, unconstrained tokens: some rejected by the sampling)."""
    if algo == "NGRAM":
        return ngram_run(tiny, True, prompts, sampling, **kwargs)
    if algo == "TREE":
        return tree_run(tiny, tiny, prompts, sampling, **kwargs)
    return draft_run(tiny, tiny, prompts, sampling, **kwargs)


def _assert_spoke(h, accepted: bool = True) -> None:
    """Verify steps ran (and, unless told otherwise, accepted drafts)."""
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0 and state["spec_draft_tokens"] > 0, state
    if accepted:
        assert state["spec_accepted_tokens"] > 0, state


# ---------------------------------------------------------------------------------------- logprobs
ASKS = {
    "logprobs": dict(return_logprob=True),
    "top-ids-start": dict(return_logprob=True, top_logprobs_num=3, token_ids_logprob=[1, 5, 7], logprob_start_len=2),
}


@pytest.mark.parametrize("ask", list(ASKS))
@pytest.mark.parametrize("algo", ALGOS)
def test_logprobs_equal_without_speculation(tiny, algo, ask):
    prompts = _prompts()
    h0, plain, rids0 = ngram_run(tiny, False, prompts, ASKS[ask])
    h1, spec, rids1 = _spec_run(algo, tiny, prompts, ASKS[ask])
    assert spec == plain
    _assert_spoke(h1)
    for r0, r1, out in zip(rids0, rids1, plain):
        a, b = h0.outputs[r0], h1.outputs[r1]
        assert b.logprob_ids == a.logprob_ids == out
        assert len(b.logprobs) == len(a.logprobs)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
        assert len(b.top_logprobs) == len(a.top_logprobs) == (len(out) if "top_logprobs_num" in ASKS[ask] else 0)
        for (bv, bi), (av, ai) in zip(b.top_logprobs, a.top_logprobs):
            assert bi == ai and len(ai) == 3
            torch.testing.assert_close(torch.tensor(bv), torch.tensor(av), atol=1e-5, rtol=0)
        assert len(b.token_ids_logprobs) == len(a.token_ids_logprobs)
        for bv, av in zip(b.token_ids_logprobs, a.token_ids_logprobs):
            torch.testing.assert_close(torch.tensor(bv), torch.tensor(av), atol=1e-5, rtol=0)
        assert b.input_token_ids_logprobs == a.input_token_ids_logprobs


# ---------------------------------------------------------------------------------------- penalties
# Mild enough that the tiny model's outputs still repeat (drafts are accepted), strong enough to
# change them (the test checks both); 2504 is a token the greedy outputs emit often.
PENALTIES = {
    "frequency": dict(frequency_penalty=0.1),
    "presence": dict(presence_penalty=0.1),
    "repetition": dict(repetition_penalty=1.3),
    "logit-bias": dict(logit_bias={"2504": 1.0}),
    "min-new-tokens": dict(min_new_tokens=16),  # with a stop token the outputs reach early (_min_new_stop)
}


def _min_new_stop(tiny) -> Dict:
    """A stop token each greedy output reaches early, so min_new_tokens has work to do."""
    _, base, _ = ngram_run(tiny, False, _prompts()[3:], dict(max_new_tokens=8))
    return dict(stop_token_ids=[base[0][2]], ignore_eos=False)


@pytest.mark.parametrize("name", list(PENALTIES))
@pytest.mark.parametrize("algo", ALGOS)
def test_penalised_greedy_outputs_equal_without_speculation(tiny, algo, name):
    sampling = dict(PENALTIES[name])
    if name == "min-new-tokens":
        sampling.update(_min_new_stop(tiny))
    prompts = _prompts()
    h0, plain, rids0 = ngram_run(tiny, False, prompts, sampling)
    h1, spec, rids1 = _spec_run(algo, tiny, prompts, sampling)
    assert spec == plain
    assert [h1.outputs[r].finished_reason for r in rids1] == [h0.outputs[r].finished_reason for r in rids0]
    _, unpenalised, _ = ngram_run(tiny, False, prompts)
    if name == "min-new-tokens":
        assert len(plain[3]) >= 16  # the stop token came at the third token: held back until 16
    else:
        assert plain != unpenalised  # the penalty changed the outputs: the test sees it
    _assert_spoke(h1)


# ---------------------------------------------------------------------------------------- oracles
def _req(output_ids: List[int], **params):
    from engine.sampling.sampling_params import SamplingParams

    sp = SamplingParams(max_new_tokens=64, **params)
    sp.normalize(None)
    return SimpleNamespace(sampling_params=sp, origin_input_ids=[1, 2, 3, 2], output_ids=list(output_ids),
                           eos_token_ids={0}, custom_logit_processor=None)


def test_per_position_state_equals_the_state_rebuilt_from_the_tokens():
    """Position p of each request sees the request's penalties, min_new_tokens and logit_bias as if
    the drafts on its path had been accepted: the same logits as a batch rebuilt from those tokens."""
    from engine.sampling.sampling_batch_info import SamplingBatchInfo
    from engine.speculative.sampling import VerifySampling, chain_trees
    from engine.speculative.tree import DraftTree

    vocab = 16
    params = [dict(frequency_penalty=0.5, presence_penalty=0.25), dict(repetition_penalty=1.5, min_new_tokens=4),
              dict(logit_bias={"3": 2.0}), dict(temperature=0.0)]
    outputs = [[4, 4, 5], [6], [], [7, 8]]
    drafts_of = [[4, 9, 4], [0, 6], [3, 3], []]
    trees = chain_trees(drafts_of)
    # A tree too: node 1 and 2 under the root, node 3 under node 1.
    trees[2] = DraftTree(tokens=[3, 5, 3], parents=[0, 0, 1])
    paths = [[[]] + [d[:j + 1] for j in range(len(d))] for d in drafts_of]
    paths[2] = [[], [3], [5], [3, 3]]
    reqs = [_req(o, **p) for o, p in zip(outputs, params)]
    info = SamplingBatchInfo.from_reqs(reqs, vocab)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(sum(1 + len(t.tokens) for t in trees), vocab, generator=gen)
    processed = logits.clone()
    sampling = VerifySampling(adjusts_logits=True, grammars=[None] * 4, logprobs=[None] * 4, outputs=outputs)
    sampling.apply(processed, info, trees)
    row = 0
    for o, p, req_paths in zip(outputs, params, paths):
        for path in req_paths:
            oracle = SamplingBatchInfo.from_reqs([_req(o + path, **p)], vocab)
            expected = logits[row:row + 1].clone()
            oracle.apply_logits_bias(expected)
            torch.testing.assert_close(processed[row:row + 1], expected, atol=0, rtol=0)
            row += 1
    # The batch's own state is untouched: it still matches a rebuild from the committed outputs.
    again = logits[:4].clone()
    info.apply_logits_bias(again)
    expected = logits[:4].clone()
    SamplingBatchInfo.from_reqs(reqs, vocab).apply_logits_bias(expected)
    torch.testing.assert_close(again, expected, atol=0, rtol=0)


def test_update_after_verify_counts_every_emitted_token():
    from engine.sampling.sampling_batch_info import SamplingBatchInfo

    vocab = 16
    reqs = [_req([4], frequency_penalty=0.5, min_new_tokens=5), _req([], repetition_penalty=1.2, presence_penalty=1.0)]
    info = SamplingBatchInfo.from_reqs(reqs, vocab)
    info.update_after_verify(torch.tensor([0, 0, 0, 1]), torch.tensor([4, 9, 4, 2]))
    rebuilt = SamplingBatchInfo.from_reqs([_req([4, 4, 9, 4], frequency_penalty=0.5, min_new_tokens=5),
                                           _req([2], repetition_penalty=1.2, presence_penalty=1.0)], vocab)
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    a, b = logits.clone(), logits.clone()
    info.apply_logits_bias(a)
    rebuilt.apply_logits_bias(b)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert info.output_lens.tolist() == [4, 1]


# ---------------------------------------------------------------------------------------- grammar
xgrammar = pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar")

SCHEMA = json.dumps({"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 8}},
    "required": ["name", "tags"], "additionalProperties": False})
REGEX = r"(ab|cd|ef)+-[0-9]{2,40}"


@pytest.fixture(scope="module")
def hf_tok(tiny):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny)


def _grammar_backend(hf_tok):
    from engine.constrained.xgrammar_backend import XGrammarGrammarBackend

    return XGrammarGrammarBackend(hf_tok, VOCAB, [], any_whitespace=False)


def _fresh_mask(backend, regex: str, tokens: List[int]) -> torch.Tensor:
    from engine.constrained.vocab_mask import allocate_vocab_mask

    g = backend.dispatch_regex(regex)
    for t in tokens:
        assert g.accept_token(t)
    mask = allocate_vocab_mask(1, VOCAB)
    g.fill_vocab_mask(mask, 0)
    return mask[0]


def test_grammar_masks_per_node_and_the_matcher_ends_where_it_started(hf_tok):
    """Each node's row is the mask of a fresh matcher fed the committed output and the node's path;
    the subtree of a draft the grammar rejects keeps all-allowed rows; the matcher is back after."""
    from engine.constrained.vocab_mask import allocate_vocab_mask
    from engine.speculative.sampling import walk_grammar
    from engine.speculative.tree import DraftTree

    backend = _grammar_backend(hf_tok)
    enc = lambda text: hf_tok(text, add_special_tokens=False).input_ids  # noqa: E731
    output = enc("ab")
    c, d, e, z, dash = (enc(ch) for ch in "cdez-")
    assert all(len(t) == 1 for t in (c, d, e, z, dash))
    # Root -> c -> d -> "-"; root -> z (rejected) -> c (never walked); root -> e.
    tree = DraftTree(tokens=[c[0], z[0], d[0], c[0], e[0], dash[0]], parents=[0, 0, 1, 2, 0, 3])
    grammar = backend.dispatch_regex(REGEX)
    for t in output:
        assert grammar.accept_token(t)
    mask = allocate_vocab_mask(1 + len(tree.tokens), VOCAB)
    walk_grammar(grammar, output, tree, mask, 0)
    paths = {0: [], 1: c, 3: c + d, 5: e, 6: c + d + dash}
    for node, path in paths.items():
        assert torch.equal(mask[node], _fresh_mask(backend, REGEX, output + path)), node
    assert not torch.equal(mask[6], mask[3])  # after "-" only digits: the rows differ
    all_ones = allocate_vocab_mask(1, VOCAB)[0]
    assert torch.equal(mask[2], all_ones) and torch.equal(mask[4], all_ones)
    # Back at the committed output: the same next mask, and it accepts what a fresh one does.
    assert grammar.num_accepted == len(output)
    again = allocate_vocab_mask(1, VOCAB)
    grammar.fill_vocab_mask(again, 0)
    assert torch.equal(again[0], mask[0])


def _copy_prompts(hf_tok, texts: List[str]) -> List[List[int]]:
    """Prompts that hold text of the constrained format twice: NGRAM drafts copy it."""
    return [hf_tok(f"Example: {t} Again: {t} Now yours: ", add_special_tokens=False).input_ids for t in texts]


GRAMMARS = {
    "json": (dict(json_schema=SCHEMA), ['{"name":"abc","tags":["x","yy","x","yy"]}',
                                        '{"name":"q","tags":[]}', '{"name":"hello","tags":["a","a","a"]}']),
    "regex": (dict(regex=REGEX), ["abcdab-1212121212", "efef-99", "cdcdcd-123123123123"]),
}


@pytest.mark.parametrize("kind", list(GRAMMARS))
@pytest.mark.parametrize("algo", ALGOS)
def test_constrained_greedy_outputs_equal_without_speculation(tiny, hf_tok, algo, kind):
    constraint, texts = GRAMMARS[kind]
    prompts = _copy_prompts(hf_tok, texts)
    sampling = dict(constraint, max_new_tokens=40, ignore_eos=False)
    h0, plain, rids0 = ngram_run(tiny, False, prompts, sampling, tokenizer=hf_tok)
    h1, spec, rids1 = _spec_run(algo, tiny, prompts, sampling, tokenizer=hf_tok)
    assert spec == plain
    assert [h1.outputs[r].finished_reason for r in rids1] == [h0.outputs[r].finished_reason for r in rids0]
    # The unconstrained draft model's tokens leave the regex at once: the grammar ends each of its
    # chains at the first draft (the other path this test needs); NGRAM copies the prompt's matches.
    _assert_spoke(h1, accepted=not (algo != "NGRAM" and kind == "regex"))


# Compact JSON of at most ~40 bytes (no free whitespace): a sampled output always completes.
SMALL_SCHEMA = json.dumps({"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"},
    "tag": {"enum": ["ab", "cd", "ef"]}}, "required": ["n", "ok", "tag"], "additionalProperties": False})


@pytest.mark.parametrize("algo", ALGOS)
def test_sampled_constrained_outputs_parse(tiny, hf_tok, algo):
    texts = ['{"n":12,"ok":true,"tag":"ab"}', '{"n":7,"ok":false,"tag":"ef"}', '{"n":999,"ok":true,"tag":"cd"}']
    sampling = dict(json_schema=SMALL_SCHEMA, max_new_tokens=64, ignore_eos=False, temperature=1.0)
    h, outs, rids = _spec_run(algo, tiny, _copy_prompts(hf_tok, texts) * 3, sampling, tokenizer=hf_tok,
                              constrained_json_disable_any_whitespace=True)
    # Verify steps ran; whether any draft was accepted is the sampler's draw (the drafts ignore the
    # grammar), so it is not asserted here: the greedy constrained tests cover accepted drafts.
    _assert_spoke(h, accepted=False)
    for rid, out in zip(rids, outs):
        assert h.outputs[rid].finished_reason["type"] == "stop", h.outputs[rid].finished_reason
        value = json.loads(hf_tok.decode(out, skip_special_tokens=True))
        assert set(value) == {"n", "ok", "tag"} and 0 <= value["n"] <= 999 and value["tag"] in ("ab", "cd", "ef")
    constraint, texts = GRAMMARS["regex"]
    sampling = dict(constraint, max_new_tokens=48, ignore_eos=False, temperature=1.0)
    h, outs, rids = _spec_run(algo, tiny, _copy_prompts(hf_tok, texts) * 3, sampling, tokenizer=hf_tok)
    for rid, out in zip(rids, outs):
        text = hf_tok.decode(out, skip_special_tokens=True)
        reason = h.outputs[rid].finished_reason["type"]
        # A regex may also end at the length limit, with a prefix of a match.
        assert re.fullmatch(REGEX, text) if reason == "stop" else re.fullmatch(r"(ab|cd|ef)*(a|c|e)?(-[0-9]*)?", text), text


def test_what_stays_plain(hf_tok):
    """Seeds, custom logit processors, hidden states and a grammar that cannot go back (a reasoner
    grammar) keep the batch on the plain decode step; penalties, bias, logprobs and grammars do not."""
    from engine.constrained.reasoner_grammar import ReasonerGrammar
    from engine.sampling.sampling_params import SamplingParams
    from engine.speculative.sampling import supports

    def req(grammar=None, hidden=False, processor=None, **params):
        sp = SamplingParams(max_new_tokens=8, **params)
        sp.normalize(None)
        return SimpleNamespace(sampling_params=sp, grammar=grammar, return_hidden_states=hidden,
                               custom_logit_processor=processor)

    regex = _grammar_backend(hf_tok).dispatch_regex(REGEX)
    assert supports(req(regex, frequency_penalty=0.5, logit_bias={"3": 1.0}, min_new_tokens=2))
    assert not supports(req(sampling_seed=1))
    assert not supports(req(hidden=True))
    assert not supports(req(processor="{}"))
    assert not supports(req(ReasonerGrammar(regex, [5])))
