"""Chunked prefill with pages: a round in which the chunked request gets no chunk at all.

With page size P > 1 the chunked request's next chunk is floored to whole pages; when the token
budget left is under one page it gets nothing that round, while a tiny request (a 1-token prompt
that fits the budget) is still admitted. The chunked request's in-flight-chunk counter must not
count that round, or its last chunk is taken for a middle one and its first token is lost.
The workloads below were found by search (mixed chunk: decode rows shrink the budget a little
every round, so the long request's last chunks run into it); each test checks that the round
without a chunk really happened.
"""

from __future__ import annotations

from typing import Dict, List

import pytest

from sched_utils import FakeWorker, Harness


def prompt(n: int, start: int = 0) -> List[int]:
    return [(start + i) % 900 for i in range(n)]


def run(page: int, total: int, chunk: int, num_running: int, long_len: int, chunked: bool = True,
        overlap: bool = False):
    worker = FakeWorker(max_total_tokens=total if chunked else 8192, page_size=page)
    h = Harness(worker=worker, page_size=page, overlap=overlap, chunked_prefill_size=chunk if chunked else -1,
                enable_mixed_chunk=chunked)
    s = h.scheduler
    for i in range(num_running):
        h.submit(prompt(20, 100 * i), rid=f"R{i}", max_new_tokens=40, ignore_eos=True)
    for _ in range(3):
        h.step()
    h.submit(prompt(long_len, 500), rid="C", max_new_tokens=2, ignore_eos=True)
    skipped_rounds = 0
    for k in range(60):
        if not s.has_work():
            break
        if s.chunked_req is not None:
            h.submit([700 + k], rid=f"S{k}", max_new_tokens=1)
        batch = h.step()
        c = s.chunked_req
        if c is not None:
            if batch is not None and c not in batch.reqs and batch.forward_mode.is_extend():
                skipped_rounds += 1
            # One count per chunk of it still in flight, no more.
            in_flight = sum(1 for launched, _ in s.result_queue if c in launched.reqs)
            assert c.is_chunked == in_flight, (k, c.is_chunked, in_flight)
    h.run_until_idle()
    outputs: Dict[str, List[int]] = {rid: out.output_ids for rid, out in h.outputs.items()}
    return outputs, skipped_rounds


@pytest.mark.parametrize("page,total,chunk,num_running,long_len", [(4, 384, 32, 6, 100), (16, 480, 32, 3, 300)])
def test_a_round_without_a_chunk_keeps_the_last_chunk_last(page, total, chunk, num_running, long_len):
    outputs, skipped = run(page, total, chunk, num_running, long_len)
    assert skipped > 0, "the workload no longer produces a round without a chunk"
    assert outputs["C"] == [(500 + long_len - 1 + k) % 999 for k in (1, 2)]
    assert_same_as_unchunked(outputs, page, total, chunk, num_running, long_len)


def assert_same_as_unchunked(outputs, page, total, chunk, num_running, long_len) -> None:
    """Every request's greedy output equals a run without chunking (the tiny ones: the next id)."""
    reference, _ = run(page, total, chunk, num_running, long_len, chunked=False)
    assert {rid: outputs[rid] for rid in reference} == reference
    for rid, ids in outputs.items():
        if rid.startswith("S"):
            assert ids == [700 + int(rid[1:]) + 1], rid


@pytest.mark.parametrize("page,total,chunk,num_running,long_len", [(4, 384, 32, 6, 100), (16, 480, 32, 3, 300)])
def test_same_workload_in_the_overlap_loop(page, total, chunk, num_running, long_len):
    outputs, _ = run(page, total, chunk, num_running, long_len, overlap=True)
    assert_same_as_unchunked(outputs, page, total, chunk, num_running, long_len)
