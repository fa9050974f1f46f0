"""Embedding requests on the TokenizerManager's side: normalisation, tokenization, results.

`EmbeddingReqInput` is SGLang's request of /encode, /v1/embeddings and Engine.encode: one text or
token-id list, or a batch of them, and the Matryoshka `dimensions` to keep. The
`EmbeddingNormalizer` checks it against the model (the limits its scheduler reported) and turns
each input into a TokenizedEmbeddingReqInput; inputs longer than the context are a 400 unless
the server truncates (--allow-auto-truncate). The scheduler answers with BatchEmbeddingOutput
entries, whose float32 bytes `apply_embedding_output` stores in the request's state, and
`EmbeddingResult` is what the callers get back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

import numpy as np

from engine.errors import EngineRequestError
from engine.io_struct import BatchEmbeddingOutput, TokenizedEmbeddingReqInput
from engine.tokenizer.output_assembly import ReqState
from engine.tokenizer.request_normalizer import bound_text, normalize_rids, split_prompts

# One request may carry at most this many inputs (OpenAI's limit for /v1/embeddings).
MAX_EMBEDDING_INPUTS = 2048


@dataclass
class EmbeddingReqInput:
    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    rid: Optional[Union[str, List[str]]] = None
    dimensions: Optional[int] = None  # keep this many leading dimensions (Matryoshka models)

    # Filled by normalize(): one entry per input.
    is_single: bool = field(default=True, init=False)
    batch_size: int = field(default=1, init=False)
    # The same lists, typed: the inputs as texts or as token-id lists (one of the two), and rids.
    texts: Optional[List[str]] = field(default=None, init=False, repr=False)
    token_ids: Optional[List[List[int]]] = field(default=None, init=False, repr=False)
    rids: List[str] = field(default_factory=list, init=False, repr=False)
    _normalized: bool = field(default=False, init=False, repr=False)

    def normalize(self) -> None:
        """Validate shapes; text/input_ids/rid become lists with one entry per input."""
        if self._normalized:
            return
        # The prompt and rid rules are those of /generate (one rid for a batch is a prefix).
        texts, ids, is_batch = split_prompts(self.text, self.input_ids)
        inputs = texts if texts is not None else ids
        assert inputs is not None  # split_prompts returns one of the two
        count = len(inputs)
        if count == 0:
            raise EngineRequestError("The batch of inputs is empty.")
        if count > MAX_EMBEDDING_INPUTS:
            raise EngineRequestError(f"At most {MAX_EMBEDDING_INPUTS} inputs are allowed per request, got {count}.")
        if texts is not None and any(t == "" for t in texts):
            raise EngineRequestError("An input text is empty; every input must contain some text.")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)):
            raise EngineRequestError(f"dimensions must be an integer, got {self.dimensions!r}.")
        self.rids = normalize_rids(self.rid, count, is_batch)
        self.texts, self.token_ids = texts, ids
        self.rid, self.text, self.input_ids = self.rids, texts, ids
        self.batch_size = count
        self.is_single = not is_batch
        self._normalized = True


@dataclass(frozen=True)
class EmbeddingModelInfo:
    """What the scheduler reported about the model (its "ready" message)."""

    is_generation: bool
    max_input_len: int
    vocab_size: Optional[int]
    embedding_dim: Optional[int]
    is_matryoshka: bool
    matryoshka_dimensions: Optional[List[int]]
    model_name: str

    @classmethod
    def from_scheduler_info(cls, info: Dict[str, Any], model_name: str) -> "EmbeddingModelInfo":
        return cls(
            is_generation=bool(info.get("is_generation", True)),
            max_input_len=int(info.get("max_req_input_len", info["context_len"])),
            vocab_size=info.get("vocab_size"),
            embedding_dim=info.get("embedding_dim"),
            is_matryoshka=bool(info.get("is_matryoshka", False)),
            matryoshka_dimensions=info.get("matryoshka_dimensions"),
            model_name=model_name,
        )


class EmbeddingNormalizer:
    """Tokenizes and validates an EmbeddingReqInput (all inputs before anything is sent)."""

    def __init__(self, tokenizer: Any, model: EmbeddingModelInfo, allow_auto_truncate: bool) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.allow_auto_truncate = allow_auto_truncate

    def tokenize(self, obj: EmbeddingReqInput) -> List[TokenizedEmbeddingReqInput]:
        obj.normalize()
        self.check_dimensions(obj.dimensions)
        texts = obj.texts
        if obj.token_ids is not None:
            all_ids = [self._fit(list(ids)) for ids in obj.token_ids]
        else:
            assert texts is not None  # normalize() kept one of the two
            all_ids = self._encode(texts)
        out = []
        for i, ids in enumerate(all_ids):
            self._check_ids(ids)
            out.append(TokenizedEmbeddingReqInput(
                rid=obj.rids[i], input_ids=ids, input_text=texts[i] if texts is not None else None,
                dimensions=obj.dimensions))
        return out

    def check_dimensions(self, dimensions: Optional[int]) -> None:
        """SGLang's rules (and messages) for Matryoshka truncation."""
        if dimensions is None:
            return
        model = self.model
        if not model.is_matryoshka:
            raise EngineRequestError(f"Model '{model.model_name}' does not support matryoshka representation, "
                                     "changing output dimensions will lead to poor results.")
        if dimensions < 1:
            raise EngineRequestError("Requested dimensions must be greater than 0")
        if model.matryoshka_dimensions and dimensions not in model.matryoshka_dimensions:
            raise EngineRequestError(f"Model '{model.model_name}' only supports {model.matryoshka_dimensions} "
                                     "matryoshka dimensions, using other output dimensions will lead to poor results.")
        if model.embedding_dim is not None and dimensions > model.embedding_dim:
            raise EngineRequestError(f"Provided dimensions are greater than max embedding dimension: "
                                     f"{model.embedding_dim}")

    def _encode(self, texts: List[str]) -> List[List[int]]:
        if self.tokenizer is None:
            raise EngineRequestError("This server has no tokenizer (--skip-tokenizer-init): send input_ids.")
        texts = [bound_text(text, self.model.max_input_len, self.allow_auto_truncate) for text in texts]
        if self.allow_auto_truncate:
            # Through the tokenizer, so that the special tokens ([SEP], EOS) stay at the end, as
            # sentence-transformers truncates.
            encoded = self.tokenizer(texts, truncation=True, max_length=self.model.max_input_len)
        else:
            encoded = self.tokenizer(texts)
        return [list(ids) for ids in encoded["input_ids"]]

    def _fit(self, ids: List[int]) -> List[int]:
        return ids[: self.model.max_input_len] if self.allow_auto_truncate else ids

    def _check_ids(self, ids: List[int]) -> None:
        if not ids:
            raise EngineRequestError("The input is empty.")
        vocab = self.model.vocab_size
        if vocab is not None and max(ids) >= vocab:
            raise EngineRequestError(
                f"Token id {max(ids)} in input_ids is out of range for the vocabulary of size {vocab}.")
        limit = self.model.max_input_len
        if len(ids) > limit:
            raise EngineRequestError(
                f"The input ({len(ids)} tokens) is longer than the model's context length ({limit} tokens).")


@dataclass
class EmbeddingResult:
    rid: str
    embedding: np.ndarray  # float32
    prompt_tokens: int
    cached_tokens: int
    finish_reason: Optional[dict]
    e2e_latency: float

    def meta_info(self) -> dict:
        return {
            "id": self.rid,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "e2e_latency": self.e2e_latency,
        }

    def to_dict(self) -> dict:
        """SGLang's /encode and Engine.encode shape."""
        return {"embedding": self.embedding.tolist(), "meta_info": self.meta_info()}


def apply_embedding_output(states: Dict[str, ReqState], msg: BatchEmbeddingOutput) -> List[ReqState]:
    """Finish the waiting states of a BatchEmbeddingOutput (states are the TokenizerManager's);
    returns the states it finished."""
    finished = []
    for i, rid in enumerate(msg.rids):
        state = states.get(rid)
        if state is None or state.finished:
            continue  # aborted or ended on our side already
        state.embedding = msg.embeddings[i]
        state.prompt_tokens = msg.prompt_tokens[i]
        state.cached_tokens = msg.cached_tokens[i]
        reason = msg.finished_reasons[i]
        state.finished_reason = dict(reason) if reason is not None else None
        state.finished = True
        state.notify_update()
        finished.append(state)
    return finished


def embedding_result(state: ReqState) -> EmbeddingResult:
    """The result of a finished state; an abort becomes the error it carries."""
    reason = state.finished_reason or {}
    if reason.get("type") == "abort":
        status = int(reason.get("status_code") or 400)
        default_type = "BadRequestError" if status < 500 else (
            "ServiceUnavailableError" if status == 503 else "InternalServerError")
        raise EngineRequestError(reason.get("message") or "The request was aborted.", status,
                                 reason.get("err_type") or default_type)
    if state.embedding is None:
        raise EngineRequestError("Internal error: the request finished without an embedding.", 500,
                                 "InternalServerError")
    return EmbeddingResult(
        rid=state.rid,
        embedding=np.frombuffer(state.embedding, dtype="<f4"),
        prompt_tokens=state.prompt_tokens,
        cached_tokens=state.cached_tokens,
        finish_reason=state.finished_reason,
        e2e_latency=time.time() - state.created_time,
    )
