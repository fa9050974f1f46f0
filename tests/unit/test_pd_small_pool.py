"""A decode server with a tiny KV pool (96 tokens): every request ends, and both servers go idle.

A request the decode pool can hold runs to the same output as a unified server with the same pool
(its max_new_tokens clamped the same way); one it can never hold is refused with a 400 at once,
and the prefill half is told (an abort for its room) instead of waiting for its bootstrap timeout:
without that the pair stayed busy for the whole timeout (2000 steps were not enough). Each case
ends with run_until_idle's strict idle check on both sides (pd_utils.check_idle).
"""

from __future__ import annotations

import pytest

from pd_utils import PDFakeWorker, unified

POOL = 96


def make_small_pair(make_pair, page: int = 1, reserve: int = 4, radix: bool = True):
    decode_kwargs = dict(page_size=page, max_total_tokens=POOL, num_reserved_decode_tokens=reserve,
                         disable_radix_cache=not radix)
    return make_pair(prefill_worker=PDFakeWorker(page_size=page),
                     decode_worker=PDFakeWorker(max_total_tokens=POOL, page_size=page, extra_rows=32),
                     prefill_kwargs=dict(page_size=page), decode_kwargs=decode_kwargs)


def oracle(prompt, page: int, **sampling) -> list:
    """A unified server whose pool is the decode server's: the same clamp, the same tokens."""
    h = unified(worker=PDFakeWorker(max_total_tokens=POOL, page_size=page), page_size=page, max_total_tokens=POOL)
    try:
        rid = h.submit(prompt, **sampling)
        h.run_until_idle()
        return h.outputs[rid].output_ids
    finally:
        h.scheduler.shutdown()


def assert_prefill_told(p, rid: str) -> None:
    reason = p.prefill.outputs[rid].finished_reason
    assert reason["type"] == "abort" and "refused by the decode server" in reason["message"], reason


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("radix", [True, False], ids=["radix", "no-radix"])
@pytest.mark.parametrize("max_new", [1, 8, 13, 16, 128])
def test_a_prompt_that_fits_runs_like_a_unified_server_with_the_same_pool(make_pair, page, radix, max_new):
    # 79 + 13 = 92 tokens fit with the reserve of 4; 16 and 128 do not and are clamped, as a
    # unified server clamps them (max_req_len and the pool), never left waiting for memory.
    p = make_small_pair(make_pair, page=page, radix=radix)
    prompt = list(range(1, 80))
    rid = p.submit(prompt, max_new_tokens=max_new)
    p.run_until_idle(max_steps=200)
    out = p.decode.outputs[rid]
    expected = oracle(prompt, page, max_new_tokens=max_new)
    assert out.output_ids == expected
    assert out.finished_reason == {"type": "length", "length": len(expected)}
    if page == 1:
        assert len(expected) == min(max_new, POOL - 1 - len(prompt) - 1)


@pytest.mark.parametrize("page", [1, 16])
def test_a_prompt_the_reserve_leaves_no_room_for_is_refused_and_the_prefill_told(make_pair, page):
    # The default reserve (512 tokens per request) exceeds the whole pool: nothing can ever be
    # admitted, so the decode refuses at once, and the prefill drops its half within a few steps.
    p = make_small_pair(make_pair, page=page, reserve=512)
    rid = p.submit(list(range(1, 80)), max_new_tokens=8)
    p.step()
    reason = p.decode.outputs[rid].finished_reason
    assert reason["status_code"] == 400 and "does not fit" in reason["message"]
    p.run_until_idle(max_steps=20)
    assert_prefill_told(p, rid)


@pytest.mark.parametrize("length", [90, 95, 200])
def test_a_prompt_longer_than_the_decode_pool_is_refused_and_the_prefill_told(make_pair, length):
    p = make_small_pair(make_pair)
    rid = p.submit(list(range(1, length + 1)), max_new_tokens=4)
    p.step()
    reason = p.decode.outputs[rid].finished_reason
    assert reason["status_code"] == 400 and "exceeds the maximum allowed length" in reason["message"]
    p.run_until_idle(max_steps=20)
    assert_prefill_told(p, rid)
    # The decode server still serves what fits.
    prompt = list(range(1, 61))
    ok = p.submit(prompt, max_new_tokens=8)
    p.run_until_idle(max_steps=200)
    assert p.decode.outputs[ok].output_ids == oracle(prompt, 1, max_new_tokens=8)


def test_several_requests_on_the_small_pool_wait_or_retract_and_all_finish(make_pair):
    # Three 40-token prompts with 30 new tokens each: at most one or two fit at a time, so the
    # later ones wait in the PreallocQueue (or the running ones are retracted); all must finish.
    p = make_small_pair(make_pair, reserve=0)
    prompts = [[i + 2] * 40 for i in range(3)]
    rids = [p.submit(pr, max_new_tokens=30) for pr in prompts]
    p.run_until_idle(max_steps=500)
    assert [p.decode.outputs[r].output_ids for r in rids] == [oracle(pr, 1, max_new_tokens=30) for pr in prompts]


def test_a_duplicate_room_refused_on_decode_does_not_abort_the_live_request(make_pair):
    # The refusal notice is never sent for a room a live request holds: it would abort that one.
    p = make_small_pair(make_pair)
    prompt = list(range(1, 41))
    live = p.submit(prompt, max_new_tokens=8, bootstrap_room=77)
    p.step()
    # Same room, refused on the decode only (too long): it must not touch the live transfer.
    bad = p.submit(list(range(1, 101)), to_prefill=False, max_new_tokens=4, bootstrap_room=77)
    p.run_until_idle(max_steps=200)
    assert p.decode.outputs[bad].finished_reason["status_code"] == 400
    assert p.decode.outputs[live].output_ids == oracle(prompt, 1, max_new_tokens=8)


def test_refusal_notices_are_bounded(make_pair, monkeypatch):
    # Beyond the cap a refused request's prefill half is not told (it ends at its bootstrap
    # timeout, as in SGLang): the decode server keeps no unbounded list of room entries.
    from engine.disaggregation import decode_refusal

    monkeypatch.setattr(decode_refusal, "MAX_PENDING_NOTICES", 1)
    p = make_small_pair(make_pair)
    told = p.submit(list(range(1, 101)), max_new_tokens=4)
    untold = p.submit(list(range(1, 101)), max_new_tokens=4)  # refused in the same step: no room left
    for _ in range(20):
        p.step()
    assert p.decode.outputs[told].finished_reason["status_code"] == 400
    assert p.decode.outputs[untold].finished_reason["status_code"] == 400
    assert_prefill_told(p, told)
    assert p.prefill.outputs[untold].finished_reason is None  # still waiting for a destination
    p.prefill.abort(untold)
    p.run_until_idle(max_steps=20)
