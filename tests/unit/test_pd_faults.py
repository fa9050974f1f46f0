"""PD failure scenarios (reference/disaggregation.md §11.3, 7-17) on single-stepped loopback pairs.

Timeouts run on a fake clock (no sleeps); message delivery is held, dropped or released by the
test. Every scenario ends with both servers back at the empty-pool baseline (check_idle) and every
request answered on both sides.
"""

from __future__ import annotations

import pytest

from engine.disaggregation import conn_common
from engine.disaggregation import conn_decode
from engine.disaggregation import conn_prefill
from engine.disaggregation import decode
from engine.disaggregation import fake
from engine.disaggregation.base import KVPoll
from pd_utils import BOOTSTRAP_HOST, BOOTSTRAP_PORT, PDFakeWorker, PDPair, unified

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
PREFILL_TO_DECODE = ("KVFrame", "AuxFrame", "StatusMsg")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    for module in (conn_common, conn_decode, conn_prefill, decode, fake):
        monkeypatch.setattr(module, "now", c)
    return c


def expected(prompt, **sampling):
    h = unified()
    rid = h.submit(prompt, **sampling)
    h.run_until_idle()
    return h.outputs[rid].output_ids


def answered(p: PDPair, rid: str) -> tuple:
    return p.prefill.outputs[rid].finished_reason, p.decode.outputs[rid].finished_reason


def step_until(p: PDPair, cond, limit: int = 200) -> None:
    for _ in range(limit):
        if cond():
            return
        p.step()
    raise AssertionError("condition not reached")


def drain_after_timeout(p: PDPair, clock: Clock, seconds: float = 31.0) -> None:
    clock.advance(seconds)
    p.run_until_idle()


def test_transfer_failure_injected_on_decode(make_pair, clock):
    p = make_pair()
    rid = p.submit(PROMPT, max_new_tokens=4)
    p.net.hold("DstInfo")
    step_until(p, lambda: p.decode.scheduler.disagg.transfer.queue)
    p.decode.scheduler.disagg.manager.config.failure_prob = 1.0
    p.run_until_idle()
    prefill_reason, decode_reason = answered(p, rid)
    assert decode_reason["status_code"] == 500 and "injected transfer failure" in decode_reason["message"]
    # The decode side told the prefill (it knew its address): no wait for the bootstrap timeout.
    assert prefill_reason["status_code"] == 500 and "injected" in prefill_reason["message"]
    metrics = p.decode.scheduler.internal_state()["disaggregation"]["metrics"]
    assert metrics["kv_transfer_failed_reqs_by_cause"] == {"injected": 1}
    assert metrics["num_transfer_failed_reqs"] == 1 and metrics["num_bootstrap_failed_reqs"] == 0
    p.net.release("DstInfo")  # the held destination reaches a prefill that already gave up
    p.run_until_idle()


def test_prefill_failure_is_remembered_for_the_matching_room(make_pair, clock):
    p = make_pair()
    p.prefill.scheduler.disagg.manager.config.failure_prob = 1.0
    p.prefill.submit(PROMPT, rid="late", max_new_tokens=4, bootstrap_host=BOOTSTRAP_HOST,
                     bootstrap_port=BOOTSTRAP_PORT, bootstrap_room=4242)
    p.step()
    p.decode.submit(PROMPT, rid="late", max_new_tokens=4, bootstrap_host=BOOTSTRAP_HOST,
                    bootstrap_port=BOOTSTRAP_PORT, bootstrap_room=4242)
    p.run_until_idle()  # no clock advance: the failure answers the destination at once
    assert "prefill server: injected transfer failure" in p.decode.outputs["late"].finished_reason["message"]


def test_handshake_failure_bad_bootstrap_port(make_pair, clock):
    p = make_pair()
    manager = p.decode.scheduler.disagg.manager
    manager.config.ensure_info_retries = 3
    manager.config.ensure_info_interval = 0.0
    rid = p.submit(PROMPT, max_new_tokens=4, bootstrap_port=BOOTSTRAP_PORT + 1)
    for _ in range(20):
        p.step()
        if p.decode.outputs[rid].finished_reason is not None:
            break
    reason = p.decode.outputs[rid].finished_reason
    assert reason["status_code"] == 500 and "is not reachable (3 attempts)" in reason["message"]
    assert p.decode.scheduler.disagg.prealloc.queue == []
    # The prefill never got a destination: its bootstrap timeout ends its half.
    drain_after_timeout(p, clock)
    assert "bootstrap timeout" in p.prefill.outputs[rid].finished_reason["message"]


def test_abort_with_frames_in_flight_drops_them_and_reuses_the_slots(make_pair, clock):
    p = make_pair()
    for kind in PREFILL_TO_DECODE:
        p.net.hold(kind)
    rid = p.submit(PROMPT, max_new_tokens=4)
    step_until(p, lambda: len(p.net.held) == 3)  # the prefill sent everything; nothing arrived yet
    assert p.decode.scheduler.disagg.transfer.queue
    p.decode.abort(rid)
    p.step()
    assert p.decode.outputs[rid].finished_reason["type"] == "abort"
    for kind in PREFILL_TO_DECODE:
        p.net.release(kind)
    p.net.pump()
    assert p.decode.scheduler.disagg.manager.late_frames == 3  # one KV frame, the aux row, the status
    p.run_until_idle()
    # The prefill had handed everything to the network: its half ended normally.
    assert p.prefill.outputs[rid].finished_reason == {"type": "length", "length": 0}
    again = p.submit(PROMPT, max_new_tokens=4)  # reuses the freed slots
    p.run_until_idle()
    assert p.decode.outputs[again].output_ids == expected(PROMPT, max_new_tokens=4)


def test_abort_between_destination_and_kv_stops_the_prefill(make_pair, clock):
    p = make_pair()
    p.net.hold("DstInfo")
    rid = p.submit(PROMPT, max_new_tokens=4)
    step_until(p, lambda: p.net.held)  # the destination is on its way; the prefill has not seen it
    p.decode.abort(rid)
    p.run_until_idle()  # the ABORT overtakes the held destination
    assert p.decode.outputs[rid].finished_reason["type"] == "abort"
    reason = p.prefill.outputs[rid].finished_reason
    assert reason["status_code"] == 500 and "aborted by the client" in reason["message"]
    assert p.prefill.worker.records == []  # the prompt was never prefilled
    p.net.release("DstInfo")  # arrives at a prefill that remembers the room failed
    p.run_until_idle()
    assert p.prefill.scheduler.disagg.manager.idle_state() == {"rooms": 0, "destinations": 0}


def test_abort_in_prealloc_allocates_nothing(make_pair, clock):
    p = make_pair(decode_worker=PDFakeWorker(max_total_tokens=24, extra_rows=8))
    first = p.submit(PROMPT, max_new_tokens=12, stream=True)  # takes most of the decode pool for its lifetime
    step_until(p, lambda: p.decode.outputs[first].output_ids)
    second = p.submit(PROMPT, max_new_tokens=12)
    p.step()
    prealloc = p.decode.scheduler.disagg.prealloc.queue
    assert [d.req.rid for d in prealloc] == [second] and prealloc[0].waiting_for_input
    waiting = prealloc[0]
    p.decode.abort(second)
    p.step()
    assert p.decode.outputs[second].finished_reason["type"] == "abort"
    assert p.decode.scheduler.disagg.prealloc.queue == []
    # Swept without ever holding decode memory (the per-step invariants count every slot).
    assert waiting.slots is None and waiting.metadata_buffer_index == -1 and waiting.req.req_pool_idx is None
    p.run_until_idle()  # the ABORT reached the prefill, which dropped its half at once
    assert p.prefill.outputs[second].finished_reason["status_code"] == 500
    assert p.decode.outputs[first].output_ids == expected(PROMPT, max_new_tokens=12)


def test_client_abort_on_both_sides_mid_stream(make_pair, clock):
    p = make_pair()
    rid = p.submit(PROMPT, max_new_tokens=50, stream=True)
    step_until(p, lambda: len(p.decode.outputs[rid].output_ids) >= 3)
    p.prefill.abort(rid)
    p.decode.abort(rid)
    p.run_until_idle()
    assert p.decode.outputs[rid].finished_reason["type"] == "abort"
    assert p.prefill.outputs[rid].finished_reason is not None


def test_decode_memory_back_pressure(make_pair, clock):
    # 48 slots, 8-token prompts, 8 tokens reserved per live request: the admission budget lets
    # three hold memory at once (the fourth would need 8 + 8 of 48 - 3 * 8 - 3 * 8). The rest wait
    # in the PreallocQueue, and their prefill does not run before a destination was published.
    p = make_pair(decode_worker=PDFakeWorker(max_total_tokens=48, extra_rows=16),
                  decode_kwargs=dict(num_reserved_decode_tokens=8))
    prompts = [[i + 1] * 8 for i in range(10)]
    rids = [p.submit(pr, max_new_tokens=8) for pr in prompts]
    published_rooms: set = set()
    most = 0
    decode = p.decode.scheduler
    while p.busy():
        p.step()
        held = len(decode.disagg.transfer.queue) + len(decode.disagg.waiting) + \
            sum(1 for r in decode.running_batch.reqs if not r.finished())
        most = max(most, held)
        published_rooms |= {d.req.bootstrap_room for d in decode.disagg.transfer.queue if d.publish_after is None}
        prefill = p.prefill.scheduler
        for req in prefill.waiting_queue + [pr.req for pr in prefill.disagg.tracked.values()]:
            assert req.bootstrap_room in published_rooms, "prefill scheduled before the decode side was ready"
    p.run_until_idle()
    assert most == 3
    assert [p.decode.outputs[r].output_ids for r in rids] == [expected(pr, max_new_tokens=8) for pr in prompts]


def test_too_long_for_decode_is_400_at_once(make_pair, clock):
    # The prompt passes the generic length check (<= max_req_input_len) but with the reserve
    # every request keeps it can never fit: waiting would block the FIFO for ever.
    p = make_pair(decode_worker=PDFakeWorker(max_total_tokens=16, extra_rows=4),
                  decode_kwargs=dict(num_reserved_decode_tokens=8))
    rid = p.submit(list(range(1, 10)), max_new_tokens=2)
    p.step()
    reason = p.decode.outputs[rid].finished_reason
    assert reason["status_code"] == 400 and "does not fit" in reason["message"]
    p.run_until_idle(max_steps=20)  # the prefill is told at once, not at its bootstrap timeout
    prefill_reason = p.prefill.outputs[rid].finished_reason
    assert prefill_reason["status_code"] == 500 and "refused by the decode server" in prefill_reason["message"]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_retraction_resumes_from_the_kv_backup(make_pair, clock, overlap):
    p = make_pair(decode_worker=PDFakeWorker(max_total_tokens=48, extra_rows=8), overlap_decode=overlap,
                  decode_kwargs=dict(num_reserved_decode_tokens=0))
    prompts = [[i + 2] * 6 for i in range(4)]
    rids = [p.submit(pr, max_new_tokens=14) for pr in prompts]
    retracted = p.run_counting_retractions()
    assert retracted >= 1, "the configuration must make the decode side retract"
    assert [p.decode.outputs[r].output_ids for r in rids] == [expected(pr, max_new_tokens=14) for pr in prompts]
    assert p.decode.scheduler.num_extend_tokens_computed == 0  # resumed from the backup, not recomputed


def test_waiting_timeout_aborts_and_tells_the_prefill(make_pair, clock):
    p = make_pair()
    for kind in PREFILL_TO_DECODE:
        p.net.drop(kind)  # the KV never arrives
    rid = p.submit(PROMPT, max_new_tokens=4)
    step_until(p, lambda: p.prefill.scheduler.disagg.inflight)
    clock.advance(31.0)
    p.run_until_idle()
    assert "waiting timeout" in p.decode.outputs[rid].finished_reason["message"]
    assert p.prefill.outputs[rid].finished_reason is not None


def test_prefill_death_fails_waiting_requests_and_decode_serves_a_new_prefill(make_pair, clock):
    p = make_pair()
    p.net.hold("DstInfo")  # requests are mid-way when the prefill dies
    rids = [p.submit(PROMPT, max_new_tokens=4) for _ in range(2)]
    step_until(p, lambda: len(p.decode.scheduler.disagg.transfer.queue) == 2 and p.net.held)
    addr = f"{BOOTSTRAP_HOST}:{BOOTSTRAP_PORT}"
    p.net.kill_bootstrap(addr)
    p.prefill.scheduler.disagg.manager.transport.close()
    manager = p.decode.scheduler.disagg.manager
    for _ in range(manager.config.heartbeat_max_failures):
        manager.heartbeat_once()
    for _ in range(3):
        p.decode.step()
    for rid in rids:
        reason = p.decode.outputs[rid].finished_reason
        assert reason["status_code"] == 500 and "missed 2 heartbeats" in reason["message"]
    metrics = p.decode.scheduler.internal_state()["disaggregation"]["metrics"]
    assert metrics["kv_transfer_failed_reqs_by_cause"] == {"peer_dead": 2}
    # A prefill server comes back at the same address: the decode server serves again.
    p.net.held.clear()
    p.net.release("DstInfo")
    old_prefill = p.prefill
    fresh = PDPair(network=p.net)
    p.prefill, old = fresh.prefill, old_prefill
    fresh.decode.scheduler.shutdown()
    old.scheduler.shutdown()
    rid = p.submit(PROMPT, max_new_tokens=4)
    p.run_until_idle()
    assert p.decode.outputs[rid].output_ids == expected(PROMPT, max_new_tokens=4)


def test_metadata_room_mismatch_aborts_without_using_the_row(make_pair, clock):
    p = make_pair()
    p.net.hold("StatusMsg")
    rid = p.submit(PROMPT, max_new_tokens=4)
    step_until(p, lambda: p.net.held)
    decode = p.decode.scheduler.disagg
    index = decode.transfer.queue[0].metadata_buffer_index
    decode.memory.metadata.rows["room"][index] = 999_999  # corrupt: another request's room
    p.net.release("StatusMsg")
    p.run_until_idle()
    reason = p.decode.outputs[rid].finished_reason
    assert reason["status_code"] == 500 and "metadata room mismatch" in reason["message"]
    assert p.decode.outputs[rid].output_ids == []


def test_metadata_gate_holds_success_until_the_row_arrives(make_pair, clock):
    p = make_pair()
    rid = p.submit(PROMPT, max_new_tokens=3)
    p.net.hold("AuxFrame")
    step_until(p, lambda: p.net.held)
    # Reorder: the status (Success) arrives before the metadata row (a real pipe never does this).
    p.step()
    decode = p.decode.scheduler.disagg
    dreq = decode.transfer.queue[0]
    assert dreq.kv_receiver.poll() == KVPoll.Success
    assert decode.transfer._gated_poll(dreq) == KVPoll.Transferring  # the gate holds it back
    p.net.release("AuxFrame")
    p.run_until_idle()
    assert p.decode.outputs[rid].output_ids == expected(PROMPT, max_new_tokens=3)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("new_weights", [False, True], ids=["same-weights", "new-weights"])
def test_pause_retract_on_decode_rebootstraps_from_the_prefill(make_pair, clock, overlap, new_weights):
    """SGLang's PD true retraction: a pause(retract) frees the KV without a backup, and after
    continue the prefill recomputes it (prompt + outputs but the last) with the weights it has then.
    The fake workers' kv_scale stands in for the weights: a restored backup of the old KV gives
    other tokens than a fresh run on the new weights."""
    from engine.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

    p = make_pair(overlap_decode=overlap)
    prompts = [[i + 3] * 7 for i in range(2)]
    rids = [p.submit(prompt, max_new_tokens=12, stream=True) for prompt in prompts]
    step_until(p, lambda: all(len(p.decode.outputs[r].output_ids) >= 3 for r in rids))
    control = p.decode.scheduler.control
    assert control.pause_generation(PauseGenerationReqInput(mode="retract")).success
    disagg = p.decode.scheduler.disagg
    assert len(disagg.prealloc.held) == 2 and not disagg.prealloc.retracted_queue  # no KV, no backup
    assert all(r.kv_backup is None for r in disagg.prealloc.held)
    before = {r.rid: list(r.output_ids) for r in disagg.prealloc.held}
    prefill_computed = p.prefill.scheduler.num_extend_tokens_computed
    if new_weights:
        # A weight update: new weights, and the prefill's cached prefixes flushed with it.
        p.prefill.scheduler.worker.kv_scale = p.decode.scheduler.worker.kv_scale = 2.0
        assert p.prefill.scheduler.flush_cache().success
    assert control.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False)).success
    p.run_until_idle()
    assert p.net.recomputes == 2
    for prompt, rid in zip(prompts, rids):
        head = before[rid]
        oracle = unified()
        oracle.worker.kv_scale = 2.0 if new_weights else 1.0
        fresh = oracle.submit(prompt + head, max_new_tokens=12 - len(head))
        oracle.run_until_idle()
        assert p.decode.outputs[rid].output_ids == head + oracle.outputs[fresh].output_ids
        if not new_weights:
            assert p.decode.outputs[rid].output_ids == expected(prompt, max_new_tokens=12)
    # The decode side computed no prompt position; the prefill recomputed prompt + outputs - 1.
    assert p.decode.scheduler.num_extend_tokens_computed == 0
    assert p.prefill.scheduler.num_extend_tokens_computed - prefill_computed <= sum(
        len(prompt) + len(before[rid]) - 1 for prompt, rid in zip(prompts, rids))


def test_rebootstrap_the_prefill_does_not_take_ends_the_request_with_500(make_pair, clock):
    from engine.io_struct import ContinueGenerationReqInput, PauseGenerationReqInput

    p = make_pair()
    rid = p.submit(PROMPT, max_new_tokens=12, stream=True)
    step_until(p, lambda: len(p.decode.outputs[rid].output_ids) >= 3)
    control = p.decode.scheduler.control
    assert control.pause_generation(PauseGenerationReqInput(mode="retract")).success
    p.net.recompute_sinks.clear()  # the prefill's bootstrap server takes no recompute
    assert control.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False)).success
    p.run_until_idle()  # and nothing is left on either side (the prefill dropped the destination)
    reason = p.decode.outputs[rid].finished_reason
    assert reason["status_code"] == 500 and "did not take the recompute" in reason["message"]


def test_abort_of_a_request_held_for_rebootstrap(make_pair, clock):
    from engine.io_struct import AbortReq, ContinueGenerationReqInput, PauseGenerationReqInput

    p = make_pair()
    rid = p.submit(PROMPT, max_new_tokens=12, stream=True)
    step_until(p, lambda: len(p.decode.outputs[rid].output_ids) >= 3)
    control = p.decode.scheduler.control
    assert control.pause_generation(PauseGenerationReqInput(mode="retract")).success
    emitted = list(p.decode.scheduler.disagg.prealloc.held[0].output_ids)
    p.decode.scheduler.add_request(AbortReq(rid=rid))
    p.step()
    assert not p.decode.scheduler.disagg.prealloc.held
    assert control.continue_generation(ContinueGenerationReqInput(torch_empty_cache=False)).success
    p.run_until_idle()
    assert p.decode.outputs[rid].finished_reason["type"] == "abort"
    assert p.decode.outputs[rid].output_ids == emitted and p.net.recomputes == 0


def test_memory_release_is_refused_while_kv_is_in_transfer(make_pair, clock):
    from engine.io_struct import ReleaseMemoryOccupationReqInput

    p = make_pair()
    for kind in PREFILL_TO_DECODE:
        p.net.hold(kind)
    rid = p.submit(PROMPT, max_new_tokens=3)
    step_until(p, lambda: len(p.net.held) == 3)
    refused = p.decode.scheduler.control.release_memory_occupation(ReleaseMemoryOccupationReqInput())
    assert not refused.success and "1 request(s)" in refused.message
    for kind in PREFILL_TO_DECODE:
        p.net.release(kind)
    p.run_until_idle()
    assert p.decode.outputs[rid].output_ids == expected(PROMPT, max_new_tokens=3)
