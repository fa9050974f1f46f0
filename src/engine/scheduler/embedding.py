"""The scheduler's embedding path: prefill-only requests that return a pooled vector.

A server runs either a generative model or an embedding model (as in SGLang). On an embedding
server a TokenizedEmbeddingReqInput becomes a `Req` with `max_new_tokens = 0`, so the ordinary
machinery schedules it: the waiting queue, the policy, the PrefillAdder (token budgets), prefix
matching and chunked prefill where the model allows them (`Req.can_reuse_kv`). Its batch runs
`forward_batch_embedding` instead of the sampler; when the request's last (or only) chunk is
processed its vector is kept, its KV released through the one release path
(`cache_finished_req`: inserted into the radix tree when reusable, freed otherwise), and the
request is reported in a BatchEmbeddingOutput sent straight to the TokenizerManager. An embedding
request never joins the running (decode) batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

from engine.io_struct import BatchEmbeddingOutput, TokenizedEmbeddingReqInput
from engine.scheduler.req import FINISH_LENGTH, Req

if TYPE_CHECKING:
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.scheduler.tp_worker import EmbeddingBatchResult
    from engine.mem_cache.base_prefix_cache import BasePrefixCache


def make_embedding_req(recv: TokenizedEmbeddingReqInput, vocab_size: int, can_reuse_kv: bool) -> Req:
    from engine.sampling.sampling_params import SamplingParams

    req = Req(rid=recv.rid, origin_input_ids=recv.input_ids, sampling_params=SamplingParams(max_new_tokens=0),
              origin_input_text=recv.input_text, vocab_size=vocab_size)
    req.is_embedding = True
    req.http_worker = recv.http_worker
    req.dimensions = recv.dimensions
    req.can_reuse_kv = can_reuse_kv
    return req


def validate_embedding_input(req: Req, max_input_len: int, vocab_size: int) -> Optional[str]:
    """The checks only the scheduler can make for sure (the TokenizerManager made them first)."""
    ids = req.origin_input_ids
    if not ids:
        return "The input is empty; give at least one token."
    if len(ids) > max_input_len:
        return (f"Input length ({len(ids)} tokens) exceeds the maximum allowed length "
                f"({max_input_len} tokens). Use a shorter input.")
    if min(ids) < 0 or max(ids) >= vocab_size:
        return f"Input token ids must be in [0, {vocab_size}); got an id out of range."
    return None


def process_embedding_result(batch: "ScheduleBatch", result: "EmbeddingBatchResult", tree_cache: BasePrefixCache,
                             insert_into_cache: bool) -> List[Req]:
    """Store each finished request's vector and release its KV; returns the requests to report."""
    embeddings = result.embeddings
    emit: List[Req] = []
    for i, req in enumerate(batch.reqs):
        if req.finished():  # torn down while in flight (an aborted chunked request)
            emit.append(req)
            continue
        if req.is_chunked > 0:
            req.is_chunked -= 1  # a middle chunk: its pooled row is of a partial input
            continue
        if req.to_finish is not None:  # aborted while its forward ran
            req.finished_reason, req.to_finish = req.to_finish, None
            tree_cache.cache_finished_req(req, is_insert=False)
        else:
            req.embedding = embeddings[i]
            req.finished_reason = FINISH_LENGTH(0)
            tree_cache.cache_finished_req(req, is_insert=insert_into_cache)
        emit.append(req)
    return emit


def build_embedding_output(reqs: List[Req]) -> Optional[BatchEmbeddingOutput]:
    """One message for the finished embedding requests of an iteration (each reported once)."""
    out = BatchEmbeddingOutput(rids=[], finished_reasons=[], embeddings=[], prompt_tokens=[], cached_tokens=[],
                               http_workers=[])
    seen = set()
    for req in reqs:
        reason = req.finished_reason
        if id(req) in seen or reason is None or req.finished_output:
            continue
        seen.add(id(req))
        req.finished_output = True
        out.rids.append(req.rid)
        out.finished_reasons.append(reason.to_json())
        vector = b"" if req.embedding is None else req.embedding.numpy().astype("<f4", copy=False).tobytes()
        req.embedding = None  # a row view of the batch's tensor: do not keep the batch alive
        out.embeddings.append(vector)
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.cached_tokens.append(req.cached_tokens)
        out.http_workers.append(req.http_worker)
    return out if out.rids else None

