"""Overlap scheduling: the overlap loop must give exactly what the normal loop gives."""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from sched_utils import EOS, FakeWorker, Harness


class RecordingWorker(FakeWorker):
    """Records the order in which batches are processed relative to launches."""


def run_workload(overlap: bool, seed: int, n: int = 200, total: int = 1500, chunk: int = 48, page_size: int = 1,
                 mixed: bool = False, model_worker=None, tokenizer=None, logprobs=False, **server_kwargs):
    rng = random.Random(seed)
    worker = model_worker or FakeWorker(max_total_tokens=total, page_size=page_size,
                                        next_token=lambda t: EOS if t % 97 == 0 else (t * 7 + 3) % 900)
    h = Harness(worker=worker, overlap=overlap, chunked_prefill_size=chunk, page_size=page_size,
                enable_mixed_chunk=mixed, disable_mixed_chunk=not mixed, tokenizer=tokenizer, **server_kwargs)
    vocab = 900 if model_worker is None else 2000
    arrivals = []
    for i in range(n):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(1, 90))]
        kwargs = dict(max_new_tokens=rng.randint(1, 40), stream=rng.random() < 0.5)
        if logprobs and rng.random() < 0.5:
            kwargs.update(return_logprob=True, top_logprobs_num=rng.choice([0, 2]),
                          logprob_start_len=rng.choice([-1, 0, len(ids) - 1]))
        arrivals.append((rng.randint(0, 3), ids, kwargs))
    aborts = {rng.randrange(0, 150): f"q{rng.randrange(n)}" for _ in range(10)}
    pending = list(enumerate(arrivals))
    step = 0
    while pending or h.scheduler.has_work():
        k = pending[0][1][0] if pending else 0
        for _ in range(k + (0 if pending and pending[0][1][0] else 1)):
            if pending:
                i, (_, ids, kw) = pending.pop(0)
                h.submit(ids, rid=f"q{i}", **kw)
        if step in aborts:
            h.abort(aborts[step])
        h.step()
        step += 1
        assert step < 20000
    h.step()  # idle: strict leak check
    s = h.scheduler
    assert s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size() == s.max_total_num_tokens
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size
    return h


@pytest.mark.parametrize("page_size,mixed", [(1, False), pytest.param(4, True, marks=pytest.mark.slow)])
def test_overlap_equals_normal_on_200_requests(page_size, mixed):
    normal = run_workload(False, seed=page_size, page_size=page_size, mixed=mixed)
    overlap = run_workload(True, seed=page_size, page_size=page_size, mixed=mixed)
    assert normal.outputs.keys() == overlap.outputs.keys()
    for rid, out in normal.outputs.items():
        o = overlap.outputs[rid]
        if out.finished_reason["type"] == "abort" or o.finished_reason["type"] == "abort":
            continue  # an abort lands at a step that differs between the loops
        assert o.output_ids == out.output_ids, rid
        assert o.finished_reason == out.finished_reason, rid
    assert any("MIXED" == r.mode for r in overlap.worker.records) == mixed


@pytest.mark.parametrize("disable_consecutive", [False, True])
def test_consecutive_prefill_overlap_switch_keeps_outputs(disable_consecutive):
    # Both settings of --disable-consecutive-prefill-overlap give the normal loop's outputs.
    normal = run_workload(False, seed=7)
    overlap = run_workload(True, seed=7, disable_consecutive_prefill_overlap=disable_consecutive)
    launches = [r.mode for r in overlap.worker.records]
    assert any(a != "DECODE" and b != "DECODE" for a, b in zip(launches, launches[1:])), "no consecutive prefills"
    for rid, out in normal.outputs.items():
        o = overlap.outputs[rid]
        if out.finished_reason["type"] == "abort" or o.finished_reason["type"] == "abort":
            continue
        assert (o.output_ids, o.finished_reason) == (out.output_ids, out.finished_reason), rid


@pytest.mark.parametrize("disable_consecutive", [False, True])
def test_consecutive_prefills_overlap_unless_disabled(disable_consecutive):
    # SGLang overlaps two prefills in a row by default; SGLANG_DISABLE_CONSECUTIVE_PREFILL_OVERLAP
    # (here --disable-consecutive-prefill-overlap) processes the first one's result before the
    # second is launched, for the first one's TTFT.
    h = Harness(overlap=True, chunked_prefill_size=16, disable_consecutive_prefill_overlap=disable_consecutive)
    s = h.scheduler
    processed, launches = [], []
    run_batch, process = s.run_batch, s.process_batch_result

    def spy_run(batch):
        launches.append((batch.forward_mode.name, len(processed)))
        return run_batch(batch)

    def spy_process(batch, result):
        processed.append(batch.forward_mode.name)
        process(batch, result)

    s.run_batch, s.process_batch_result = spy_run, spy_process
    h.submit(list(range(1, 60)), max_new_tokens=2)  # four chunks: four prefills in a row
    h.run_until_idle()
    assert [mode for mode, _ in launches[:4]] == ["EXTEND"] * 4
    # processed-before-launch of prefills 2..4: all earlier ones (disabled) or all but the last.
    lag = 0 if disable_consecutive else 1
    assert [done for _, done in launches[1:4]] == [k - lag for k in (1, 2, 3)]
    assert processed == [mode for mode, _ in launches]


@pytest.mark.slow
def test_launched_batch_stays_referenced_until_its_result_is_processed():
    # On CUDA the caching allocator hands a freed block to the next allocation of the stream that
    # allocated it at once: the worker batch's tensors (out_cache_loc, sampling tensors, built on
    # the scheduling stream) must live until the forward that reads them is done. By
    # construction the launched forward's PendingResult keeps them until the scheduler drops it,
    # after processing its result (which waits for copy_done). Checked here on the CPU path,
    # which runs the same code.
    h = Harness(overlap=True, chunked_prefill_size=16)
    s = h.scheduler
    launched = []  # per launch, in order: weak references to the worker batch and its tensors
    forward = h.worker.forward_batch_generation

    def spy_forward(batch):
        launched.append([weakref.ref(batch), weakref.ref(batch.out_cache_loc),
                         weakref.ref(batch.sampling_info.temperatures)])
        return forward(batch)

    h.worker.forward_batch_generation = spy_forward
    process = s.process_batch_result
    checked = []

    def spy_process(batch, result):
        result.result()  # the forward has run ...
        s.forward_stream.call(lambda: None)  # ... and the forward thread has dropped its job
        gc.collect()
        # Batches are processed in launch order: this is launch number len(checked).
        assert all(ref() is not None for ref in launched[len(checked)]), "launched batch released early"
        checked.append(batch.forward_mode.name)
        process(batch, result)

    s.process_batch_result = spy_process
    for i in range(4):
        h.submit(list(range(1, 30 + i)), max_new_tokens=5)
    h.run_until_idle()
    assert len(checked) == len(launched) and {"EXTEND", "DECODE"} <= set(checked)
    gc.collect()
    assert all(refs[0]() is None for refs in launched), "processed batches must be released"


def test_overlap_finished_request_rides_one_extra_step_without_leak():
    h = Harness(overlap=True)
    a = h.submit([1, 2, 3], max_new_tokens=3, stream=True)
    b = h.submit([5, 6], max_new_tokens=8, stream=True)
    h.run_until_idle()
    assert h.outputs[a].output_ids == [4, 5, 6] and h.outputs[a].finished_reason["type"] == "length"
    assert len(h.outputs[b].output_ids) == 8
    # a finished when step k was processed, but step k+1 had already been launched with it in it.
    a_rows = [r for r in h.worker.records if r.mode == "DECODE" and r.bs == 2]
    assert len(a_rows) == 3  # decode steps producing tokens 2, 3 of `a`, plus the extra ignored step
    # each output emitted once: the harness asserts nothing arrives after a finish


def test_overlap_processes_batches_in_launch_order():
    h = Harness(overlap=True)
    processed = []
    orig = h.scheduler.process_batch_result

    def spy(batch, result):
        processed.append(batch.forward_mode.name)
        orig(batch, result)

    h.scheduler.process_batch_result = spy
    for i in range(5):
        h.submit([i + 1] * (i + 2), max_new_tokens=6)
    h.run_until_idle()
    assert processed == [r.mode for r in h.worker.records]


def test_overlap_with_retraction_matches_normal(caplog):
    def run(overlap):
        caplog.clear()
        with caplog.at_level("WARNING"):
            h = Harness(worker=FakeWorker(max_total_tokens=200), overlap=overlap)
            rids = [h.submit([i + 1] * (10 + i), max_new_tokens=100, ignore_eos=True) for i in range(4)]
            h.run_until_idle()
        assert "Retract requests" in caplog.text, "the pool was meant to run short"
        return [h.outputs[r].output_ids for r in rids], h

    normal, _ = run(False)
    overlap, h = run(True)
    assert normal == overlap


def test_overlap_equals_normal_on_builtin_model_with_logprobs():
    from engine.builtin_model import ensure_builtin_model
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs
    from transformers import AutoTokenizer

    path = ensure_builtin_model()
    tokenizer = AutoTokenizer.from_pretrained(path)

    def run(overlap):
        args = ServerArgs(model_path=path, device="cpu", max_total_tokens=1200, max_running_requests=24)
        rng = random.Random(3)
        h = Harness(worker=TpModelWorker(args), overlap=overlap, tokenizer=tokenizer, chunked_prefill_size=64,
                    max_total_tokens=1200)
        rids = []
        for i in range(40):
            ids = [rng.randrange(10, 2500) for _ in range(rng.randint(2, 80))]
            rids.append(h.submit(ids, rid=f"m{i}", max_new_tokens=rng.randint(1, 30), stream=i % 2 == 0,
                                 return_logprob=i % 3 == 0, top_logprobs_num=2 if i % 6 == 0 else 0,
                                 logprob_start_len=0 if i % 3 == 0 else -1))
            if i % 4 == 3:
                h.step()
        h.run_until_idle()
        return h, rids

    normal, rids = run(False)
    overlap, _ = run(True)
    for rid in rids:
        assert overlap.outputs[rid].output_ids == normal.outputs[rid].output_ids
        assert overlap.outputs[rid].finished_reason == normal.outputs[rid].finished_reason
        assert overlap.outputs[rid].logprobs == pytest.approx(normal.outputs[rid].logprobs, abs=1e-5)
