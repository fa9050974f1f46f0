"""Penalties and SamplingBatchInfo bookkeeping on a toy vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Set

import torch

from engine.sampling.penaltylib import BatchedFrequencyPenalizer, BatchedRepetitionPenalizer
from engine.sampling.sampling_batch_info import SamplingBatchInfo
from engine.sampling.sampling_params import SamplingParams

VOCAB = 6
NEG_INF = float("-inf")


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: List[int] = field(default_factory=list)
    output_ids: List[int] = field(default_factory=list)
    eos_token_ids: Set[int] = field(default_factory=set)
    custom_logit_processor: Optional[str] = None


def make_req(prompt=(), output=(), eos=(), **params) -> FakeReq:
    sp = SamplingParams(**params)
    sp.verify(VOCAB)
    sp.normalize()
    return FakeReq(sp, list(prompt), list(output), set(eos))


def base_logits(bs: int) -> torch.Tensor:
    row = torch.tensor([2.0, 1.0, -2.0, 3.0, -1.0, 0.5])
    return row.repeat(bs, 1)


def biased(reqs: List[FakeReq]) -> torch.Tensor:
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu")
    logits = base_logits(len(reqs))
    info.apply_logits_bias(logits)
    return logits


def test_frequency_penalty_scales_with_output_count_only() -> None:
    logits = biased([make_req(prompt=[5, 5], output=[1, 1, 2], frequency_penalty=0.5)])
    expected = base_logits(1) - torch.tensor([[0, 1.0, 0.5, 0, 0, 0]])
    torch.testing.assert_close(logits, expected)


def test_presence_penalty_once_per_generated_token() -> None:
    logits = biased([make_req(prompt=[5], output=[1, 1, 2], presence_penalty=-0.75)])
    expected = base_logits(1) + torch.tensor([[0, 0.75, 0.75, 0, 0, 0]])
    torch.testing.assert_close(logits, expected)


def test_repetition_penalty_hf_semantics_over_prompt_and_output() -> None:
    logits = biased([make_req(prompt=[0, 4], output=[2], repetition_penalty=2.0)])
    # token 0: positive 2 -> 1; token 4: negative -1 -> -2; token 2: -2 -> -4; others untouched
    expected = torch.tensor([[1.0, 1.0, -4.0, 3.0, -2.0, 0.5]])
    torch.testing.assert_close(logits, expected)


def test_repetition_penalty_sparse_and_dense_forms_agree() -> None:
    """The CPU touches only the seen tokens; accelerators apply the dense form: same logits."""
    from engine.sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer

    gen = torch.Generator().manual_seed(3)
    vocab = 500
    reqs = [make_req(prompt=torch.randint(0, vocab, (40,), generator=gen).tolist(),
                     output=torch.randint(0, vocab, (9,), generator=gen).tolist(), repetition_penalty=p)
            for p in (1.3, 0.8, 1.0, 2.0)]
    penalizer = BatchedRepetitionPenalizer.build(reqs, vocab, torch.device("cpu"))
    logits = torch.randn(len(reqs), vocab, generator=gen)
    sparse, dense = logits.clone(), logits.clone()
    penalizer.apply_sparse(sparse)
    penalizer.apply_dense(dense)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=0)
    assert not torch.equal(sparse, logits)


def test_penalties_combine_in_order_with_logit_bias() -> None:
    req = make_req(prompt=[3], output=[3, 1], repetition_penalty=1.5, frequency_penalty=1.0,
                   presence_penalty=0.5, logit_bias={"5": 10.0})
    logits = biased([req])
    expected = base_logits(1)
    expected[0, 3] = 3.0 / 1.5 - 1.0 - 0.5
    expected[0, 1] = 1.0 / 1.5 - 1.0 - 0.5
    expected[0, 5] += 10.0
    torch.testing.assert_close(logits, expected)


def test_no_penalty_no_state() -> None:
    info = SamplingBatchInfo.from_reqs([make_req(), make_req(temperature=0)], VOCAB, "cpu")
    assert not info.penalizer_orchestrator.is_required and info.logit_bias is None
    logits = base_logits(2)
    info.apply_logits_bias(logits)
    torch.testing.assert_close(logits, base_logits(2))


def test_min_new_tokens_masks_exactly_eos_and_stop_ids_until_reached() -> None:
    reqs = [
        make_req(eos=[4], stop_token_ids=[1], min_new_tokens=2, ignore_eos=True),
        make_req(eos=[4], stop_token_ids=[1]),  # no min_new_tokens: never masked
    ]
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu")
    for step in range(3):
        logits = base_logits(2)
        info.apply_logits_bias(logits)
        masked = torch.isinf(logits)
        expected_row0 = [False, True, False, False, True, False] if step < 2 else [False] * VOCAB
        assert masked[0].tolist() == expected_row0, step
        assert not masked[1].any()
        info.update_after_sample(torch.tensor([0, 0]))
    assert info.output_lens.tolist() == [3, 3]


def test_min_new_tokens_counts_tokens_already_generated() -> None:
    # A request rebuilt after retraction with 2 outputs and min_new_tokens 3 has one masked step left.
    info = SamplingBatchInfo.from_reqs([make_req(output=[0, 2], eos=[5], min_new_tokens=3)], VOCAB, "cpu")
    logits = base_logits(1)
    info.apply_logits_bias(logits)
    assert torch.isinf(logits[0, 5]) and torch.isinf(logits).sum() == 1
    info.update_after_sample(torch.tensor([0]))
    logits = base_logits(1)
    info.apply_logits_bias(logits)
    assert not torch.isinf(logits).any()


def test_update_after_sample_matches_rebuild_from_output_ids() -> None:
    params = dict(frequency_penalty=0.3, presence_penalty=0.2, repetition_penalty=1.3)
    live = [make_req(prompt=[1], **params), make_req(prompt=[2], **params)]
    info = SamplingBatchInfo.from_reqs(live, VOCAB, "cpu")
    steps = [[3, 0], [3, 5], [2, 5]]
    for ids in steps:
        info.update_after_sample(torch.tensor(ids))
    for row, req in enumerate(live):
        req.output_ids = [s[row] for s in steps]
    rebuilt = SamplingBatchInfo.from_reqs(live, VOCAB, "cpu")
    a, b = base_logits(2), base_logits(2)
    info.apply_logits_bias(a)
    rebuilt.apply_logits_bias(b)
    torch.testing.assert_close(a, b)
    assert info.output_lens.tolist() == rebuilt.output_lens.tolist() == [3, 3]


def _expected_rows(reqs: List[FakeReq]) -> torch.Tensor:
    """Each request biased on its own: the reference a batched result must equal row by row."""
    return torch.cat([biased([r]) for r in reqs])


def test_filter_and_merge_keep_rows_aligned() -> None:
    with_pen = [
        make_req(output=[1], frequency_penalty=1.0),
        make_req(output=[2], repetition_penalty=2.0, prompt=[0]),
        make_req(output=[3], presence_penalty=1.0, logit_bias={0: -5}),
    ]
    plain = [make_req(output=[4]), make_req(min_new_tokens=3, eos=[5], sampling_seed=1)]
    a = SamplingBatchInfo.from_reqs(with_pen, VOCAB, "cpu")
    a.filter_batch([2, 0])
    b = SamplingBatchInfo.from_reqs(plain, VOCAB, "cpu")
    a.merge_batch(b)
    order = [with_pen[2], with_pen[0], plain[0], plain[1]]
    logits = base_logits(4)
    a.apply_logits_bias(logits)
    torch.testing.assert_close(logits, _expected_rows(order))
    assert a.seeded_mask.tolist() == [False, False, False, True]

    # And the other way round: a plain batch absorbing a penalised one.
    c = SamplingBatchInfo.from_reqs(plain, VOCAB, "cpu")
    c.merge_batch(SamplingBatchInfo.from_reqs(with_pen, VOCAB, "cpu"))
    c.filter_batch([4, 0, 2])
    logits = base_logits(3)
    c.apply_logits_bias(logits)
    torch.testing.assert_close(logits, _expected_rows([with_pen[2], plain[0], with_pen[0]]))


def test_filter_drops_penalizers_nobody_needs() -> None:
    info = SamplingBatchInfo.from_reqs(
        [make_req(frequency_penalty=1.0), make_req(repetition_penalty=1.2)], VOCAB, "cpu"
    )
    kinds = info.penalizer_orchestrator.penalizers
    assert set(kinds) == {BatchedFrequencyPenalizer, BatchedRepetitionPenalizer}
    info.filter_batch([1])
    info.apply_logits_bias(base_logits(1))
    assert set(info.penalizer_orchestrator.penalizers) == {BatchedRepetitionPenalizer}


def test_flags_follow_filter_and_merge() -> None:
    info = SamplingBatchInfo.from_reqs([make_req(temperature=0), make_req(top_p=0.5, top_k=3)], VOCAB, "cpu")
    assert not info.is_all_greedy and info.need_top_p_sampling and info.need_top_k_sampling
    info.filter_batch([0])
    assert info.is_all_greedy and not info.need_top_p_sampling and not info.need_top_k_sampling
    info.merge_batch(SamplingBatchInfo.from_reqs([make_req(min_p=0.1)], VOCAB, "cpu"))
    assert not info.is_all_greedy and info.need_min_p_sampling
    assert info.top_ks.tolist() == [1, VOCAB]


def test_snapshot_update_lands_before_queued_filter() -> None:
    """Overlap order: step N runs on a snapshot while the scheduler filters the original; the
    next step must see step N's token counted for the surviving rows."""
    reqs = [make_req(frequency_penalty=1.0), make_req(frequency_penalty=2.0), make_req(frequency_penalty=0.5)]
    info = SamplingBatchInfo.from_reqs(reqs, VOCAB, "cpu")
    snapshot_n = info.copy_for_forward()
    info.filter_batch([2, 1])  # the scheduler moves on before step N has run
    info.merge_batch(SamplingBatchInfo.from_reqs([make_req(output=[3], frequency_penalty=1.0)], VOCAB, "cpu"))
    assert snapshot_n.batch_size == 3 and info.batch_size == 3
    snapshot_n.apply_logits_bias(base_logits(3))
    snapshot_n.update_after_sample(torch.tensor([0, 1, 2]))  # step N's tokens
    snapshot_next = info.copy_for_forward()
    logits = base_logits(3)
    snapshot_next.apply_logits_bias(logits)
    expected = base_logits(3)
    expected[0, 2] -= 0.5  # row 2 of step N sampled token 2
    expected[1, 1] -= 2.0  # row 1 of step N sampled token 1
    expected[2, 3] -= 1.0  # merged request's own history
    torch.testing.assert_close(logits, expected)
    assert snapshot_next.output_lens.tolist() == [1, 1, 1]


def test_snapshot_keeps_what_its_replay_read_until_it_is_dropped() -> None:
    """On CUDA the scheduling thread makes the keep indices and new penalty state on its stream,
    and the forward stream reads them when the snapshot is replayed. The snapshot must keep them
    (and the state the replay replaced) until the scheduler drops it, after the forward finished:
    a block freed earlier goes back to the scheduling stream's pool, and its next allocation
    overwrites it before the forward stream's kernels have read it."""
    import gc
    import weakref

    info = SamplingBatchInfo.from_reqs([make_req(frequency_penalty=1.0) for _ in range(3)], VOCAB, "cpu")
    old_lens = weakref.ref(info.penalizer_orchestrator.output_lens)
    old_counts = weakref.ref(info.penalizer_orchestrator.penalizers[BatchedFrequencyPenalizer].state_tensors()[1])
    info.filter_batch([2, 0])
    keep = weakref.ref(info.pending_layout_ops[0][1])
    merged = SamplingBatchInfo.from_reqs([make_req(output=[3], frequency_penalty=1.0)], VOCAB, "cpu")
    merged_lens = weakref.ref(merged.penalizer_orchestrator.output_lens)
    info.merge_batch(merged)
    del merged
    snapshot = info.copy_for_forward()
    snapshot.update_after_sample(torch.tensor([0, 1, 2]))  # the replay, on the forward thread
    gc.collect()
    assert all(ref() is not None for ref in (old_lens, old_counts, keep, merged_lens))
    del snapshot
    gc.collect()
    assert all(ref() is None for ref in (old_lens, old_counts, keep, merged_lens))


def test_state_survives_mixing_inference_mode_and_normal_calls() -> None:
    """The model runner samples under inference_mode; tests and tools may not. Both must work
    on the same batch (tensors made in inference mode cannot be updated in place outside it)."""
    info = SamplingBatchInfo.from_reqs([make_req(frequency_penalty=1.0), make_req(presence_penalty=1.0)], VOCAB, "cpu")
    with torch.inference_mode():
        info.update_after_sample(torch.tensor([1, 2]))
    info.filter_batch([1, 0])
    with torch.inference_mode():
        info.apply_logits_bias(base_logits(2))
        info.update_after_sample(torch.tensor([2, 1]))
    info.update_after_sample(torch.tensor([3, 3]))
    logits = base_logits(2)
    info.apply_logits_bias(logits)
    expected = base_logits(2)
    expected[0, [2, 3]] -= 1.0  # presence: tokens 2 and 3 seen
    expected[1, 1] -= 2.0  # frequency: token 1 twice
    expected[1, 3] -= 1.0
    torch.testing.assert_close(logits, expected)


def test_forward_thread_and_scheduler_thread_interleave_safely() -> None:
    """Overlap shape: one worker thread runs the steps in launch order from snapshots, while the
    main thread launches the next steps and filters / merges the batch without waiting. Whatever
    the interleaving, every step must see exactly the tokens of all earlier steps."""
    import queue
    import threading

    def new_req() -> FakeReq:
        return make_req(frequency_penalty=1.0, min_new_tokens=3, eos=[5])

    jobs: "queue.Queue" = queue.Queue()
    counts: dict = {}  # request id -> tokens sampled so far (worker-side truth)
    errors: List[BaseException] = []

    def worker() -> None:
        while (job := jobs.get()) is not None:
            snapshot, owners, token = job
            try:
                logits = base_logits(len(owners))
                snapshot.apply_logits_bias(logits)
                history = torch.tensor([counts.setdefault(o, [0] * VOCAB) for o in owners], dtype=torch.float32)
                expected = base_logits(len(owners)) - history
                young = [row for row, o in enumerate(owners) if sum(counts[o]) < 3]
                expected[young, 5] = float("-inf")
                torch.testing.assert_close(logits, expected)
                snapshot.update_after_sample(torch.full((len(owners),), token))
                for o in owners:
                    counts[o][token] += 1
            except BaseException as e:  # reported by the main thread
                errors.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    info = SamplingBatchInfo.from_reqs([new_req() for _ in range(4)], VOCAB, "cpu")
    rows = [0, 1, 2, 3]  # request id held by each row
    next_id = 4
    try:
        for step in range(12):
            jobs.put((info.copy_for_forward(), list(rows), step % 4))
            if step % 3 == 1 and len(rows) > 1:  # a request finished: drop the middle row
                keep = [i for i in range(len(rows)) if i != len(rows) // 2]
                info.filter_batch(keep)
                rows = [rows[i] for i in keep]
            if step % 2 == 0:  # a prefill batch joins the running batch
                info.merge_batch(SamplingBatchInfo.from_reqs([new_req()], VOCAB, "cpu"))
                rows.append(next_id)
                next_id += 1
    finally:
        jobs.put(None)
        thread.join(timeout=60)
    assert not errors, errors[0]
    assert sum(sum(c) for c in counts.values()) > 30


def test_seeds_dropped_when_no_seeded_row_left_and_empty_filter() -> None:
    info = SamplingBatchInfo.from_reqs([make_req(sampling_seed=3), make_req(frequency_penalty=1.0)], VOCAB, "cpu")
    info.filter_batch([1])
    assert info.seeds is None and info.seeded_mask is None
    info.filter_batch([])
    assert info.batch_size == 0 and info.is_all_greedy
    info.merge_batch(SamplingBatchInfo.from_reqs([make_req(output=[2], presence_penalty=1.0)], VOCAB, "cpu"))
    logits = base_logits(1)
    info.apply_logits_bias(logits)
    torch.testing.assert_close(logits, _expected_rows([make_req(output=[2], presence_penalty=1.0)]))
