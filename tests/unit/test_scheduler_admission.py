"""Admission (PrefillAdder) budgets as SGLang's, and the waiting-queue limit with retraction."""

from __future__ import annotations

from typing import List

import pytest
import torch

from engine.scheduler.req import CLIP_MAX_NEW_TOKENS_ESTIMATION, Req
from engine.scheduler.schedule_batch import ScheduleBatch
from engine.scheduler.schedule_policy import AddReqResult, PrefillAdder
from engine.mem_cache.allocator import TokenToKVPoolAllocator
from engine.sampling.sampling_params import SamplingParams
from sched_utils import FakeWorker, Harness


def prompt(n: int, start: int = 0) -> List[int]:
    return [(start + i) % 900 for i in range(n)]


def make_req(rid: str, input_len: int, max_new: int, generated: int = 0, ignore_eos: bool = False) -> Req:
    req = Req(rid, prompt(input_len), SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos))
    req.output_ids = [1] * generated
    req.init_next_round_input(None)
    return req


def adder(pool: int = 100_000, running: List[Req] = (), ratio: float = 0.7, chunk=None) -> PrefillAdder:
    allocator = TokenToKVPoolAllocator(pool, torch.float32, "cpu", None)
    return PrefillAdder(1, None, allocator, list(running), ratio, rem_input_tokens=16384, rem_chunk_tokens=chunk)


def test_admitted_request_is_charged_its_clipped_max_new_tokens_not_what_remains():
    # SGLang's PrefillAdder: extend + min(max_new_tokens, CLIP) for an admitted request, even one
    # that already generated most of it (a retracted request), so re-admission is not eager.
    a = adder()
    before = a.rem_total_tokens
    retracted = make_req("r", input_len=10, max_new=100, generated=90)
    assert a.add_one_req(retracted) == AddReqResult.CONTINUE
    assert before - a.rem_total_tokens == retracted.extend_input_len + 100
    huge = make_req("h", input_len=10, max_new=100_000)
    before = a.rem_total_tokens
    a.add_one_req(huge)
    assert before - a.rem_total_tokens == 10 + CLIP_MAX_NEW_TOKENS_ESTIMATION


def test_the_last_chunk_is_charged_the_clipped_max_new_tokens():
    a = adder(chunk=64)
    req = make_req("c", input_len=20, max_new=100, generated=30)
    before = a.rem_total_tokens
    assert a.add_chunked_req(req) is None
    assert before - a.rem_total_tokens == req.extend_input_len + 100


def test_running_requests_reserve_what_remains_times_the_ratio():
    running = [make_req("a", 10, max_new=100, generated=40), make_req("b", 10, max_new=10_000, generated=4)]
    assert adder(running=running, ratio=0.5).rem_total_token_offset == pytest.approx(
        0.5 * (60 + CLIP_MAX_NEW_TOKENS_ESTIMATION))
    # The fit test itself is on what remains: 85 + 55 fits in 160 slots (85 + 100 would not).
    a = adder(pool=160, running=[])
    near_end = make_req("r", input_len=40, max_new=100, generated=45)
    a.add_one_req(near_end)
    assert a.can_run_list == [near_end]


def count_retractions(monkeypatch) -> List[int]:
    calls: List[int] = []
    orig = ScheduleBatch.retract_decode

    def spy(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        calls.append(len(out[0]))
        return out

    monkeypatch.setattr(ScheduleBatch, "retract_decode", spy)
    return calls


def test_ignore_eos_requests_without_the_radix_cache_are_admitted_only_if_all_fit(monkeypatch):
    # SGLang's add_one_req_ignore_eos: ignore_eos requests use all of max_new_tokens, so without a
    # radix cache the adder simulates the running requests to the end and admits a new one only
    # if the pool never runs out. Four requests of 20 + 80 tokens in a 380-token pool: three run,
    # the fourth waits for one to finish, nothing is retracted. The ratio-based estimate (0.7 of
    # what remains) would admit the fourth at once, and retract later.
    retractions = count_retractions(monkeypatch)

    def run(total: int):
        h = Harness(worker=FakeWorker(max_total_tokens=total), disable_radix_cache=True)
        rids = [h.submit(prompt(20, 100 * i), max_new_tokens=80, ignore_eos=True) for i in range(4)]
        h.step()
        h.run_until_idle()
        return [h.outputs[r].output_ids for r in rids]

    reference = run(4096)
    assert run(380) == reference
    assert retractions == []


def test_retracted_requests_go_back_to_the_queue_even_when_it_is_full(monkeypatch):
    # Decision (differs from SGLang, which aborts a retracted request with 503 when the queue is
    # full): a retracted request was admitted and may have streamed output already; the queue
    # limit is backpressure on new arrivals, so it never turns memory pressure into a failure of
    # a running request. Retracted requests count towards the limit for new arrivals.
    retractions = count_retractions(monkeypatch)

    def run(total: int, limit=None):
        h = Harness(worker=FakeWorker(max_total_tokens=total), max_queued_requests=limit)
        s = h.scheduler
        rids = []
        for i in range(4):
            rids.append(h.submit(prompt(10 + i, 100 * i), max_new_tokens=100, ignore_eos=True))
            h.step()  # one at a time: each arrives to a queue under the limit
        over_limit_with_retracted = False
        late = None
        while s.has_work():
            h.step()
            if limit is not None and len(s.waiting_queue) > limit:
                over_limit_with_retracted |= any(r.retraction_count for r in s.waiting_queue)
                if late is None:
                    late = h.submit(prompt(5, 800), max_new_tokens=3)
        h.step()
        return h, rids, late, over_limit_with_retracted

    reference, rids, _, _ = run(4096)
    h, _, late, over_limit = run(300, limit=1)
    assert retractions, "the workload must retract"
    assert over_limit, "a retracted request must have been re-queued into a full queue"
    assert h.outputs[late].finished_reason == {"type": "abort", "message": "The request queue is full.",
                                               "status_code": 503, "err_type": "ServiceUnavailableError"}
    for rid in rids:
        assert h.outputs[rid].output_ids == reference.outputs[rid].output_ids
        assert h.outputs[rid].finished_reason == {"type": "length", "length": 100}
