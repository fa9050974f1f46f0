"""Pydantic bodies of the embedding endpoints: OpenAI's /v1/embeddings and SGLang's /encode.

Shapes are checked here (a bad body is a 400 before anything reaches the TokenizerManager);
what depends on the model (context length, vocabulary, Matryoshka `dimensions`) is checked by
the TokenizerManager's EmbeddingNormalizer.
"""

from __future__ import annotations

from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from engine.entrypoints.openai.sglang_fields import NATIVE_UNSUPPORTED, refuse_unsupported

EmbeddingInput = Union[str, List[str], List[int], List[List[int]]]

# Fields of SGLang's EmbeddingReqInput beyond the generate ones that it sends unset.
ENCODE_UNSUPPORTED = {
    **NATIVE_UNSUPPORTED,
    "sampling_params": ((None, {}), "an embedding request does not sample"),
    "is_cross_encoder_request": ((None, False), "cross-encoder scoring is not implemented"),
    "return_pooled_hidden_states": ((None, False), "returning pooled hidden states is not implemented"),
}


def check_embedding_input(value: Any, name: str) -> Any:
    """Non-empty: no empty list, no empty string, no empty or negative token-id list."""
    if isinstance(value, str):
        if value == "":
            raise ValueError(f"{name} must not be an empty string")
        return value
    if not value:
        raise ValueError(f"{name} must not be an empty list")
    for item in value:
        if isinstance(item, str) and item == "":
            raise ValueError(f"{name} must not contain an empty string")
        if isinstance(item, list) and not item:
            raise ValueError(f"{name} must not contain an empty token-id list")
        tokens = item if isinstance(item, list) else [item] if isinstance(item, int) else []
        if any(t < 0 for t in tokens):
            raise ValueError(f"{name} token ids must be non-negative")
    return value


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings (OpenAI). Unknown fields are ignored, as OpenAI and SGLang do."""

    model_config = ConfigDict(extra="ignore", strict=True)

    input: EmbeddingInput
    model: Optional[str] = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # SGLang extra: request id(s), as for the other endpoints.
    rid: Optional[Union[str, List[str]]] = None

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return check_embedding_input(value, "input")


class EncodeRequest(BaseModel):
    """POST /encode (SGLang's native EmbeddingReqInput body)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: Optional[Union[str, List[str]]] = None
    input_ids: Optional[Union[List[int], List[List[int]]]] = None
    rid: Optional[Union[str, List[str]]] = None
    dimensions: Optional[int] = None
    # Informational (SGLang's router adds `model`); they change nothing computed.
    model: Optional[str] = None
    log_metrics: bool = True

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        return refuse_unsupported(data, ENCODE_UNSUPPORTED)

    @model_validator(mode="after")
    def _check_prompt(self) -> "EncodeRequest":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text or input_ids must be given")
        if self.text is not None:
            check_embedding_input(self.text, "text")
        else:
            check_embedding_input(self.input_ids, "input_ids")
        return self


class EmbeddingObject(BaseModel):
    object: Literal["embedding"] = "embedding"
    embedding: Union[List[float], str]  # a base64 string of float32 little-endian values
    index: int


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    """The documented response shape (the handler writes it directly, without validation)."""

    object: Literal["list"] = "list"
    data: List[EmbeddingObject]
    model: str
    usage: EmbeddingUsage
