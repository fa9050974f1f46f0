"""io_struct.route_to_workers: each row of a batch output, and each control reply, goes to the HTTP
worker that waits for it (--tokenizer-worker-num)."""

from __future__ import annotations

import pytest

from engine.io_struct import (
    BatchEmbeddingOutput,
    BatchStrOutput,
    FlushCacheReqOutput,
    route_to_workers,
)


def batch(workers: list[int]) -> BatchStrOutput:
    n = len(workers)
    return BatchStrOutput(rids=[f"r{i}" for i in range(n)], finished_reasons=[None] * n,
                          output_strs=[f"text {i}" for i in range(n)], output_ids=[[i] for i in range(n)],
                          prompt_tokens=list(range(n)), completion_tokens=[1] * n, cached_tokens=[0] * n,
                          http_workers=workers)


def test_rows_split_by_worker_in_order_and_empty_columns_stay_empty():
    parts = dict(route_to_workers(batch([1, 0, 1, 2, 1]), 3))
    assert sorted(parts) == [0, 1, 2]
    one = parts[1]
    assert isinstance(one, BatchStrOutput)
    assert one.rids == ["r0", "r2", "r4"] and one.output_strs == ["text 0", "text 2", "text 4"]
    assert one.output_ids == [[0], [2], [4]] and one.prompt_tokens == [0, 2, 4] and one.http_workers == [1, 1, 1]
    assert one.output_token_logprobs_val == []  # nobody asked for logprobs: not padded
    zero = parts[0]
    assert isinstance(zero, BatchStrOutput) and zero.rids == ["r1"] and zero.output_ids == [[1]]


@pytest.mark.parametrize("workers", [[2, 2, 2], []])
def test_one_worker_gets_the_message_whole(workers):
    msg = batch(workers)
    assert route_to_workers(msg, 3) == [(workers[0] if workers else 0, msg)]


def test_embedding_outputs_split_too():
    msg = BatchEmbeddingOutput(rids=["a", "b"], finished_reasons=[None, None], embeddings=[b"1", b"2"],
                               prompt_tokens=[3, 4], cached_tokens=[0, 0], http_workers=[1, 0])
    parts = dict(route_to_workers(msg, 2))
    assert parts[0].rids == ["b"] and parts[0].embeddings == [b"2"]
    assert parts[1].rids == ["a"] and parts[1].embeddings == [b"1"]


def test_control_replies_go_to_their_asker():
    reply = FlushCacheReqOutput(success=True, http_worker=1)
    assert route_to_workers(reply, 2) == [(1, reply)]
    assert route_to_workers(reply, 1) == [(0, reply)]  # one worker: everything is its own

