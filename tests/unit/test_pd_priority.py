"""PD decode with --enable-priority-scheduling: SGLang orders the decode server's prealloc queue
and its waiting queue by priority too (larger values first by default), FIFO among equals.

In-process pairs over the loopback backend (pd_utils); the oracle is the priority order itself.
"""

from __future__ import annotations

from typing import List

from pd_utils import PDFakeWorker

PRIORITIES = {"p1": 1, "p9": 9, "p5": 5, "p3": 3, "p5b": 5}
BY_PRIORITY = ["p9", "p5", "p5b", "p3", "p1"]  # equal priorities keep their arrival order


def _submit_all(pair, prompt_len: int) -> None:
    for i, (rid, priority) in enumerate(PRIORITIES.items()):
        pair.submit([10 + i] * prompt_len, rid=rid, max_new_tokens=4, priority=priority)


def test_decode_waiting_queue_goes_by_priority(make_pair):
    # One running request at a time on the decode side: the order they run is the waiting queue's.
    pair = make_pair(prefill_kwargs=dict(enable_priority_scheduling=True),
                     decode_kwargs=dict(enable_priority_scheduling=True, max_running_requests=1))
    _submit_all(pair, 6)
    pair.run_until_idle()
    finished = [rid for rid in pair.decode.finish_order if rid in PRIORITIES]
    assert finished == BY_PRIORITY
    assert all(len(pair.decode.outputs[rid].output_ids) == 4 for rid in PRIORITIES)


def test_decode_prealloc_queue_goes_by_priority(make_pair):
    # Decode memory for one prompt at a time: the order of pre-allocation is the prealloc queue's.
    prompt_len = 24
    decode_worker = PDFakeWorker(max_total_tokens=40, extra_rows=32)
    pair = make_pair(decode_worker=decode_worker,
                     decode_kwargs=dict(enable_priority_scheduling=True, max_total_tokens=40))
    _submit_all(pair, prompt_len)
    published: List[str] = []
    while pair.busy():
        pair.step()
        for dreq in pair.decode.scheduler.disagg.transfer.queue:
            if dreq.publish_after is None and dreq.req.rid not in published:
                published.append(dreq.req.rid)
    pair.run_until_idle()
    assert published == BY_PRIORITY
    assert all(len(pair.decode.outputs[rid].output_ids) == 4 for rid in PRIORITIES)
