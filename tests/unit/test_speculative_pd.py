"""Speculative decoding on a PD decode server (the prefill server never drafts), in process: a
prefill and a decode scheduler on the built-in model (loopback transfer) against a unified scheduler
without speculation.

Greedy outputs are equal token for token and the decode side's target never runs an extend forward.
With the target as its own draft (STANDALONE), every draft is accepted: the draft built its own K/V
of each transferred prompt (its catch-up from the prompt tokens) exactly, after retractions too.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from pd_utils import PDPair, pd_args
from sched_utils import Harness, fast_lane

N_NEW = 16
SAMPLING = dict(max_new_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["Hello world, this is a test of the engine.", "The quick brown fox", "def f(x):\n    return x * 2",
             "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
    prompts = [tok(t).input_ids for t in texts]
    prompts.append(prompts[0] + prompts[2][1:])  # shares a prefix with prompt 0 (a prefill cache hit)
    return path, tok, prompts


def _worker(path: str, total: int = 4096, **extra):
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    return TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=total, max_running_requests=16,
                                    **extra))


@pytest.fixture(scope="module")
def oracle(model):
    path, tok, prompts = model
    h = Harness(worker=_worker(path), tokenizer=tok, max_total_tokens=4096)
    rids = [h.submit(p, rid=f"u{i}", **SAMPLING) for i, p in enumerate(prompts)]
    h.run_until_idle()
    out = [h.outputs[r].output_ids for r in rids]
    h.scheduler.shutdown()
    return out


def _spec(algo: str, path: str) -> Dict:
    spec: Dict = dict(speculative_algorithm=algo, speculative_batch_size_threshold=1024,
                      disable_speculative_adaptive=True)
    if algo == "STANDALONE":
        spec.update(speculative_draft_model_path=path, speculative_num_steps=3)
    return spec


@pytest.mark.parametrize("algo,total,overlap", [("STANDALONE", 4096, False), ("NGRAM", 4096, False),
                                                ("STANDALONE", 96, False), ("STANDALONE", 4096, True),
                                                ("NGRAM", 4096, True), ("STANDALONE", 96, True)],
                         ids=["standalone", "ngram", "standalone-retracts", "standalone-overlap", "ngram-overlap",
                              "standalone-retracts-overlap"])
def test_pd_decode_side_speculation_equals_unified(model, oracle, algo, total, overlap):
    path, tok, prompts = model
    spec = _spec(algo, path)
    decode_kwargs = dict(spec, max_total_tokens=total)
    if total < 4096:
        decode_kwargs["num_reserved_decode_tokens"] = 0  # retract rather than wait
    # The same flags on the prefill server: accepted there and ignored (it never drafts).
    pair = PDPair(prefill_worker=_worker(path), decode_worker=_worker(path, total, disaggregation_mode="decode"),
                  tokenizer=tok, prefill_kwargs=dict(spec, max_total_tokens=4096), decode_kwargs=decode_kwargs,
                  overlap_decode=overlap)
    try:
        assert pair.prefill.scheduler.spec is None
        rids = [pair.submit(p, rid=f"pd{i}", **SAMPLING) for i, p in enumerate(prompts)]
        retracted = pair.run_counting_retractions()
        assert (retracted > 0) == (total < 4096), retracted
        assert [pair.decode.outputs[r].output_ids for r in rids] == oracle
        assert pair.decode.scheduler.num_extend_tokens_computed == 0  # the target never prefills there
        state = pair.decode.scheduler.internal_state()
        assert state["spec_verify_ct"] > 0
        if algo == "STANDALONE":
            # The draft is the target: its K/V of the transferred prompts are exact.
            assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state
    finally:
        pair.close()


def test_pd_flags():
    from engine.server_args import ServerArgs
    from pd_utils import pd_args

    prefill = ServerArgs(device="cpu", speculative_algorithm="NGRAM", **pd_args("prefill"))
    assert prefill.speculative_algorithm is None and not prefill.disable_overlap_schedule  # ignored there
    decode = ServerArgs(device="cpu", speculative_algorithm="NGRAM", **pd_args("decode"))
    assert decode.speculative_algorithm == "NGRAM"
    for algo in ("EAGLE", "EAGLE3"):
        decode = ServerArgs(device="cpu", speculative_algorithm=algo, speculative_draft_model_path="/head",
                            **pd_args("decode"))
        assert decode.speculative_algorithm == algo and not decode.disable_overlap_schedule  # overlap stays on
        # Kept on the prefill (it sends the target's features of each prompt), which never verifies.
        prefill = ServerArgs(device="cpu", speculative_algorithm=algo, speculative_draft_model_path="/head",
                             **pd_args("prefill"))
        assert prefill.speculative_algorithm == algo and not prefill.disable_overlap_schedule


# ---------------------------------------------------------------------------------------------- EAGLE
# The decode server's EAGLE / EAGLE3 head reads the target's features of the prompt: the prefill
# server keeps them (its forwards capture them) and sends them with the KV.


@pytest.fixture(scope="module")
def eagle_models(tmp_path_factory):
    """A random 4-layer Llama target, a random EAGLE head and a random EAGLE3 head for it (default
    auxiliary layers: the inputs of layers 1, 2 and 2), and transformers' target (the oracle of the
    features)."""
    from utils_models import build_eagle3_head, build_eagle_head, build_tiny_model

    from test_speculative_ngram import VOCAB

    target = str(tmp_path_factory.mktemp("pd_eagle_target"))
    hf = build_tiny_model(target, seed=2, vocab_size=VOCAB, max_position_embeddings=2048, num_hidden_layers=4)
    eagle = build_eagle_head(str(tmp_path_factory.mktemp("pd_eagle_head")), target, seed=1)
    eagle3 = build_eagle3_head(str(tmp_path_factory.mktemp("pd_eagle3_head")), target, seed=1,
                               draft_vocab_size=VOCAB // 2)
    return target, {"EAGLE": eagle, "EAGLE3": eagle3}, hf


@pytest.fixture(scope="module")
def eagle_oracle(eagle_models):
    """The target's greedy outputs on a unified server without speculation."""
    from test_speculative_ngram import _prompts
    from utils_models import LetterTokenizer

    target, _, _ = eagle_models
    h = Harness(worker=_worker(target), tokenizer=LetterTokenizer(), max_total_tokens=4096)
    rids = [h.submit(p, **SAMPLING) for p in _prompts()]
    h.run_until_idle()
    out = [h.outputs[r].output_ids for r in rids]
    h.scheduler.shutdown()
    return out


def _eagle_spec(algo: str, head: str, topk: int = 1) -> Dict:
    spec: Dict = dict(speculative_algorithm=algo, speculative_draft_model_path=head,
                      speculative_batch_size_threshold=1024, disable_speculative_adaptive=True)
    if topk > 1:
        spec.update(speculative_num_steps=2, speculative_eagle_topk=topk, speculative_num_draft_tokens=4)
    return spec


def _features_oracle(hf, algo: str, tokens: List[int]) -> torch.Tensor:
    """The target's feature at each position of `tokens`: its final hidden state (EAGLE), or the
    inputs of layers 1, 2 and 2 side by side (EAGLE3's default for 4 layers, in layer order;
    hidden_states[i] is the input of layer i)."""
    with torch.inference_mode():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    if algo == "EAGLE":
        return states[-1][0]
    return torch.cat([states[1][0], states[2][0], states[2][0]], dim=-1)


# name: (algorithm, topk, both servers' extra flags, the decode server's).
EAGLE_CASES = {
    "eagle": ("EAGLE", 1, {}, {}),
    "eagle-no-radix": ("EAGLE", 1, {}, dict(disable_radix_cache=True)),
    "eagle3": ("EAGLE3", 1, {}, {}),
    "eagle3-no-radix": ("EAGLE3", 1, {}, dict(disable_radix_cache=True)),
    "eagle-tree": ("EAGLE", 2, {}, {}),
    "eagle3-page16-chunked": ("EAGLE3", 1, dict(page_size=16), {}),
}


def _check_prefill_holds_no_head(pair: PDPair, target: str, head: str, algo: str) -> None:
    """The prefill server only sends the target's features: it keeps them (a FeatureKeeper) but built no
    draft runner (the decode server built one: the check can see one), and its memory budget counts
    the features alone."""
    import gc

    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs
    from engine.speculative.features import FeatureKeeper
    from engine.speculative.memory import draft_memory

    prefill_runner = pair.prefill.scheduler.spec.worker.real_runner
    decode_runner = pair.decode.scheduler.spec.worker.real_runner
    assert isinstance(pair.prefill.scheduler.spec.drafter, FeatureKeeper)
    drafts_of = [r.draft_of for r in gc.get_objects() if type(r) is ModelRunner and r.draft_of is not None]
    assert any(d is decode_runner for d in drafts_of) and not any(d is prefill_runner for d in drafts_of)
    state = pair.prefill.scheduler.internal_state()
    features = pair.prefill.scheduler.spec.drafter.features
    assert state["draft_kv_pool_bytes"] == features.numel() * features.element_size() > 0
    args = dict(model_path=target, device="cpu", **_eagle_spec(algo, head))
    config = prefill_runner.model_config
    prefill = draft_memory(ServerArgs(**args, **pd_args("prefill")), config, 1)
    decode = draft_memory(ServerArgs(**args, **pd_args("decode")), config, 1)
    assert prefill is not None and decode is not None
    assert (prefill.kv_bytes_per_token, prefill.weight_bytes) == (0, 0)
    assert prefill.feature_bytes_per_token == decode.feature_bytes_per_token > 0
    assert decode.kv_bytes_per_token > 0 and decode.weight_bytes > 0


@pytest.mark.parametrize("case", fast_lane(list(EAGLE_CASES), {"eagle", "eagle3-no-radix"}))
def test_pd_decode_side_eagle_equals_unified(eagle_models, eagle_oracle, case):
    """Greedy outputs on the decode side equal the target's without speculation; the features the
    decode server's head reads at every received prompt slot are the target's (transformers), so
    they came from the prefill, prefix-cache hits there included (the second wave shares prefixes
    with the first); both sides end idle with nothing leaked. The prefill runs the overlap loop (it
    keeps the features on its forward thread, never verifies) with chunked prefill, and holds no head."""
    from test_speculative_ngram import _prompts
    from utils_models import LetterTokenizer

    target, heads, hf = eagle_models
    algo, topk, both, decode_only = EAGLE_CASES[case]
    spec = dict(_eagle_spec(algo, heads[algo], topk), **both)
    prompts = _prompts()
    page = both.get("page_size", 1)
    pair = PDPair(prefill_worker=_worker(target, page_size=page),
                  decode_worker=_worker(target, disaggregation_mode="decode", page_size=page), tokenizer=LetterTokenizer(),
                  overlap_prefill=True, prefill_kwargs=dict(spec, max_total_tokens=4096, chunked_prefill_size=16),
                  decode_kwargs=dict(spec, max_total_tokens=4096, **decode_only))
    try:
        _check_prefill_holds_no_head(pair, target, heads[algo], algo)
        drafter = pair.decode.scheduler.spec.drafter
        table = pair.decode.scheduler.req_to_token_pool.req_to_token
        expected = {tuple(p): _features_oracle(hf, algo, p) for p in prompts}
        checked = set()
        rids = [f"pd{i}" for i in range(len(prompts))]
        for wave in (range(3), range(3, len(prompts))):  # prompts 3 and 4 start with prompts 1 and 0
            for i in wave:
                pair.submit(prompts[i], rid=rids[i], **SAMPLING)
            while pair.busy():
                pair.step()
                for req in pair.decode.scheduler.running_batch.reqs:
                    if req.rid in checked or req.finished():
                        continue
                    slots = table[req.req_pool_idx, :len(req.origin_input_ids)].to(torch.int64)
                    torch.testing.assert_close(drafter.features[slots].float(),
                                               expected[tuple(req.origin_input_ids)], atol=2e-4, rtol=2e-4)
                    checked.add(req.rid)
            pair.run_until_idle()  # ends with the strict idle leak check on both sides
        assert checked == set(rids)
        # Prefill cache hits: prompt 3 starts with prompt 1's 17 tokens, prompt 4 with prompt 0's 5 (less
        # than a page of 16).
        assert [pair.decode.outputs[rids[i]].cached_tokens > 0 for i in (3, 4)] == [True, page == 1]
        assert [pair.decode.outputs[r].output_ids for r in rids] == eagle_oracle
        assert pair.decode.scheduler.num_extend_tokens_computed == 0  # the target never prefills there
        assert pair.decode.scheduler.internal_state()["spec_verify_ct"] > 0
    finally:
        pair.close()


@pytest.fixture(scope="module")
def repeat_pair(tmp_path_factory):
    """A 1-layer target that repeats its last token and an EAGLE3 head that predicts, from the
    feature it reads (the layer input embed(t)), the token t: its first draft of each step reads the
    target's feature at the last committed position, which for the first step is the prompt's last
    token, sent by the prefill (test_speculative_eagle3.py)."""
    from utils_models import build_eagle3_head, repeat_target

    from test_speculative_ngram import VOCAB

    target = repeat_target(str(tmp_path_factory.mktemp("pd_repeat_target")), seed=4, vocab_size=VOCAB)
    head = build_eagle3_head(str(tmp_path_factory.mktemp("pd_repeat_head")), target, seed=6,
                             draft_vocab_size=VOCAB, aux_layer_ids=[-1, -1, -1], repeat=True)
    return target, head


def _unified_outputs(target, prompts, tokenizer):
    """The greedy outputs of a unified server without speculation (the oracle)."""
    plain = Harness(worker=_worker(target), tokenizer=tokenizer, max_total_tokens=4096)
    try:
        rids = [plain.submit(p, **SAMPLING) for p in prompts]
        plain.run_until_idle()
        return [plain.outputs[r].output_ids for r in rids]
    finally:
        plain.scheduler.shutdown()


@pytest.mark.parametrize("total", [4096, 128], ids=["fits", "retracts"])
def test_pd_decode_side_eagle3_accepts_every_draft(repeat_pair, total):
    """Without the prompt's features on the decode side the first draft of each request would be
    drawn from a zero feature (and rejected); with them every draft is accepted. Retracted requests
    keep their features with their KV backup (the first draft after the resume reads the feature of
    the last committed position)."""
    from test_speculative_ngram import _prompts
    from utils_models import LetterTokenizer

    target, head = repeat_pair
    prompts = _prompts()
    oracle = _unified_outputs(target, prompts, LetterTokenizer())
    spec = _eagle_spec("EAGLE3", head)
    decode_kwargs = dict(spec, max_total_tokens=total)
    if total < 4096:
        decode_kwargs["num_reserved_decode_tokens"] = 0  # retract rather than wait
    pair = PDPair(prefill_worker=_worker(target), decode_worker=_worker(target, total, disaggregation_mode="decode"),
                  tokenizer=LetterTokenizer(), prefill_kwargs=dict(spec, max_total_tokens=4096), decode_kwargs=decode_kwargs)
    try:
        rids = [pair.submit(p, rid=f"pd{i}", **SAMPLING) for i, p in enumerate(prompts)]
        retracted = pair.run_counting_retractions()
        assert (retracted > 0) == (total < 4096), retracted
        assert [pair.decode.outputs[r].output_ids for r in rids] == oracle
        state = pair.decode.scheduler.internal_state()
        assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state
    finally:
        pair.close()


def test_pd_decode_side_eagle3_after_a_rebootstrap(repeat_pair):
    """pause_generation(retract) on the decode server, then continue: the prefill recomputes the KV
    of prompt + outputs (but the last) and sends the features with it, so every draft is still
    accepted and the outputs are the target's."""
    from engine.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput
    from test_speculative_ngram import _prompts
    from utils_models import LetterTokenizer

    target, head = repeat_pair
    prompts = _prompts()[:3]
    oracle = _unified_outputs(target, prompts, LetterTokenizer())
    spec = _eagle_spec("EAGLE3", head)
    pair = PDPair(prefill_worker=_worker(target), decode_worker=_worker(target, disaggregation_mode="decode"),
                  tokenizer=LetterTokenizer(), prefill_kwargs=dict(spec, max_total_tokens=4096),
                  decode_kwargs=dict(spec, max_total_tokens=4096))
    try:
        rids = [pair.submit(p, rid=f"pd{i}", stream=True, **SAMPLING) for i, p in enumerate(prompts)]
        for _ in range(200):
            if all(len(pair.decode.outputs[r].output_ids) >= 3 for r in rids):
                break
            pair.step()
        control = pair.decode.scheduler.control
        assert control.pause_generation(PauseGenerationReqInput(mode="retract")).success
        assert len(pair.decode.scheduler.disagg.prealloc.held) == len(prompts)
        assert control.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False)).success
        pair.run_until_idle()
        assert pair.net.recomputes == len(prompts)
        assert [pair.decode.outputs[r].output_ids for r in rids] == oracle
        state = pair.decode.scheduler.internal_state()
        assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state
    finally:
        pair.close()


@pytest.mark.parametrize("prefill_algo,decode_algo", [(None, "EAGLE"), ("EAGLE", None), ("EAGLE3", "EAGLE")],
                         ids=["decode-only", "prefill-only", "eagle3-vs-eagle"])
def test_pd_speculation_mismatch_refused_at_bootstrap(eagle_models, prefill_algo, decode_algo):
    """Servers whose EAGLE flags differ cannot pair: the request fails with the reason (as a KV dtype
    mismatch does), and both sides end idle."""
    from test_speculative_ngram import _prompts
    from utils_models import LetterTokenizer

    target, heads, _ = eagle_models

    def kwargs(algo):
        return dict(_eagle_spec(algo, heads[algo]) if algo else {}, max_total_tokens=4096)

    pair = PDPair(prefill_worker=_worker(target), decode_worker=_worker(target, disaggregation_mode="decode"),
                  tokenizer=LetterTokenizer(), prefill_kwargs=kwargs(prefill_algo), decode_kwargs=kwargs(decode_algo))
    try:
        rid = pair.submit(_prompts()[0], rid="mismatch", **SAMPLING)
        # The prefill side waits for a destination that never comes: it is aborted there.
        pair.prefill.abort(rid)
        pair.run_until_idle()
        reason = pair.decode.outputs[rid].finished_reason
        assert reason["type"] == "abort" and "speculative features sent with the KV differ" in reason["message"], reason
    finally:
        pair.close()


def test_feature_frames_are_bounded():
    """A frame carries the KV then [n, width] features; a payload of another size is refused (the
    room fails as corrupt), and a peer's feature layout is bounded before it sizes anything."""
    from engine.disaggregation.kv_io import (MAX_FEATURE_SIZE, KVLayout, frame_payload, pair_ranks,
                                             split_payload)

    layout = KVLayout(num_layers=2, total_kv_heads=2, head_dim=4, dtype="float32", tp_size=1, tp_rank=0,
                      features="EAGLE final hidden states", feature_size=8, feature_dtype="bfloat16")
    assert layout.bytes_per_token() == 2 * 2 * 2 * 4 * 4 + 8 * 2
    kv = torch.randn(2, 2, 3, 2, 4)
    features = torch.randn(3, 8).to(torch.bfloat16)
    got_kv, got_features = split_payload(frame_payload(kv, features), layout, 3, 2)
    assert torch.equal(got_kv, kv) and got_features is not None and torch.equal(got_features, features)
    with pytest.raises(ValueError, match="expected"):
        split_payload(frame_payload(kv, None), layout, 3, 2)  # the features are missing
    assert KVLayout.from_dict(layout.to_dict()) == layout
    for bad in (dict(feature_size=MAX_FEATURE_SIZE + 1), dict(feature_size=-1), dict(feature_dtype="int8"),
                dict(features=3)):
        with pytest.raises(ValueError):
            KVLayout.from_dict({**layout.to_dict(), **bad})
    plain = KVLayout(**{**layout.to_dict(), "features": "", "feature_size": 0, "feature_dtype": ""})
    with pytest.raises(ValueError, match="speculative features sent with the KV differ"):
        pair_ranks(layout, plain)
