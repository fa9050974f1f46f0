"""The scheduler's control plane and priority scheduling, in-process on the fake worker.

Oracle: the fake worker's tokens depend only on each request's own sequence (next = last + 1), so
a request that is paused, retracted, preempted or delayed must end with exactly the output of an
undisturbed run; and the idle memory self-check (strict) proves nothing leaked.
"""

from __future__ import annotations

from typing import Dict, List

import pytest

from engine.io_struct import (
    ContinueGenerationReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
)
from sched_utils import FakeWorker, Harness

PROMPTS = [[i, i + 3, i + 7] for i in range(1, 6)]
N_NEW = 12


def reference(prompts: List[List[int]], **kwargs) -> List[List[int]]:
    h = Harness(**kwargs)
    rids = [h.submit(p, max_new_tokens=N_NEW) for p in prompts]
    h.run_until_idle()
    return [h.outputs[r].output_ids for r in rids]


def kv_free(h: Harness) -> bool:
    s = h.scheduler
    return (s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size()
            == s.max_total_num_tokens and s.tree_cache.protected_size() == 0)


# ---------------------------------------------------------------------- pause / continue
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_then_continue_loses_no_request(overlap, mode):
    expected = reference(PROMPTS + [[40, 41]])
    h = Harness(overlap=overlap)
    rids = [h.submit(p, max_new_tokens=N_NEW) for p in PROMPTS]
    for _ in range(4):
        h.step()
    reply = h.control(PauseGenerationReqInput(mode=mode))
    assert reply.success and reply.num_paused_requests == len(PROMPTS)
    s = h.scheduler
    if mode == "retract":
        # Every request is back in the queue with its output, holding no KV.
        assert s.running_batch.is_empty() and s.last_batch is None and s.chunked_req is None
        assert sorted(r.rid for r in s.waiting_queue) == sorted(rids)
        assert all(r.req_pool_idx is None and r.output_ids for r in s.waiting_queue)
        assert kv_free(h)
    else:
        assert not s.running_batch.is_empty()  # left exactly as it was
    forwards = len(h.worker.records)
    late = h.submit([40, 41], max_new_tokens=N_NEW)  # arrives while paused: waits
    for _ in range(3):
        h.step()
    assert len(h.worker.records) == forwards and not h.outputs[late].output_ids
    assert not s.has_work()  # the loop sleeps instead of spinning
    assert h.control(ContinueGenerationReqInput()).success
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids + [late]] == expected
    assert all(h.outputs[r].finished_reason["type"] == "length" for r in rids + [late])


def test_retract_pause_takes_the_chunked_request_back_too():
    prompt = list(range(1, 30))
    expected = reference([prompt], chunked_prefill_size=8)
    h = Harness(chunked_prefill_size=8)
    rid = h.submit(prompt, max_new_tokens=N_NEW)
    h.step()
    h.step()
    assert h.scheduler.chunked_req is not None  # mid-way through its chunks
    h.control(PauseGenerationReqInput(mode="retract"))
    assert h.scheduler.chunked_req is None and kv_free(h)
    h.control(ContinueGenerationReqInput())
    h.run_until_idle()
    assert h.outputs[rid].output_ids == expected[0]


def test_an_abort_while_paused_by_retraction_is_answered_at_once():
    h = Harness()
    rid = h.submit([5, 6], max_new_tokens=N_NEW)
    h.step()
    h.control(PauseGenerationReqInput(mode="retract"))
    h.abort(rid)
    h.step()
    assert h.outputs[rid].finished_reason["type"] == "abort"
    h.control(ContinueGenerationReqInput())
    h.run_until_idle()


def test_pause_refuses_an_unknown_mode():
    h = Harness()
    reply = h.control(PauseGenerationReqInput(mode="sleep"))
    assert not reply.success and "not one of" in reply.message
    assert not h.scheduler.control.paused


# ---------------------------------------------------------------------- memory
def test_release_is_refused_while_requests_run_and_idempotent_when_idle():
    h = Harness()
    rid = h.submit([1, 2, 3], max_new_tokens=N_NEW)
    h.step()
    reply = h.control(ReleaseMemoryOccupationReqInput())
    assert not reply.success and "running" in reply.message
    h.run_until_idle()

    assert h.control(ReleaseMemoryOccupationReqInput()).success
    assert h.control(ReleaseMemoryOccupationReqInput(tags=["weights"])).message == \
        "Released nothing (already released)."
    # No tags: every tag SGLang has (constants.GPU_MEMORY_ALL_TYPES).
    all_tags = sorted(["kv_cache", "weights", "weights_drafter", "cuda_graph"])
    assert h.worker.control_calls == [("release", all_tags), ("release", [])]
    waiting = h.submit([1, 2, 3], max_new_tokens=N_NEW)
    forwards = len(h.worker.records)
    h.step()
    assert len(h.worker.records) == forwards  # nothing runs without memory
    assert h.control(ResumeMemoryOccupationReqInput(tags=["kv_cache"])).success
    h.step()
    assert len(h.worker.records) == forwards  # the weights are still released
    assert h.control(ResumeMemoryOccupationReqInput()).message == "Resumed weights, weights_drafter, cuda_graph."
    assert h.control(ResumeMemoryOccupationReqInput()).message == "Resumed nothing (not released)."
    h.run_until_idle()
    assert h.outputs[waiting].output_ids == h.outputs[rid].output_ids


@pytest.mark.parametrize("tag", ["cuda_graph", "weights_drafter"])
def test_releasing_what_forwards_do_not_need_keeps_generation_going(tag):
    """slime releases "cuda_graph" with the rest; alone, it leaves eager forwards running."""
    h = Harness()
    reply = h.control(ReleaseMemoryOccupationReqInput(tags=[tag]))
    assert reply.success and reply.message == f"Released {tag}."
    rid = h.submit([1, 2, 3], max_new_tokens=N_NEW)
    h.run_until_idle()
    assert len(h.outputs[rid].output_ids) == N_NEW
    assert h.control(ResumeMemoryOccupationReqInput(tags=[tag])).message == f"Resumed {tag}."
    assert h.worker.control_calls == [("release", [tag]), ("resume", [tag])]


def test_release_refuses_unknown_tags():
    h = Harness()
    reply = h.control(ReleaseMemoryOccupationReqInput(tags=["gpu"]))
    assert not reply.success and "Unknown memory tag" in reply.message
    assert not h.scheduler.control.released


# ---------------------------------------------------------------------- weights (refusals)
def test_weight_update_waits_for_no_kv_holder_unless_no_flush():
    h = Harness()
    h.submit([1, 2, 3], max_new_tokens=N_NEW)
    h.step()
    reply = h.control(UpdateWeightFromDiskReqInput(model_path="/new"))
    assert not reply.success and "hold KV cache" in reply.message
    assert h.worker.control_calls == []
    assert h.control(UpdateWeightFromDiskReqInput(model_path="/new", flush_cache=False)).success
    h.run_until_idle()


def test_weight_update_while_paused_by_retraction_flushes_and_resumes():
    expected = reference(PROMPTS)
    h = Harness()
    rids = [h.submit(p, max_new_tokens=N_NEW) for p in PROMPTS]
    for _ in range(3):
        h.step()
    h.control(PauseGenerationReqInput(mode="retract"))
    assert h.scheduler.tree_cache.evictable_size() > 0
    assert h.control(UpdateWeightFromDiskReqInput(model_path="/new")).success
    assert h.scheduler.tree_cache.evictable_size() == 0  # flushed: computed with the old weights
    h.control(ContinueGenerationReqInput())
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected


# ---------------------------------------------------------------------- priority scheduling
def finish_positions(h: Harness, rids: List[str]) -> Dict[str, int]:
    return {rid: h.finish_order.index(rid) for rid in rids}


def test_a_high_priority_request_behind_a_long_queue_finishes_first_of_the_queue():
    h = Harness(enable_priority_scheduling=True, max_running_requests=1)
    low = [h.submit([1], max_new_tokens=N_NEW, priority=0)]
    h.step()
    low += [h.submit([i], max_new_tokens=N_NEW, priority=0) for i in range(2, 7)]
    high = h.submit([50], max_new_tokens=N_NEW, priority=5)  # within the threshold: no preemption
    h.run_until_idle()
    order = finish_positions(h, low + [high])
    assert order[low[0]] == 0  # it was running already
    assert order[high] == 1
    assert [order[r] for r in low[1:]] == [2, 3, 4, 5, 6]  # then first come, first served


def test_a_much_more_urgent_request_preempts_the_running_one():
    expected = reference([[1], [50]])
    h = Harness(enable_priority_scheduling=True, max_running_requests=1)
    low = h.submit([1], max_new_tokens=N_NEW, priority=0)
    h.step()
    h.step()
    high = h.submit([50], max_new_tokens=N_NEW, priority=100)
    h.run_until_idle()
    assert h.finish_order == [high, low]
    assert [h.outputs[low].output_ids, h.outputs[high].output_ids] == expected


@pytest.mark.parametrize("flags", [dict(disable_priority_preemption=True),
                                   dict(priority_scheduling_preemption_threshold=200)])
def test_no_preemption_when_disabled_or_under_the_threshold(flags):
    h = Harness(enable_priority_scheduling=True, max_running_requests=1, **flags)
    low = h.submit([1], max_new_tokens=N_NEW, priority=0)
    h.step()
    high = h.submit([50], max_new_tokens=N_NEW, priority=100)
    h.run_until_idle()
    assert h.finish_order == [low, high]


def test_low_priority_values_first():
    h = Harness(enable_priority_scheduling=True, schedule_low_priority_values_first=True, max_running_requests=1)
    first = h.submit([1], max_new_tokens=4, priority=0)
    h.step()
    later = h.submit([2], max_new_tokens=4, priority=9)
    urgent = h.submit([3], max_new_tokens=4, priority=1)
    h.run_until_idle()
    assert h.finish_order == [first, urgent, later]


def test_a_full_queue_drops_its_least_urgent_request_for_a_more_urgent_one():
    h = Harness(enable_priority_scheduling=True, max_running_requests=1, max_queued_requests=2)
    running = h.submit([1], max_new_tokens=N_NEW, priority=0)
    h.step()
    b = h.submit([2], max_new_tokens=N_NEW, priority=0)
    c = h.submit([3], max_new_tokens=N_NEW, priority=0)
    d = h.submit([4], max_new_tokens=N_NEW, priority=5)  # evicts c (least urgent, newest)
    e = h.submit([5], max_new_tokens=N_NEW, priority=0)  # beats nobody: refused
    h.run_until_idle()
    reasons = {r: h.outputs[r].finished_reason for r in (running, b, c, d, e)}
    assert reasons[c]["status_code"] == 503 and reasons[c]["message"] == "The request is aborted by a higher priority request."
    assert reasons[e]["status_code"] == 503 and reasons[e]["message"] == "The request queue is full."
    assert all(reasons[r]["type"] == "length" for r in (running, b, d))


def test_priority_is_refused_or_ignored_when_priority_scheduling_is_off():
    h = Harness(abort_on_priority_when_disabled=True)
    rid = h.submit([1], priority=3)
    h.run_until_idle()
    assert h.outputs[rid].finished_reason["status_code"] == 503
    assert "priority is disabled" in h.outputs[rid].finished_reason["message"]
    h = Harness()
    rid = h.submit([1], priority=3)
    h.run_until_idle()
    assert h.outputs[rid].finished_reason["type"] == "length"


def test_requests_without_priority_come_last_or_take_the_default():
    h = Harness(enable_priority_scheduling=True)
    h.submit([1])
    assert h.step().reqs[0].priority == -(2**63)  # the least urgent value
    h.run_until_idle()
    h = Harness(enable_priority_scheduling=True, default_priority_value=7)
    h.submit([1])
    assert h.step().reqs[0].priority == 7
    h.run_until_idle()


# ---------------------------------------------------------------------- per-request extras
def test_cache_salt_and_extra_key_separate_cached_prefixes():
    h = Harness()
    prompt = list(range(1, 21))

    def cached(**namespace) -> int:
        rid = h.submit(prompt, max_new_tokens=2, **namespace)
        h.run_until_idle()
        return h.outputs[rid].cached_tokens

    assert cached(cache_salt="a") == 0
    assert cached(cache_salt="a") == len(prompt) - 1  # a full hit within the salt
    assert cached(cache_salt="b") == 0
    assert cached() == 0
    assert cached(extra_key="k", cache_salt="a") == 0
    assert cached(cache_salt="b") == len(prompt) - 1
    assert cached() == len(prompt) - 1
    h.scheduler.tree_cache.sanity_check()


def test_stop_regex_ends_the_request_and_keeps_the_match():
    # The fake tokenizer spells token i as a letter: output ids 1, 2, 3... read "bcdef...".
    h = Harness(detokenize=True)
    rid = h.submit([0], max_new_tokens=20, stop_regex=["x{3}", "d.f"])
    h.run_until_idle()
    out = h.outputs[rid]
    assert out.finished_reason == {"type": "stop", "matched": "d.f"}
    assert out.output_ids == [1, 2, 3, 4, 5] and out.text == "bcdef"


def test_a_stop_regex_that_backtracks_catastrophically_ends_only_its_request():
    # "^(\w|\w\w)*\d" never matches "bcde...": a search over k letters tries every split of
    # them into ones and twos (Fibonacci(k) of them: ~30 ms at 24 letters, minutes at 48).
    # Every search runs under a time budget; the one past it ends its request with a 400 and the
    # server goes on (the other request finishes normally).
    h = Harness(detokenize=True)
    slow = h.submit([0], max_new_tokens=48, stop_regex=[r"^(\w|\w\w)*\d"])
    other = h.submit([5], max_new_tokens=6)
    h.run_until_idle()
    reason = h.outputs[slow].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400, reason
    assert "catastrophic backtracking" in reason["message"]
    assert len(h.outputs[slow].output_ids) < 48
    assert h.outputs[other].finished_reason["type"] == "length"


def test_per_request_stream_interval():
    h = Harness(stream_interval=1)
    every3 = h.submit([1], stream=True, max_new_tokens=10, stream_interval=3)
    every1 = h.submit([2], stream=True, max_new_tokens=4)
    h.run_until_idle()
    assert h.outputs[every3].emitted_lengths == [1, 4, 7, 10]
    assert h.outputs[every1].emitted_lengths == [1, 2, 3, 4]


@pytest.mark.parametrize("truncate", [False, True])
def test_allow_auto_truncate(truncate):
    h = Harness(worker=FakeWorker(context_len=64), allow_auto_truncate=truncate)
    limit = h.scheduler.max_req_input_len
    rid = h.submit(list(range(1, 81)), max_new_tokens=3)
    h.run_until_idle()
    out = h.outputs[rid]
    if truncate:
        assert out.prompt_tokens == limit and out.finished_reason["type"] == "length"
        assert out.output_ids[0] == limit + 1  # generated from the first `limit` tokens
    else:
        assert out.finished_reason["status_code"] == 400
        assert "--allow-auto-truncate" in out.finished_reason["message"]


@pytest.mark.parametrize("flag, message", [(False, "--enable-custom-logit-processor"),
                                           (True, "must be the JSON of CustomLogitProcessor.to_str()")])
def test_custom_logit_processor_is_refused_without_the_flag_or_when_malformed(flag, message):
    h = Harness(enable_custom_logit_processor=flag)
    rid = h.submit([1], custom_logit_processor="not json")
    h.run_until_idle()
    reason = h.outputs[rid].finished_reason
    assert reason["status_code"] == 400 and message in reason["message"]
