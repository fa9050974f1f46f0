"""PD on the real built-in model, in process: a prefill and a decode scheduler (loopback backend)
against a unified scheduler on the same weights, under several configurations of either side.

Greedy outputs are equal token for token; the decode side's output logprobs (the first one came
in the metadata row) and the prefill side's input logprobs equal the unified server's; the decode
side never runs an extend forward.
"""

from __future__ import annotations

import pytest

from pd_utils import PDPair
from sched_utils import Harness

N_NEW = 10


@pytest.fixture(scope="module")
def model():
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["Hello world, this is a test of the engine.", "The quick brown fox", "def f(x):\n    return x * 2",
             "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "Bonjour à tous"]
    prompts = [tok(t).input_ids for t in texts]
    prompts.append(prompts[0] + prompts[2][1:])  # shares a prefix with prompt 0 (a prefill cache hit)
    return path, tok, prompts


def _worker(path, total=4096, page=1, extra=None, **kwargs):
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=total, page_size=page, max_running_requests=16,
                      **(extra or {}))
    return TpModelWorker(args)


SAMPLING = dict(max_new_tokens=N_NEW, ignore_eos=True, return_logprob=True, logprob_start_len=0, top_logprobs_num=3)


@pytest.fixture(scope="module")
def oracle(model):
    path, tok, prompts = model
    h = Harness(worker=_worker(path), tokenizer=tok, max_total_tokens=4096)
    rids = [h.submit(p, rid=f"u{i}", **SAMPLING) for i, p in enumerate(prompts)]
    h.run_until_idle()
    out = [h.outputs[r] for r in rids]
    h.scheduler.shutdown()
    return out


CONFIGS = {
    "default": dict(),
    "overlap": dict(overlap_prefill=True, overlap_decode=True),
    "page16": dict(prefill_page=16, decode_page=16),
    "pages-differ": dict(prefill_page=16, decode_page=1),  # tokens move, not pages
    "prefill-chunked": dict(prefill_kwargs=dict(chunked_prefill_size=8)),
    "decode-retracts": dict(decode_total=64, overlap_decode=True, decode_kwargs=dict(num_reserved_decode_tokens=0)),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pd_equals_unified_on_the_builtin_model(model, oracle, name):
    path, tok, prompts = model
    cfg = dict(CONFIGS[name])
    prefill_page, decode_page = cfg.pop("prefill_page", 1), cfg.pop("decode_page", 1)
    decode_total = cfg.pop("decode_total", 4096)
    prefill_kwargs = dict(cfg.pop("prefill_kwargs", {}), page_size=prefill_page, max_total_tokens=4096)
    decode_kwargs = dict(cfg.pop("decode_kwargs", {}), page_size=decode_page, max_total_tokens=decode_total)
    decode_worker = _worker(path, decode_total, decode_page, extra=dict(disaggregation_mode="decode"))
    pair = PDPair(prefill_worker=_worker(path, 4096, prefill_page), decode_worker=decode_worker, tokenizer=tok,
                  prefill_kwargs=prefill_kwargs, decode_kwargs=decode_kwargs, **cfg)
    try:
        rids = [pair.submit(p, rid=f"pd{i}", **SAMPLING) for i, p in enumerate(prompts)]
        retracted = pair.run_counting_retractions()
        for rid, expected, prompt in zip(rids, oracle, prompts):
            decoded = pair.decode.outputs[rid]
            assert decoded.output_ids == expected.output_ids
            # Decode: the output logprobs (values of the unified run, first one via metadata).
            assert decoded.logprobs == pytest.approx(expected.logprobs[:N_NEW], abs=1e-4)
            # Prefill: its first token's logprob, then the prompt's input logprobs.
            prefilled = pair.prefill.outputs[rid]
            assert prefilled.logprobs[0] == pytest.approx(expected.logprobs[0], abs=1e-4)
            assert prefilled.logprobs[1:] == pytest.approx(expected.logprobs[N_NEW:], abs=1e-4)
            assert len(prefilled.logprobs[1:]) == len(prompt) - 1
        assert pair.decode.scheduler.num_extend_tokens_computed == 0
        if name == "decode-retracts":
            assert retracted >= 1, "the configuration must make the decode side retract"
    finally:
        pair.close()


# Constrained decoding on PD (SGLang's way): the prefill samples the first token under the grammar,
# the decode side compiles the same grammar while the KV transfers, accepts the handed-over token
# and decodes on. The unified scheduler on the same weights is the oracle.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
CONSTRAINTS = [
    {"regex": r"[a-z]{2,5}( [a-z]{2,5}){1,3}\."},
    {"json_schema": __import__("json").dumps(SCHEMA)},
    {"ebnf": 'root ::= "yes" | "no" | ("maybe " [0-9] [0-9])'},
    {"regex": "(red|green|blue)"},
]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_constrained_pd_equals_unified(model, overlap):
    pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar")
    path, tok, prompts = model
    extra = dict(constrained_json_disable_any_whitespace=True)
    h = Harness(worker=_worker(path), tokenizer=tok, max_total_tokens=4096, **extra)
    pair = PDPair(prefill_worker=_worker(path), decode_worker=_worker(path, extra=dict(disaggregation_mode="decode")),
                  tokenizer=tok, overlap_prefill=overlap, overlap_decode=overlap,
                  prefill_kwargs=dict(max_total_tokens=4096, **extra),
                  decode_kwargs=dict(max_total_tokens=4096, **extra))
    try:
        sampling = dict(max_new_tokens=24)
        cases = [(prompts[i % len(prompts)], c) for i, c in enumerate(CONSTRAINTS)]
        expected_rids = [h.submit(p, rid=f"u{i}", **sampling, **c) for i, (p, c) in enumerate(cases)]
        h.run_until_idle()
        rids = [pair.submit(p, rid=f"pd{i}", **sampling, **c) for i, (p, c) in enumerate(cases)]
        pair.run_until_idle()
        for rid, expected_rid in zip(rids, expected_rids):
            expected = h.outputs[expected_rid]
            assert expected.finished_reason["type"] in ("stop", "length"), expected.finished_reason
            decoded = pair.decode.outputs[rid]
            assert decoded.finished_reason == expected.finished_reason
            assert decoded.output_ids == expected.output_ids
        assert len(pair.decode.scheduler.grammar_manager) == 0
        # The JSON answer parses against its schema: the grammar really ran on both sides.
        import json

        answer = json.loads(tok.decode(pair.decode.outputs[rids[1]].output_ids, skip_special_tokens=True))
        assert set(answer) == {"name", "age"}
    finally:
        h.scheduler.shutdown()
        pair.close()


def test_a_constraint_that_does_not_compile_is_a_400_on_both_sides(model):
    # The prefill refuses it and sends nothing; the decode side must not wait for a transfer
    # timeout: its own compilation fails the request with the same 400.
    pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar")
    path, tok, prompts = model
    pair = PDPair(prefill_worker=_worker(path), decode_worker=_worker(path, extra=dict(disaggregation_mode="decode")),
                  tokenizer=tok, prefill_kwargs=dict(max_total_tokens=4096),
                  decode_kwargs=dict(max_total_tokens=4096))
    try:
        rid = pair.submit(prompts[0], rid="bad", max_new_tokens=4, regex="(unclosed")
        good = pair.submit(prompts[1], rid="good", max_new_tokens=4, regex="[a-z]{4}")
        pair.run_until_idle(max_steps=500)
        assert not pair.busy()
        for side in (pair.prefill, pair.decode):
            reason = side.outputs[rid].finished_reason
            assert reason["status_code"] == 400 and "regex" in reason["message"].lower(), reason
        assert pair.decode.outputs[good].finished_reason["type"] in ("stop", "length")  # its neighbour runs on
    finally:
        pair.close()
