"""Messages between processes: msgspec structs in one tagged union, encoded with msgpack.

Channels (PUSH -> PULL over ipc:// files named in PortArgs):
  tokenizer manager -> scheduler rank 0: TokenizedGenerateReqInput, AbortReq, FlushCacheReqInput,
                                         GetInternalStateReq
  scheduler rank 0  -> detokenizer:      BatchTokenIDOutput (one per scheduler iteration)
  detokenizer       -> tokenizer:        BatchStrOutput
  scheduler rank 0  -> tokenizer:        FlushCacheReqOutput, GetInternalStateReqOutput
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

import msgspec


class TokenizedGenerateReqInput(msgspec.Struct, tag=True):
    rid: str
    input_ids: List[int]
    sampling_params: Dict[str, Any]  # SamplingParams fields by SGLang name, already validated
    input_text: Optional[str] = None
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs
    top_logprobs_num: int = 0
    stream: bool = False


class AbortReq(msgspec.Struct, tag=True):
    rid: str = ""  # aborts every request whose rid starts with this (when not abort_all)
    abort_all: bool = False


class FlushCacheReqInput(msgspec.Struct, tag=True):
    pass


class FlushCacheReqOutput(msgspec.Struct, tag=True):
    success: bool
    message: str = ""


class GetInternalStateReq(msgspec.Struct, tag=True):
    pass


class GetInternalStateReqOutput(msgspec.Struct, tag=True):
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


Message = Union[
    TokenizedGenerateReqInput,
    AbortReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    BatchTokenIDOutput,
    BatchStrOutput,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
