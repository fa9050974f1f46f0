"""POST /v1/embeddings (OpenAI) and POST /encode (SGLang) over TokenizerManager.encode_request.

Vectors leave the engine as float32. `encoding_format: "float"` writes them as JSON numbers (the
shortest decimal that reads back as the same float32), `"base64"` as the base64 of their
little-endian bytes, which is what OpenAI's client asks for by default and decodes with numpy.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any, List, Union

import orjson
from fastapi import Request
from fastapi.responses import Response

from engine.entrypoints.openai.embedding_protocol import EmbeddingRequest, EncodeRequest
from engine.entrypoints.openai.utils import ClientConnection, error_response_from_exception
from engine.tokenizer.embedding_requests import EmbeddingReqInput, EmbeddingResult
from engine.errors import EngineRequestError
from engine.tokenizer.tokenizer_manager_protocol import TokenizerManagerProtocol

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from engine.entrypoints.openai.embedding_protocol import EmbeddingInput


class NumpyJsonResponse(Response):
    """JSON with numpy arrays written natively (no conversion to Python floats on the way)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class OpenAIServingEmbedding:
    def __init__(self, tokenizer_manager: TokenizerManagerProtocol) -> None:
        self.tokenizer_manager = tokenizer_manager

    async def handle_request(self, body: EmbeddingRequest, raw_request: Request) -> Response:
        value = body.input
        if _is_token_input(value):
            obj = EmbeddingReqInput(input_ids=value, rid=body.rid, dimensions=body.dimensions)
        else:
            obj = EmbeddingReqInput(text=value, rid=body.rid, dimensions=body.dimensions)
        try:
            results = await self.tokenizer_manager.encode_request(obj, ClientConnection(raw_request))
        except (EngineRequestError, ValueError) as exc:
            return error_response_from_exception(exc)
        as_base64 = body.encoding_format == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(r.embedding.tobytes()).decode("ascii") if as_base64 else r.embedding}
                for i, r in enumerate(results)]
        prompt_tokens = sum(r.prompt_tokens for r in results)
        return NumpyJsonResponse({
            "object": "list",
            "data": data,
            "model": self.tokenizer_manager.served_model_name,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        })


async def handle_encode(tokenizer_manager: TokenizerManagerProtocol, body: EncodeRequest, raw_request: Request) -> Response:
    """SGLang's /encode: {"embedding": [...], "meta_info": {...}}, or a list for a batch."""
    obj = EmbeddingReqInput(text=body.text, input_ids=body.input_ids, rid=body.rid, dimensions=body.dimensions)
    try:
        results: List[EmbeddingResult] = await tokenizer_manager.encode_request(obj, ClientConnection(raw_request))
    except (EngineRequestError, ValueError) as exc:
        return error_response_from_exception(exc)
    outputs = [_encode_output(r) for r in results]
    return NumpyJsonResponse(outputs[0] if obj.is_single else outputs)


def _is_token_input(value: EmbeddingInput) -> TypeIs[Union[List[int], List[List[int]]]]:
    """Token ids (a non-empty list whose first entry is not a string), not text."""
    return isinstance(value, list) and bool(value) and not isinstance(value[0], str)


def _encode_output(result: EmbeddingResult) -> dict:
    # The array itself: orjson writes it as numbers without a Python list in between.
    return {"embedding": result.embedding, "meta_info": result.meta_info()}
