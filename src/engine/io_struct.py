"""Messages between processes: msgspec structs in one tagged union, encoded with msgpack.

Channels (PUSH -> PULL over ipc:// files named in PortArgs):
  tokenizer manager -> scheduler rank 0: TokenizedGenerateReqInput, TokenizedEmbeddingReqInput,
                                         AbortReq, FlushCacheReqInput, GetInternalStateReq
  scheduler rank 0  -> detokenizer:      BatchTokenIDOutput (one per scheduler iteration)
  detokenizer       -> tokenizer:        BatchStrOutput
  scheduler rank 0  -> tokenizer:        FlushCacheReqOutput, GetInternalStateReqOutput,
                                         BatchEmbeddingOutput (no text to detokenize), and the
                                         reply of every control request below (CONTROL_REPLIES)

Control requests (weights, memory, pause/continue) carry SGLang's names and fields; each gets
exactly one reply per DP replica, from TP rank 0, after every rank has done its part.

With several HTTP workers (--tokenizer-worker-num), each has its own TokenizerManager and its
own pair of sockets; every message a TokenizerManager sends names its worker (`http_worker`), a
control reply carries the asker's worker back, and the batch outputs carry one worker per row
(`http_workers`), so that each row and each reply reaches the worker that waits for it
(`route_to_workers`).
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Tuple, Union

import msgspec

from engine.request_options import RequestOptions


class Routed(msgspec.Struct, kw_only=True):
    """A message to or from one TokenizerManager: `http_worker` is its HTTP worker's index."""

    http_worker: int = 0


class TokenizedGenerateReqInput(Routed, tag=True):
    rid: str
    input_ids: List[int]
    sampling_params: Dict[str, Any]  # SamplingParams fields by SGLang name, already validated
    input_text: Optional[str] = None
    stream: bool = False
    # Everything else the client asked of this sub-request, checked (request_options.py declares
    # each option once; the scheduler's Req keeps this value).
    options: RequestOptions = msgspec.field(default_factory=RequestOptions)


class TokenizedEmbeddingReqInput(Routed, tag=True):
    rid: str
    input_ids: List[int]
    input_text: Optional[str] = None
    dimensions: Optional[int] = None  # Matryoshka truncation, already validated; None: all


class AbortReq(Routed, tag=True):
    rid: str = ""  # aborts every request whose rid starts with this (when not abort_all)
    abort_all: bool = False
    # With abort_all: only the requests of the sending HTTP worker (its shutdown), not every one.
    worker_only: bool = False


class FlushCacheReqInput(Routed, tag=True):
    pass


class FlushCacheReqOutput(Routed, tag=True):
    success: bool
    message: str = ""


class GetInternalStateReq(Routed, tag=True):
    pass


class GetInternalStateReqOutput(Routed, tag=True):
    internal_state: Dict[str, Any]


class BatchTokenIDOutput(msgspec.Struct, tag=True):
    """Scheduler -> detokenizer: for each request emitted this iteration, the new token ids."""

    rids: List[str]
    # None while running; else {"type": "stop"|"length"|"abort", "matched": int|str|None,
    # "length": int, "message": str, "status_code": int}
    finished_reasons: List[Optional[Dict[str, Any]]]
    output_ids: List[List[int]]  # new ids since this request's previous emission
    skip_special_tokens: List[bool]
    spaces_between_special_tokens: List[bool]
    no_stop_trim: List[bool]
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    # With a request's first emission, its last few prompt ids: decoding output ids together with
    # this left context keeps tokenizers that render a token by its neighbour (SentencePiece's
    # leading space) right. None on later emissions.
    prompt_tail_ids: List[Optional[List[int]]] = []
    # Logprobs: per request a list (delta since the previous emission), or None when not asked.
    # Input logprobs are sent once, with the first emission; the first entry of each is None.
    input_token_logprobs_val: List[Optional[List[Optional[float]]]] = []
    input_token_logprobs_idx: List[Optional[List[int]]] = []
    input_top_logprobs_val: List[Optional[List[Optional[List[float]]]]] = []
    input_top_logprobs_idx: List[Optional[List[Optional[List[int]]]]] = []
    output_token_logprobs_val: List[Optional[List[float]]] = []
    output_token_logprobs_idx: List[Optional[List[int]]] = []
    output_top_logprobs_val: List[Optional[List[List[float]]]] = []
    output_top_logprobs_idx: List[Optional[List[List[int]]]] = []
    # token_ids_logprob: per request, per position the logprobs of the asked ids (delta).
    input_token_ids_logprobs_val: List[Optional[List[Optional[List[float]]]]] = []
    input_token_ids_logprobs_idx: List[Optional[List[Optional[List[int]]]]] = []
    output_token_ids_logprobs_val: List[Optional[List[List[float]]]] = []
    output_token_ids_logprobs_idx: List[Optional[List[List[int]]]] = []
    # return_hidden_states: per request the new entries (the prompt's [len, hidden] block first,
    # then one [hidden] vector per decode step), or None.
    output_hidden_states: List[Optional[List[Any]]] = []
    # The HTTP worker of each request (empty: all of worker 0).
    http_workers: List[int] = []
    # Speculative decoding (empty when it is off): per request its verify steps so far, the drafts
    # it accepted and the drafts it was proposed (SGLang's spec_verify_ct / spec_accepted_tokens).
    spec_verify_ct: List[int] = []
    spec_accepted_tokens: List[int] = []
    spec_draft_tokens: List[int] = []


class BatchStrOutput(msgspec.Struct, tag=True):
    """Detokenizer -> tokenizer manager: text deltas plus everything of BatchTokenIDOutput."""

    rids: List[str]
    finished_reasons: List[Optional[Dict[str, Any]]]
    output_strs: List[str]  # new text since the previous emission
    output_ids: List[List[int]]
    prompt_tokens: List[int]
    completion_tokens: List[int]
    cached_tokens: List[int]
    input_token_logprobs_val: List[Optional[List[Optional[float]]]] = []
    input_token_logprobs_idx: List[Optional[List[int]]] = []
    input_top_logprobs_val: List[Optional[List[Optional[List[float]]]]] = []
    input_top_logprobs_idx: List[Optional[List[Optional[List[int]]]]] = []
    output_token_logprobs_val: List[Optional[List[float]]] = []
    output_token_logprobs_idx: List[Optional[List[int]]] = []
    output_top_logprobs_val: List[Optional[List[List[float]]]] = []
    output_top_logprobs_idx: List[Optional[List[List[int]]]] = []
    input_token_ids_logprobs_val: List[Optional[List[Optional[List[float]]]]] = []
    input_token_ids_logprobs_idx: List[Optional[List[Optional[List[int]]]]] = []
    output_token_ids_logprobs_val: List[Optional[List[List[float]]]] = []
    output_token_ids_logprobs_idx: List[Optional[List[List[int]]]] = []
    output_hidden_states: List[Optional[List[Any]]] = []
    http_workers: List[int] = []  # as in BatchTokenIDOutput
    spec_verify_ct: List[int] = []  # as in BatchTokenIDOutput
    spec_accepted_tokens: List[int] = []
    spec_draft_tokens: List[int] = []


# ---------------------------------------------------------------------- control requests
class UpdateWeightFromDiskReqInput(Routed, tag=True):
    model_path: str
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    flush_cache: bool = True


class UpdateWeightFromDiskReqOutput(Routed, tag=True):
    success: bool
    message: str = ""
    num_paused_requests: int = 0


class UpdateWeightsFromTensorReqInput(Routed, tag=True):
    # One payload per TP rank (SGLang's layout), or one that every rank reads. A payload holds full,
    # unsharded tensors under checkpoint names (every rank cuts its own shard with the model's weight
    # loaders): a safetensors file, or SGLang's pickled tensors, which only a server started with
    # --enable-pickled-weight-updates decodes (model_executor/tensor_payload.py).
    serialized_named_tensors: List[bytes]
    load_format: Optional[str] = None  # None / "direct": the weight loaders; "flattened_bucket" (pickled)
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None


class UpdateWeightsFromTensorReqOutput(Routed, tag=True):
    success: bool
    message: str = ""


class InitWeightsUpdateGroupReqInput(Routed, tag=True):
    # A torch.distributed group with a trainer (SGLang's): the trainer is rank 0 and hosts the
    # rendezvous at master_address:master_port; TP rank r of this server joins as rank_offset + r.
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"  # "nccl" (CUDA) or "gloo"


class InitWeightsUpdateGroupReqOutput(Routed, tag=True):
    success: bool
    message: str = ""


class DestroyWeightsUpdateGroupReqInput(Routed, tag=True):
    group_name: str = "weight_update_group"


class DestroyWeightsUpdateGroupReqOutput(Routed, tag=True):
    success: bool
    message: str = ""


class UpdateWeightsFromDistributedReqInput(Routed, tag=True):
    # Full tensors the trainer broadcasts from rank 0 over the group, one per name, in this order.
    names: List[str]
    dtypes: List[str]  # torch dtype names: "bfloat16" or "torch.bfloat16"
    shapes: List[List[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    load_format: Optional[str] = None


class UpdateWeightsFromDistributedReqOutput(Routed, tag=True):
    success: bool
    message: str = ""


class GetWeightsByNameReqInput(Routed, tag=True):
    name: str
    truncate_size: int = 100


class GetWeightsByNameReqOutput(Routed, tag=True):
    # The first truncate_size rows (or values) of the full, unsharded parameter; None: no such
    # parameter (message says why).
    parameter: Optional[List[Any]] = None
    message: str = ""


class ReleaseMemoryOccupationReqInput(Routed, tag=True):
    tags: Optional[List[str]] = None  # memory_saver.MEMORY_TAGS ("kv_cache", "weights", ...); None: all


class ReleaseMemoryOccupationReqOutput(Routed, tag=True):
    success: bool = True
    message: str = ""


class ResumeMemoryOccupationReqInput(Routed, tag=True):
    tags: Optional[List[str]] = None


class ResumeMemoryOccupationReqOutput(Routed, tag=True):
    success: bool = True
    message: str = ""


class PauseGenerationReqInput(Routed, tag=True):
    mode: str = "abort"  # "abort" | "retract" | "in_place" (the scheduler sees the last two)


class PauseGenerationReqOutput(Routed, tag=True):
    success: bool = True
    message: str = ""
    num_paused_requests: int = 0


class ContinueGenerationReqInput(Routed, tag=True):
    torch_empty_cache: bool = True


class ContinueGenerationReqOutput(Routed, tag=True):
    success: bool = True
    message: str = ""


class LoadLoRAAdapterReqInput(Routed, tag=True):
    lora_name: str
    lora_path: str
    pinned: bool = False


class LoadLoRAAdapterReqOutput(Routed, tag=True):
    success: bool
    message: str = ""
    # The adapters loaded afterwards: name -> path.
    loaded_adapters: Dict[str, str] = {}


class UnloadLoRAAdapterReqInput(Routed, tag=True):
    lora_name: str


class UnloadLoRAAdapterReqOutput(Routed, tag=True):
    success: bool
    message: str = ""
    loaded_adapters: Dict[str, str] = {}


# Control requests the DP controller fans out to every replica, and their replies.
class ExpertDistributionReq(Routed, tag=True):
    """SGLang's /start_expert_distribution_record, /stop_... and /dump_...: action is one of
    EXPERT_DISTRIBUTION_ACTIONS."""

    action: str


EXPERT_DISTRIBUTION_ACTIONS = ("start_record", "stop_record", "dump_record")


class ExpertDistributionReqOutput(Routed, tag=True):
    success: bool
    message: str = ""
    # dump_record: tokens routed to each expert during the recording, [layer][expert id] (a dense
    # layer's row is zeros).
    logical_count: Optional[List[List[int]]] = None


CONTROL_REQUESTS = (
    FlushCacheReqInput, GetInternalStateReq, UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
    GetWeightsByNameReqInput, ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput,
    PauseGenerationReqInput, ContinueGenerationReqInput, InitWeightsUpdateGroupReqInput,
    DestroyWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, LoadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqInput, ExpertDistributionReq,
)
CONTROL_REPLIES = (
    FlushCacheReqOutput, GetInternalStateReqOutput, UpdateWeightFromDiskReqOutput, UpdateWeightsFromTensorReqOutput,
    GetWeightsByNameReqOutput, ReleaseMemoryOccupationReqOutput, ResumeMemoryOccupationReqOutput,
    PauseGenerationReqOutput, ContinueGenerationReqOutput, InitWeightsUpdateGroupReqOutput,
    DestroyWeightsUpdateGroupReqOutput, UpdateWeightsFromDistributedReqOutput, LoadLoRAAdapterReqOutput,
    UnloadLoRAAdapterReqOutput, ExpertDistributionReqOutput,
)

# The reply type of each control request.
CONTROL_REPLY_OF = dict(zip(CONTROL_REQUESTS, CONTROL_REPLIES))


class BatchEmbeddingOutput(msgspec.Struct, tag=True):
    """Scheduler -> tokenizer manager: the finished embedding requests of one iteration."""

    rids: List[str]
    # {"type": "length", "length": 0} when embedded; an abort reason (as in BatchTokenIDOutput) else.
    finished_reasons: List[Optional[Dict[str, Any]]]
    embeddings: List[bytes]  # float32 little-endian, one vector per request (empty when aborted)
    prompt_tokens: List[int]
    cached_tokens: List[int]
    http_workers: List[int] = []  # as in BatchTokenIDOutput


Message = Union[
    TokenizedGenerateReqInput,
    TokenizedEmbeddingReqInput,
    BatchEmbeddingOutput,
    AbortReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    BatchTokenIDOutput,
    BatchStrOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    InitWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    DestroyWeightsUpdateGroupReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromDistributedReqOutput,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
    ExpertDistributionReq,
    ExpertDistributionReqOutput,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def route_to_workers(msg: Message, num_workers: int) -> List[Tuple[int, Message]]:
    """(HTTP worker, message) pairs for a message bound for the TokenizerManagers.

    A batch output is split into one message per worker holding that worker's rows (every
    per-row column is cut; columns left empty stay empty); anything else goes whole to its
    `http_worker`.
    """
    if num_workers == 1:
        return [(0, msg)]
    if isinstance(msg, (BatchStrOutput, BatchEmbeddingOutput)):
        workers = sorted(set(msg.http_workers))
        if len(workers) <= 1:
            return [(workers[0] if workers else 0, msg)]
        rows = {w: [i for i, x in enumerate(msg.http_workers) if x == w] for w in workers}
        n = len(msg.rids)
        full = [(name, value) for name in msg.__struct_fields__
                if isinstance(value := getattr(msg, name), list) and len(value) == n]
        parts: List[Tuple[int, Message]] = []
        for worker, picked in rows.items():
            # itemgetter picks in C; one row gives a bare item, not a tuple.
            pick = operator.itemgetter(*picked)
            columns = {name: list(pick(value)) if len(picked) > 1 else [value[picked[0]]] for name, value in full}
            parts.append((worker, msgspec.structs.replace(msg, **columns)))
        return parts
    assert isinstance(msg, Routed), f"{type(msg).__name__} is not for a TokenizerManager"
    return [(msg.http_worker, msg)]


def encode(msg: Union[Message, Routed]) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
