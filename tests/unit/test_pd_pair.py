"""PD scenarios on in-process prefill/decode pairs over the loopback backend (single-stepped).

The oracle is a unified scheduler on the same fake worker: its next token is the sum of the
request's whole KV, so a PD output equals the unified one only if every transferred (or restored)
KV entry is right. After every step the pair checks the §11.4 invariants (rows, slots, metadata
rows, rooms), and at the end both sides must be back at the empty-pool baseline with no transfer
state left (pd_utils.check_idle).
"""

from __future__ import annotations

import pytest

from engine.disaggregation.fake import fake_first_token
from pd_utils import EOS, VOCAB, PDFakeWorker, unified

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18], [3] * 20, [40, 41], list(range(50, 90)), [7]]


def oracle(prompts, **sampling):
    h = unified()
    rids = [h.submit(p, rid=f"o{i}", **sampling) for i, p in enumerate(prompts)]
    h.run_until_idle()
    return [h.outputs[r].output_ids for r in rids]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_happy_path_single(make_pair, overlap):
    p = make_pair(overlap_prefill=overlap, overlap_decode=overlap)
    rid = p.submit(PROMPTS[1], max_new_tokens=16)
    p.run_until_idle()
    out = p.decode.outputs[rid]
    assert out.output_ids == oracle([PROMPTS[1]], max_new_tokens=16)[0]
    assert out.finished_reason == {"type": "length", "length": 16}
    assert p.prefill.outputs[rid].finished_reason == {"type": "length", "length": 0}
    # The decode side computed no prompt position: all of them came by transfer.
    assert p.decode.scheduler.num_extend_tokens_computed == 0
    state = p.decode.scheduler.internal_state()["disaggregation"]
    assert state["metrics"]["num_transferred_prompt_tokens"] == len(PROMPTS[1])


@pytest.mark.parametrize("page_size", [1, 4])
def test_happy_path_concurrent_fifo(make_pair, page_size):
    prompts = PROMPTS * 3
    p = make_pair(prefill_worker=PDFakeWorker(page_size=page_size), decode_worker=PDFakeWorker(page_size=page_size,
                                                                                        extra_rows=32),
             prefill_kwargs=dict(page_size=page_size), decode_kwargs=dict(page_size=page_size))
    rids = [p.submit(pr, max_new_tokens=6 + i % 5) for i, pr in enumerate(prompts)]
    order = []
    published = set()
    while p.busy():
        p.step()
        for dreq in p.decode.scheduler.disagg.transfer.queue:
            if dreq.publish_after is None and dreq.req.rid not in published:
                published.add(dreq.req.rid)
                order.append(dreq.req.rid)
    p.run_until_idle()
    expected = [oracle([pr], max_new_tokens=6 + i % 5)[0] for i, pr in enumerate(prompts)]
    assert [p.decode.outputs[r].output_ids for r in rids] == expected
    assert order == [r for r in rids if r in published]  # FIFO admission


def test_streaming_first_chunk_is_the_handoff_token(make_pair):
    p = make_pair()
    rid = p.submit(PROMPTS[2], max_new_tokens=8, stream=True)
    p.run_until_idle()
    out = p.decode.outputs[rid]
    expected = oracle([PROMPTS[2]], max_new_tokens=8)[0]
    assert out.emissions[0] == expected[:1]
    assert sum(out.emissions, []) == expected


def test_quick_finish_max_new_tokens_one(make_pair):
    p = make_pair()
    rid = p.submit(PROMPTS[0], max_new_tokens=1)
    p.run_until_idle()
    assert p.decode.outputs[rid].output_ids == oracle([PROMPTS[0]], max_new_tokens=1)[0]
    assert p.decode.worker.records == []  # finished at the prebuilt stage: no decode step ran


def test_quick_finish_on_eos(make_pair):
    eos_first = PDFakeWorker(next_token=lambda last: EOS)
    p = make_pair(prefill_worker=eos_first, decode_worker=PDFakeWorker(extra_rows=32))
    rid = p.submit(PROMPTS[3], max_new_tokens=10)
    p.run_until_idle()
    assert p.decode.outputs[rid].output_ids == [EOS]
    assert p.decode.outputs[rid].finished_reason["type"] == "stop"
    assert p.decode.worker.records == []


def test_max_new_tokens_zero_returns_no_token(make_pair):
    p = make_pair()
    rid = p.submit(PROMPTS[0], max_new_tokens=0)
    p.run_until_idle()
    assert p.decode.outputs[rid].output_ids == []
    assert p.decode.outputs[rid].finished_reason == {"type": "length", "length": 0}


def test_fake_backend_decode_alone():
    from pd_utils import pd_args
    from sched_utils import Harness

    h = Harness(worker=PDFakeWorker(extra_rows=8), transfer_network=None,
                **pd_args("decode", disaggregation_transfer_backend="fake"))
    try:
        h.submit([1, 2, 3], rid="fake-1", max_new_tokens=4)  # no bootstrap fields at all
        h.submit([1, 2, 3], rid="fake-2", max_new_tokens=4, bootstrap_host="2.2.2.2", bootstrap_port=1,
                 bootstrap_room=9)
        h.run_until_idle()
        for rid in ("fake-1", "fake-2"):
            assert h.outputs[rid].output_ids[0] == fake_first_token(rid, VOCAB)
            assert len(h.outputs[rid].output_ids) == 4
    finally:
        h.scheduler.shutdown()


@pytest.mark.parametrize("extra", [dict(return_hidden_states=True), dict(return_logprob=True, token_ids_logprob=[3])])
def test_per_request_extras_that_would_need_more_metadata_are_refused(make_pair, extra):
    p = make_pair()
    rid = p.submit([1, 2, 3], max_new_tokens=4, **extra)
    p.run_until_idle()
    assert "not supported with PD" in p.decode.outputs[rid].finished_reason["message"]
