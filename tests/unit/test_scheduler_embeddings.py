"""The scheduler's embedding path with a deterministic fake worker: prefill-only batches, whole
(unchunked) inputs where the model needs them, chunks and cached prefixes where it does not, KV
released after every request (the strict idle memory check), refusals, aborts, and identical
results from the normal and the overlap loop."""

from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch

from engine.errors import NOT_A_GENERATION_MODEL, NOT_AN_EMBEDDING_MODEL
from engine.scheduler.tp_worker import EmbeddingBatchResult
from sched_utils import FakeWorker, ForwardRecord, Harness

CHUNK = 16


class FakeEmbeddingWorker(FakeWorker):
    """Each request's vector is computed from the tokens of its forward only:
    - reusable K/V (last-token pooling): [last token id, position of the last token + 1], which a
      correct chunked or prefix-cached prefill still gets right;
    - not reusable (an encoder): [sum of the forward's ids, number of them], right only when the
      whole input ran in one forward.
    Then truncated to the request's `dimensions` (padded with 1.0 up to 4 values first)."""

    def __init__(self, reusable: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.reusable = reusable

    def get_worker_info(self):
        info = super().get_worker_info()
        info.update(is_generation=False, max_req_input_len=min(self.context_len, self.max_total_tokens),
                    embedding_kv_reusable=self.reusable)
        return info

    def forward_batch_embedding(self, batch) -> EmbeddingBatchResult:
        assert batch.forward_mode.is_extend() and not batch.forward_mode.is_mixed()
        self.records.append(ForwardRecord(batch.forward_mode.name, batch.batch_size, list(batch.extend_seq_lens),
                                          batch.req_pool_indices.tolist()))
        ids = batch.input_ids.tolist()
        rows, start = [], 0
        for ext, prefix in zip(batch.extend_seq_lens, batch.extend_prefix_lens):
            part = ids[start:start + ext]
            start += ext
            rows.append([part[-1], prefix + ext] if self.reusable else [sum(part), ext])
        vectors = torch.tensor([r + [1.0, 1.0] for r in rows], dtype=torch.float32)
        dims = batch.dimensions
        if dims is not None:
            return EmbeddingBatchResult(embeddings=[v[:d] if d else v for v, d in zip(vectors, dims)])
        return EmbeddingBatchResult(embeddings=vectors)


def vector(out) -> List[float]:
    return np.frombuffer(out.embedding, dtype="<f4").tolist()


def prompts(lengths: List[int], seed: int = 0) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 900, (n,), generator=gen).tolist() for n in lengths]


def harness(reusable: bool, overlap: bool, **kwargs) -> Harness:
    worker = FakeEmbeddingWorker(reusable, max_total_tokens=kwargs.pop("max_total_tokens", 512), context_len=128)
    return Harness(worker=worker, overlap=overlap, chunked_prefill_size=CHUNK, **kwargs)


@pytest.mark.parametrize("overlap", [False, True])
def test_encoder_inputs_run_whole_in_prefill_only_batches(overlap):
    h = harness(reusable=False, overlap=overlap)
    inputs = prompts([5, 40, 12, 30, 3, 16, 70])
    rids = [h.submit_embedding(p) for p in inputs]
    h.run_until_idle()  # strict memory check on idle: every slot came back
    for rid, p in zip(rids, inputs):
        out = h.outputs[rid]
        assert out.finished_reason == {"type": "length", "length": 0}
        assert vector(out) == [sum(p), len(p), 1.0, 1.0]  # the whole input in one forward
        assert out.prompt_tokens == len(p) and out.cached_tokens == 0
    assert set(h.modes()) == {"EXTEND"}
    for record in h.worker.records:
        # Never cut: a batch past the chunk budget is one input alone.
        assert sum(record.extend_lens) <= CHUNK or record.bs == 1
    assert sorted(n for r in h.worker.records for n in r.extend_lens) == sorted(map(len, inputs))
    assert h.scheduler.tree_cache.evictable_size() == 0  # nothing cached (ChunkCache)


@pytest.mark.parametrize("overlap", [False, True])
def test_decoder_embeddings_are_chunked_and_cached(overlap):
    h = harness(reusable=True, overlap=overlap)
    long, short = prompts([40, 9], seed=1)
    first = h.submit_embedding(long)
    h.run_until_idle()
    assert vector(h.outputs[first]) == [long[-1], 40, 1.0, 1.0]
    assert [r.extend_lens for r in h.worker.records] == [[16], [16], [8]]  # chunked
    again = h.submit_embedding(long)
    other = h.submit_embedding(long[:20] + short)
    h.run_until_idle()
    assert vector(h.outputs[again]) == [long[-1], 40, 1.0, 1.0]
    assert h.outputs[again].cached_tokens == 39  # all but the last token, which is recomputed
    assert vector(h.outputs[other]) == [short[-1], 29, 1.0, 1.0]
    assert h.outputs[other].cached_tokens == 20
    assert h.scheduler.tree_cache.evictable_size() > 0  # the prompts stay cached, unlocked


def test_overlap_and_normal_loops_give_the_same_vectors():
    inputs = prompts([3, 50, 17, 8, 33, 1, 64, 20])
    results = []
    for overlap in (False, True):
        h = harness(reusable=False, overlap=overlap)
        rids = [h.submit_embedding(p, dimensions=2 if i % 3 == 0 else None) for i, p in enumerate(inputs)]
        h.run_until_idle()
        results.append([vector(h.outputs[r]) for r in rids])
    assert results[0] == results[1]
    assert [len(v) for v in results[0]] == [2 if i % 3 == 0 else 4 for i in range(len(inputs))]


def test_refusals_abort_at_admission_with_400():
    h = harness(reusable=False, overlap=False)
    generate = h.submit([1, 2, 3], max_new_tokens=4)
    too_long = h.submit_embedding(list(range(129)))
    bad_id = h.submit_embedding([1, 5000])
    fine = h.submit_embedding(list(range(128)))  # exactly the context: no room for output needed
    h.run_until_idle()
    assert h.outputs[generate].finished_reason["message"] == NOT_A_GENERATION_MODEL
    assert "exceeds the maximum allowed length (128 tokens)" in h.outputs[too_long].finished_reason["message"]
    assert "out of range" in h.outputs[bad_id].finished_reason["message"]
    for rid in (generate, too_long, bad_id):
        assert h.outputs[rid].finished_reason["status_code"] == 400
        assert h.outputs[rid].embedding in (None, b"")
    assert vector(h.outputs[fine]) == [sum(range(128)), 128, 1.0, 1.0]

    gen = Harness()  # a generation server refuses embedding requests
    rid = gen.submit_embedding([1, 2, 3])
    gen.run_until_idle()
    reason = gen.outputs[rid].finished_reason
    assert reason["type"] == "abort" and reason["message"] == NOT_AN_EMBEDDING_MODEL


@pytest.mark.parametrize("overlap", [False, True])
def test_abort_of_waiting_and_running_embedding_requests(overlap):
    h = harness(reusable=False, overlap=overlap, max_running_requests=2)
    rids = [h.submit_embedding(p) for p in prompts([10, 10, 10, 10])]
    h.step()  # admits the first two; the others wait
    h.abort(rids[0])
    h.abort(rids[3])
    h.run_until_idle()
    assert h.outputs[rids[3]].finished_reason["type"] == "abort"
    assert h.outputs[rids[1]].finished_reason["type"] == "length"
    # rids[0] was admitted: it finishes (its forward ran) or ends aborted, never both, never lost.
    assert h.outputs[rids[0]].finished_reason["type"] in ("length", "abort")
