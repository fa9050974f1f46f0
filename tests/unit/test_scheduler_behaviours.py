"""The scheduler behaviours of scheduler.md section 10, with a deterministic fake worker."""

from __future__ import annotations

import pytest
import torch

from engine.scheduler.kv_manager import MemoryLeakError
from sched_utils import EOS, FakeTokenizer, FakeWorker, Harness


def prompt(n: int, start: int = 0):
    return [(start + i) % 900 for i in range(n)]


def test_01_continuous_batching_join():
    h = Harness()
    a = h.submit(prompt(10), max_new_tokens=20)
    h.step()  # prefill A
    h.step()  # decode A
    h.step()
    a_len = len(h.scheduler.running_batch.reqs[0].output_ids)
    b = h.submit(prompt(7, 100), max_new_tokens=20)
    batch = h.step()
    assert batch.forward_mode.name == "EXTEND" and [r.rid for r in batch.reqs] == [b]
    assert len(h.scheduler.running_batch.reqs[0].output_ids) == a_len  # A did not advance
    batch = h.step()
    assert batch.forward_mode.name == "DECODE" and {r.rid for r in batch.reqs} == {a, b}
    h.run_until_idle()


def test_02_prefill_priority_over_decode():
    h = Harness()
    h.submit(prompt(10), max_new_tokens=20)
    h.step()
    h.step()
    h.submit(prompt(5, 50), max_new_tokens=4)
    assert h.step().forward_mode.name == "EXTEND"
    h.run_until_idle()


def test_03_chunked_prefill_chunks_and_single_token():
    h = Harness(chunked_prefill_size=64)
    rid = h.submit(prompt(200), max_new_tokens=3, stream=True)
    lens = []
    for _ in range(4):
        batch = h.step()
        lens.append(batch.extend_lens)
        req = batch.reqs[0]
        chunked = [r for r in h.scheduler.waiting_queue] + ([h.scheduler.chunked_req] if h.scheduler.chunked_req else [])
        assert len([r for r in chunked if r is not None and r.is_chunked]) <= 1
        if len(lens) < 4:
            assert req.output_ids == [] and h.outputs[rid].emissions == []
    assert lens == [[64], [64], [64], [8]]
    assert len(req.output_ids) == 1 and h.outputs[rid].output_ids == req.output_ids
    h.run_until_idle()
    assert len(h.outputs[rid].output_ids) == 3


def test_04_prefill_input_budget():
    h = Harness(max_prefill_tokens=100)
    for i in range(3):
        h.submit(prompt(60, i * 100), max_new_tokens=2)
    assert h.step().batch_size() == 1
    assert h.step().batch_size() == 1
    h.run_until_idle()


def test_05_total_token_budget_sets_batch_is_full():
    h = Harness(worker=FakeWorker(max_total_tokens=300))
    h.submit(prompt(100), max_new_tokens=150)
    h.step()
    s = h.scheduler
    # free + evictable - running reservation: 300 - 101 - 150 * ratio ~ 94 < 50 + 100
    h.submit(prompt(50, 400), max_new_tokens=100)
    batch = h.step()
    assert batch.forward_mode.name == "DECODE" and batch.batch_size() == 1
    assert s.running_batch.batch_is_full
    assert len(s.waiting_queue) == 1
    h.run_until_idle()


def test_06_max_running_requests():
    h = Harness(max_running_requests=2)
    for i in range(5):
        h.submit(prompt(8, i * 10), max_new_tokens=5)
    while h.scheduler.has_work():
        h.step()
        assert h.scheduler.running_batch.batch_size() <= 2
    assert all(o.finished_reason["type"] == "length" for o in h.outputs.values())
    assert max(r.bs for r in h.worker.records) <= 2


def test_07_max_new_tokens_clamping():
    h = Harness(worker=FakeWorker(max_total_tokens=1000, context_len=512, page_size=4))
    h.submit(prompt(30), max_new_tokens=None)
    h.scheduler.process_input_requests(h.scheduler.recv_requests())
    req = h.scheduler.waiting_queue[0]
    max_req_len = min(512 - 1, 1000 - 1)
    assert req.sampling_params.max_new_tokens == min(max_req_len - 30 - 1, 1000 - 32 - 4 - 1)


def test_08_over_long_prompt_aborts_400():
    h = Harness(worker=FakeWorker(context_len=128))
    rid = h.submit(prompt(200))
    h.run_until_idle()
    fr = h.outputs[rid].finished_reason
    assert fr["type"] == "abort" and fr["status_code"] == 400
    assert "exceeds the maximum allowed length" in fr["message"]
    assert h.worker.records == []


def test_09_logprob_start_len_beyond_prompt_aborts():
    h = Harness()
    rid = h.submit(prompt(10), return_logprob=True, logprob_start_len=20)
    h.run_until_idle()
    assert h.outputs[rid].finished_reason["status_code"] == 400
    assert h.worker.records == []


def test_09b_logprob_start_len_equal_to_prompt_length_runs():
    h = Harness()
    plain = h.submit(prompt(10), max_new_tokens=4)
    rid = h.submit(prompt(10), return_logprob=True, logprob_start_len=10, max_new_tokens=4)
    h.run_until_idle()
    assert h.outputs[rid].finished_reason == {"type": "length", "length": 4}
    assert h.outputs[rid].output_ids == h.outputs[plain].output_ids


def test_10_queue_limit():
    h = Harness(max_running_requests=1, max_queued_requests=2)
    h.submit(prompt(5), max_new_tokens=50)
    h.step()
    rids = [h.submit(prompt(5, 10 * i)) for i in range(1, 4)]
    h.step()
    fr = h.outputs[rids[2]].finished_reason
    assert fr["status_code"] == 503 and fr["message"] == "The request queue is full."
    assert h.outputs[rids[0]].finished_reason is None
    h.run_until_idle()


def test_11_waiting_timeout():
    h = Harness(max_running_requests=1, req_waiting_timeout=0.001)
    h.submit(prompt(5), max_new_tokens=30)
    h.step()
    rid = h.submit(prompt(5, 10))
    h.step()
    import time

    deadline = time.monotonic() + 5
    while h.outputs[rid].finished_reason is None and time.monotonic() < deadline:
        h.step()
    fr = h.outputs[rid].finished_reason
    assert fr["status_code"] == 503 and fr["message"] == "Request waiting timeout reached."
    h.run_until_idle()


def test_12_abort_while_queued():
    h = Harness()
    rid = h.submit(prompt(5))
    h.abort(rid)
    h.run_until_idle()
    assert h.outputs[rid].finished_reason == {"type": "abort", "message": "Abort before prefill",
                                              "status_code": None, "err_type": None}
    assert h.worker.records == []


def test_13_abort_while_running_frees_everything():
    h = Harness()
    rid = h.submit(prompt(5), max_new_tokens=100)
    for _ in range(4):
        h.step()
    h.abort(rid)
    h.run_until_idle()  # strict idle check: raises on a leak
    out = h.outputs[rid]
    assert out.finished_reason["type"] == "abort" and out.finished_reason["message"] == "Aborted"
    s = h.scheduler
    assert s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size() == s.max_total_num_tokens


def test_14_prefix_abort_and_abort_all_with_chunked():
    h = Harness(chunked_prefill_size=16)
    h.submit(prompt(5), rid="x-0", max_new_tokens=50)
    h.submit(prompt(5, 30), rid="x-1", max_new_tokens=50)
    keep = h.submit(prompt(5, 60), rid="y", max_new_tokens=50)
    h.step()
    h.step()
    h.abort("x")
    h.step()
    h.step()
    assert h.outputs["x-0"].finished_reason["type"] == "abort"
    assert h.outputs["x-1"].finished_reason["type"] == "abort"
    assert h.outputs[keep].finished_reason is None
    long_rid = h.submit(prompt(100, 200), max_new_tokens=5)
    h.step()
    assert h.scheduler.chunked_req is not None and h.scheduler.chunked_req.rid == long_rid
    h.abort(abort_all=True)
    h.run_until_idle()
    assert h.outputs[long_rid].finished_reason["type"] == "abort"
    assert h.outputs[keep].finished_reason["type"] == "abort"


def test_15_stop_conditions():
    # EOS
    h = Harness(worker=FakeWorker(next_token=lambda t: EOS if t == 12 else (t + 1) % 900))
    eos = h.submit([8], max_new_tokens=20)
    ign = h.submit([8], max_new_tokens=8, ignore_eos=True)
    h.run_until_idle()
    assert h.outputs[eos].finished_reason == {"type": "stop", "matched": EOS}
    assert h.outputs[eos].output_ids == [9, 10, 11, 12, EOS]
    assert h.outputs[ign].finished_reason == {"type": "length", "length": 8}
    assert len(h.outputs[ign].output_ids) == 8
    # Stop string spanning two tokens: ids 5, 6 decode to "f", "g".
    h = Harness()
    rid = h.submit([2], max_new_tokens=20, stop=["fg"])
    h.run_until_idle()
    out = h.outputs[rid]
    assert out.finished_reason == {"type": "stop", "matched": "fg"}
    assert out.output_ids == [3, 4, 5, 6] and out.completion_tokens == 4
    # Length
    h = Harness()
    rid = h.submit([2], max_new_tokens=3)
    h.run_until_idle()
    assert h.outputs[rid].finished_reason == {"type": "length", "length": 3}


def test_16_streaming_cadence():
    h = Harness()
    r1 = h.submit([1], max_new_tokens=6, stream=True)
    h.run_until_idle()
    assert h.outputs[r1].emissions == [[2], [3], [4], [5], [6], [7]]
    h = Harness(stream_interval=4)
    r4 = h.submit([1], max_new_tokens=10, stream=True)
    h.run_until_idle()
    assert h.outputs[r4].emitted_lengths == [1, 5, 9, 10]
    h = Harness()
    rn = h.submit([1], max_new_tokens=120, stream=False, ignore_eos=True)
    h.run_until_idle()
    assert h.outputs[rn].emitted_lengths == [50, 100, 120]


def test_17_partial_stop_string_is_held_back():
    h = Harness()
    # Output letters: d e f g h ...; "fx" never completes but "f" is a prefix of it.
    rid = h.submit([2], max_new_tokens=6, stream=True, stop=["fx"])
    h.run_until_idle()
    em = h.outputs[rid].emitted_lengths
    assert 3 not in em  # the step that produced "f" emitted nothing
    assert h.outputs[rid].output_ids == [3, 4, 5, 6, 7, 8]


def test_18_radix_reuse_reports_cached_tokens(caplog):
    h = Harness()
    a = h.submit(prompt(256), max_new_tokens=2)
    h.step()
    b = h.submit(prompt(256), max_new_tokens=2)
    with caplog.at_level("INFO"):
        batch = h.step()
    assert batch.log_hit_tokens == 255 and batch.log_input_tokens == 1
    assert "#cached-token: 255" in caplog.text and "#new-token: 1" in caplog.text
    h.run_until_idle()
    assert h.outputs[b].cached_tokens == 255 and h.outputs[a].cached_tokens == 0


def test_19_lpm_in_batch_dedup():
    # In-batch dedup: two new requests sharing a 64-token prefix not in the cache
    h = Harness(schedule_policy="lpm", max_prefill_tokens=80)
    common = prompt(64, 300)
    p = h.submit(common + [7] * 10, max_new_tokens=1)
    other = h.submit(prompt(20, 700), max_new_tokens=1)
    q = h.submit(common + [8] * 10, max_new_tokens=1)
    h.scheduler.process_input_requests(h.scheduler.recv_requests())
    h.scheduler.prefill.policy.calc_priority(h.scheduler.waiting_queue)
    assert [r.rid for r in h.scheduler.waiting_queue] == [p, other, q]
    h.run_until_idle()
    assert h.outputs[q].cached_tokens == 64


@pytest.mark.parametrize("overlap", [False, True])
def test_19c_requests_sharing_an_uncached_head_are_not_prefilled_together(overlap):
    """Under the default policy too: the second request of a group waits one round and reuses the
    first one's prompt KV instead of computing the shared system prompt again in the same batch."""
    h = Harness(overlap=overlap)
    system = prompt(100, 300)
    a = h.submit(system + [7] * 5, max_new_tokens=3)
    b = h.submit(system + [8] * 5, max_new_tokens=3)
    other = h.submit(prompt(20, 700), max_new_tokens=3)
    first = h.step()
    assert [r.rid for r in first.reqs] == [a, other]
    h.run_until_idle()
    assert h.outputs[b].cached_tokens == 100 and h.outputs[a].cached_tokens == 0
    alone = Harness()
    c = alone.submit(system + [8] * 5, max_new_tokens=3)
    alone.run_until_idle()
    assert h.outputs[b].output_ids == alone.outputs[c].output_ids


@pytest.mark.parametrize("overlap", [False, True])
def test_19e_a_chunked_head_is_not_computed_again_by_its_group(overlap):
    """While a group's first request is prefilled in chunks, its earlier chunks are in the tree: the
    next request of the group matches up to the chunk being computed and must wait for it rather than
    compute the same prompt tokens again in the same batch."""
    h = Harness(overlap=overlap, chunked_prefill_size=64, disable_mixed_chunk=True)
    system = prompt(100, 300)
    a = h.submit(system + [7] * 5, max_new_tokens=3)
    b = h.submit(system + [8] * 5, max_new_tokens=3)
    batches = []
    while h.scheduler.has_work():
        batch = h.step()
        if batch is not None and batch.forward_mode.is_extend():
            batches.append({r.rid: r.extend_input_len for r in batch.reqs})
    assert h.outputs[a].cached_tokens == 0 and h.outputs[b].cached_tokens == 100
    assert h.scheduler.num_extend_tokens_computed == 105 + 5
    assert all(not (a in rows and b in rows) for rows in batches), batches


def test_19d_without_radix_cache_shared_heads_are_prefilled_together():
    h = Harness(disable_radix_cache=True)
    system = prompt(100, 300)
    rids = [h.submit(system + [t] * 5, max_new_tokens=2) for t in (7, 8)]
    assert [r.rid for r in h.step().reqs] == rids
    h.run_until_idle()


def test_19b_lpm_prefers_longest_cached_prefix():
    h = Harness(schedule_policy="lpm")
    shared = prompt(100, 500)
    h.submit(shared + [1, 2], max_new_tokens=1)
    h.run_until_idle()
    x = h.submit(prompt(40, 100), max_new_tokens=1)
    y = h.submit(shared + [3], max_new_tokens=1)
    h.scheduler.process_input_requests(h.scheduler.recv_requests())
    h.scheduler.prefill.policy.calc_priority(h.scheduler.waiting_queue)
    assert [r.rid for r in h.scheduler.waiting_queue] == [y, x]


def test_20_retraction_order_ratio_and_same_output():
    def run(total):
        h = Harness(worker=FakeWorker(max_total_tokens=total))
        rids = [h.submit(prompt(10 + i, 100 * i), max_new_tokens=100, ignore_eos=True) for i in range(4)]
        retracted_first = None
        while h.scheduler.has_work():
            before = {r.rid: len(r.output_ids) for r in h.scheduler.running_batch.reqs}
            h.step()
            if retracted_first is None and any(r.retraction_count for r in h.scheduler.waiting_queue):
                retracted = [r for r in h.scheduler.waiting_queue if r.retraction_count][0]
                retracted_first = (retracted.rid, before)
                survivors = h.scheduler.running_batch.reqs
                expected = min(1.0, (sum(len(r.output_ids) for r in survivors) + 20 * len(survivors))
                               / (sum(r.max_new_tokens for r in survivors) + 1))
                assert h.scheduler.new_token_ratio == pytest.approx(expected, abs=0.02)
        h.step()
        return h, rids, retracted_first

    big, rids, none = run(4096)
    assert none is None
    small, _, first = run(200)
    assert first is not None
    rid, lens = first
    fewest = min(lens.values())
    candidates = [r for r, n in lens.items() if n == fewest]
    assert rid in candidates
    for r in rids:
        assert small.outputs[r].output_ids == big.outputs[r].output_ids
        assert small.outputs[r].finished_reason == {"type": "length", "length": 100}


def test_21_new_token_ratio_dynamics():
    h = Harness(schedule_conservativeness=1.0)
    s = h.scheduler
    assert s.new_token_ratio == pytest.approx(0.7)
    h.submit(prompt(5), max_new_tokens=30, ignore_eos=True)
    h.step()
    for _ in range(10):
        h.step()
    decay = (0.7 - 0.7 * 0.14) / 600
    assert s.new_token_ratio == pytest.approx(0.7 - 10 * decay)
    h.run_until_idle()
    assert s.new_token_ratio == pytest.approx(0.7)


def test_23_idle_leak_invariant_and_injected_leak():
    h = Harness(worker=FakeWorker(max_total_tokens=300), chunked_prefill_size=32)
    for i in range(6):
        h.submit(prompt(30 + i * 7, i * 50), max_new_tokens=40, ignore_eos=True)
    h.step()
    h.abort("r1")
    h.run_until_idle()
    s = h.scheduler
    assert s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size() == s.max_total_num_tokens
    assert s.tree_cache.protected_size() == 0
    s.token_to_kv_pool_allocator.alloc(3)  # leak three slots
    with pytest.raises(MemoryLeakError):
        h.step()


def test_23b_without_strict_check_a_leak_is_logged_once_per_distinct_leak(caplog):
    # Production: loud once (an ERROR per distinct leak), not once per idle second forever.
    h = Harness(strict_memory_check=False)
    s = h.scheduler
    h.submit(prompt(10), max_new_tokens=3)
    h.run_until_idle()

    def leak_errors() -> int:
        return sum(1 for r in caplog.records if r.levelname == "ERROR" and "memory leak" in r.getMessage())

    with caplog.at_level("ERROR"):
        leaked = s.token_to_kv_pool_allocator.alloc(3)
        for _ in range(5):
            h.step()  # idle: the self-check runs every time
        assert leak_errors() == 1
        more = s.token_to_kv_pool_allocator.alloc(2)  # a different leak is reported again
        for _ in range(5):
            h.step()
        assert leak_errors() == 2
        s.token_to_kv_pool_allocator.free(torch.cat([leaked, more]))
        h.step()
        # The server kept serving all along, and a later leak is reported again.
        rid = h.submit(prompt(10, 50), max_new_tokens=3)
        h.run_until_idle()
        assert h.outputs[rid].finished_reason == {"type": "length", "length": 3}
        s.token_to_kv_pool_allocator.alloc(3)
        h.step()
        h.step()
        assert leak_errors() == 3


def test_23c_strict_check_stops_the_event_loop_with_a_clear_message():
    h = Harness()
    h.submit(prompt(10), max_new_tokens=3)
    h.run_until_idle()
    h.scheduler.token_to_kv_pool_allocator.alloc(3)
    with pytest.raises(MemoryLeakError, match=r"memory leak detected.*available=.*total="):
        h.scheduler.event_loop(wait_for_input=lambda: None)


def test_25_flush_cache_only_when_idle():
    h = Harness()
    h.submit(prompt(20), max_new_tokens=10)
    h.step()
    assert not h.scheduler.flush_cache().success
    h.run_until_idle()
    assert h.scheduler.tree_cache.evictable_size() > 0
    assert h.scheduler.flush_cache().success
    assert h.scheduler.tree_cache.evictable_size() == 0
    assert h.scheduler.token_to_kv_pool_allocator.available_size() == h.scheduler.max_total_num_tokens


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_chunk_gives_same_outputs(page_size):
    def run(mixed):
        h = Harness(worker=FakeWorker(page_size=page_size), chunked_prefill_size=16, enable_mixed_chunk=mixed,
                    page_size=page_size)
        rids = [h.submit(prompt(10 + 9 * i, 37 * i), max_new_tokens=12) for i in range(5)]
        h.step()
        h.step()
        rids += [h.submit(prompt(40, 600), max_new_tokens=5)]
        h.run_until_idle()
        return [h.outputs[r].output_ids for r in rids], h.modes()

    plain, _ = run(False)
    mixed, modes = run(True)
    assert "MIXED" in modes
    assert plain == mixed


def test_admission_resumes_when_a_whole_prefill_batch_finishes_at_prefill():
    # Regression: batch_is_full stayed set on an empty running batch, the third request starved.
    for overlap in (False, True):
        h = Harness(worker=FakeWorker(max_running=2), overlap=overlap)
        rids = [h.submit([i + 1, i + 2, i + 3], max_new_tokens=1) for i in range(3)]
        h.run_until_idle(max_steps=50)
        assert all(h.outputs[r].finished_reason is not None for r in rids)


def test_chunked_request_survives_a_negative_token_budget_with_mixed_chunk():
    # Regression: the chunk was truncated below the computed prefix when the budget went negative.
    for overlap in (False, True):
        h = Harness(worker=FakeWorker(max_total_tokens=260), chunked_prefill_size=32, enable_mixed_chunk=True,
                    overlap=overlap)
        for i in range(4):
            h.submit(prompt(20, 100 * i), max_new_tokens=40, ignore_eos=True)
        for _ in range(3):
            h.step()
        rid = h.submit(prompt(200, 500), max_new_tokens=2, ignore_eos=True)
        h.run_until_idle()
        assert h.outputs[rid].finished_reason is not None


def test_stop_string_spelled_in_more_tokens_than_it_encodes_to():
    # " world" produced letter by letter must still stop (the tail window covers its characters).
    class Spelling(FakeTokenizer):
        def encode(self, text, add_special_tokens=False):
            return [0]  # the stop string encodes to a single token

    h = Harness(tokenizer=Spelling())
    rid = h.submit([2], max_new_tokens=30, stop=["defghi"])
    h.run_until_idle()
    assert h.outputs[rid].finished_reason == {"type": "stop", "matched": "defghi"}
