"""Speculative decoding on a PD decode server (the prefill server never drafts), in process: a
prefill and a decode scheduler on the built-in model (loopback transfer) against a unified scheduler
without speculation.

Greedy outputs are equal token for token and the decode side's target never runs an extend forward.
With the target as its own draft (STANDALONE), every draft is accepted: the draft built its own K/V
of each transferred prompt (its catch-up from the prompt tokens) exactly, after retractions too.
"""

from __future__ import annotations

from typing import Dict

import pytest

from pd_utils import PDPair
from sched_utils import Harness

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
        retracted = 0
        while pair.busy():
            pair.step()
            retracted = max(retracted, len(pair.decode.scheduler.disagg.prealloc.retracted_queue))
        pair.run_until_idle()
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
    from engine.server_args import ServerArgs, ServerArgsError
    from pd_utils import pd_args

    prefill = ServerArgs(device="cpu", speculative_algorithm="NGRAM", **pd_args("prefill"))
    assert prefill.speculative_algorithm is None and not prefill.disable_overlap_schedule  # ignored there
    decode = ServerArgs(device="cpu", speculative_algorithm="NGRAM", **pd_args("decode"))
    assert decode.speculative_algorithm == "NGRAM"
    for algo in ("EAGLE", "EAGLE3"):
        with pytest.raises(ServerArgsError, match="head reads the target's hidden states of the prompt"):
            ServerArgs(device="cpu", speculative_algorithm=algo, speculative_draft_model_path="/nonexistent",
                       **pd_args("decode"))
