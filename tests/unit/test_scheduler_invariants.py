"""Invariants of schedule-batch.md section 9, checked at every step of randomised workloads,
and output equivalence across radix cache / page size / chunking / pool size."""

from __future__ import annotations

import random

import pytest
import torch

from sched_utils import FakeWorker, Harness


class CheckingWorker(FakeWorker):
    """Checks the shapes and the req_to_token rows of every batch it is handed (invariants 4, 6, 7, 8)."""

    def forward_batch_generation(self, batch):
        table = self.req_to_token_pool.req_to_token
        n_tokens = batch.input_ids.numel()
        assert batch.out_cache_loc.numel() == n_tokens
        rows = batch.req_pool_indices.tolist()
        if batch.forward_mode.is_extend():
            assert sum(batch.extend_seq_lens) == n_tokens == batch.extend_num_tokens
            pt = 0
            for row, pre, ext, seq in zip(rows, batch.extend_prefix_lens, batch.extend_seq_lens, batch.seq_lens_cpu):
                assert pre + ext == seq
                assert table[row, pre:seq].tolist() == batch.out_cache_loc[pt:pt + ext].tolist()
                pt += ext
        else:
            assert n_tokens == len(rows)
            for i, (row, seq) in enumerate(zip(rows, batch.seq_lens_cpu)):
                assert int(table[row, seq - 1]) == int(batch.out_cache_loc[i])
        if self.page_size > 1:
            for row, seq in zip(rows, batch.seq_lens_cpu):
                slots = table[row, :seq]
                pos = torch.arange(seq, dtype=slots.dtype)
                assert torch.equal(slots % self.page_size, pos % self.page_size)
        return super().forward_batch_generation(batch)


def kv_conservation(h: Harness) -> None:
    """Invariant 1: available + evictable + protected + what live requests own == capacity."""
    s = h.scheduler
    page = s.page_size
    live = list(s.running_batch.reqs)
    if s.last_batch is not None:
        live += [r for r in s.last_batch.reqs if not r.finished()]  # prefilled, joining decode next step
    if s.chunked_req is not None:
        live.append(s.chunked_req)
    owned = 0
    seen = set()
    for r in live:
        if id(r) in seen or r.req_pool_idx is None:
            continue
        seen.add(id(r))
        owned += -(-(r.kv_allocated_len - r.cache_protected_len) // page) * page
    total = (s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size()
             + s.tree_cache.protected_size() + owned)
    assert total == s.max_total_num_tokens, (total, s.max_total_num_tokens)
    rows_in_use = len(seen)
    assert s.req_to_token_pool.available_size() + rows_in_use == s.req_to_token_pool.size


def workload(seed: int, n: int = 24):
    rng = random.Random(seed)
    reqs = []
    shared = [rng.randrange(900) for _ in range(40)]
    for i in range(n):
        head = shared[: rng.choice([0, 17, 40])]
        body = [rng.randrange(900) for _ in range(rng.randint(1, 70))]
        reqs.append((head + body, rng.randint(1, 40), rng.random() < 0.5))
    return reqs


def run(reqs, total=4096, page_size=1, chunk=-1, radix=True, mixed=False, aborts=(), check=True, seed=0):
    worker = CheckingWorker(max_total_tokens=total, page_size=page_size)
    h = Harness(worker=worker, page_size=page_size, chunked_prefill_size=chunk, disable_radix_cache=not radix,
                enable_mixed_chunk=mixed, disable_mixed_chunk=not mixed)
    rng = random.Random(seed)
    pending = list(enumerate(reqs))
    rids = {}
    steps = 0
    while pending or h.scheduler.has_work():
        # Random arrivals: a few requests per step.
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, (ids, max_new, stream) = pending.pop(0)
                rids[i] = h.submit(ids, rid=f"q{i}", max_new_tokens=max_new, stream=stream, ignore_eos=True)
        if steps in aborts:
            h.abort(f"q{aborts[steps]}")
        h.step()
        if check:
            kv_conservation(h)
        steps += 1
        assert steps < 5000
    h.step()  # idle step: strict leak check
    return {i: h.outputs[r] for i, r in rids.items()}, h


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_outputs_equal_across_configs_and_invariants_hold(page_size):
    reqs = workload(page_size)
    ref, _ = run(reqs, page_size=1)
    for kwargs in (dict(chunk=16), dict(radix=False), dict(total=400), dict(total=400, chunk=32, mixed=True)):
        chunk = kwargs.pop("chunk", -1)
        if chunk != -1:
            chunk = max(chunk, page_size)
        out, h = run(reqs, page_size=page_size, chunk=chunk, **kwargs)
        for i in ref:
            assert out[i].output_ids == ref[i].output_ids, (kwargs, i)
            assert out[i].finished_reason == ref[i].finished_reason


def test_invariants_hold_with_aborts_and_pressure():
    reqs = workload(7, n=30)
    out, h = run(reqs, total=300, chunk=16, aborts={3: 1, 5: 4, 9: 7, 12: 20})
    for i, o in out.items():
        assert o.finished_reason is not None
        if o.finished_reason["type"] == "length":
            assert len(o.output_ids) == reqs[i][1]


def test_memory_pressure_many_long_requests_all_finish():
    # 64 requests with long outputs on a pool that holds about a tenth of their total.
    reqs = [([i % 900 + 1] * 8, 120, False) for i in range(64)]
    need = sum(len(p) + n for p, n, _ in reqs)
    out, h = run(reqs, total=need // 10, check=False)
    assert all(o.finished_reason == {"type": "length", "length": 120} for o in out.values())
    assert h.scheduler.token_to_kv_pool_allocator.available_size() + h.scheduler.tree_cache.evictable_size() \
        == h.scheduler.max_total_num_tokens


def test_request_that_can_never_fit_is_aborted_with_a_message():
    h = Harness(worker=FakeWorker(max_total_tokens=64, context_len=2048))
    rid = h.submit(list(range(100)), max_new_tokens=10)
    h.run_until_idle()
    fr = h.outputs[rid].finished_reason
    assert fr["type"] == "abort" and fr["status_code"] == 400
    assert "100 tokens" in fr["message"]


def test_filter_and_merge_keep_rows_aligned():
    h = Harness()
    for i in range(6):
        h.submit([i + 1] * (5 + i), max_new_tokens=3 + 2 * i)
    for _ in range(12):
        h.step()
        b = h.scheduler.running_batch
        if b.is_empty():
            continue
        assert len(b.reqs) == len(b.seq_lens_cpu) == b.req_pool_indices.numel() == len(b.top_logprobs_nums)
        # Finished requests released their row; they are filtered out at the next step.
        for row, r in zip(b.req_pool_indices.tolist(), b.reqs):
            assert r.finished() or row == r.req_pool_idx
        assert b.sampling_info.temperatures.shape[0] == len(b.reqs)
    h.run_until_idle()
