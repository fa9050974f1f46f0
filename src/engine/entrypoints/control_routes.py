"""HTTP routes of the control plane, with SGLang's paths, bodies and answers.

    POST      /update_weights_from_disk    {"model_path", "load_format", "abort_all_requests",
                                            "weight_version", "flush_cache", ...}
    GET|POST  /get_weights_by_name         {"name", "truncate_size"}
    GET|POST  /release_memory_occupation   {"tags": ["weights", "kv_cache"] | null}
    GET|POST  /resume_memory_occupation    {"tags": ...}
    POST      /pause_generation            {"mode": "abort" | "retract" | "in_place"} (optional body)
    POST      /continue_generation         {"torch_empty_cache": true} (optional body)

A refusal is HTTP 400 with the OpenAI-style error body; the weight routes' bodies also keep
SGLang's keys (`success`, `message`, `num_paused_requests`) so that its clients read them as usual.
`update_weights_from_tensor` is offered by the offline Engine only: SGLang's HTTP form of it
carries pickled tensors, which this server never deserializes.
"""

from __future__ import annotations

import logging
from typing import List, Literal, Optional

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.entrypoints.openai.utils import OrjsonResponse, create_error_response, error_body
from engine.managers.errors import EngineRequestError
from engine.managers.io_struct import UpdateWeightFromDiskReqInput
from engine.managers.tokenizer_manager_protocol import TokenizerManagerProtocol

logger = logging.getLogger(__name__)

# What a failed /update_weights_from_disk answers, whatever the reason: a reason naming what the
# path holds (no such directory, no config.json, another architecture) would let a client map the
# server's files. The reason goes to the server log.
WEIGHTS_FROM_DISK_FAILED = (
    "The weights were not updated from model_path: it must be a directory, readable by the server, holding "
    "a safetensors checkpoint of the running model's architecture, and no request may hold KV cache of the "
    "current weights unless flush_cache is false. The server log has the reason.")


class _Body(BaseModel):
    # Fields of newer SGLang versions are ignored like unknown fields of the OpenAI routes.
    model_config = ConfigDict(extra="ignore", strict=True, protected_namespaces=())


class UpdateWeightFromDiskBody(_Body):
    model_path: str = Field(min_length=1)
    load_format: Optional[str] = None
    abort_all_requests: bool = False
    weight_version: Optional[str] = None
    flush_cache: bool = True
    # SGLang's other fields: accepted with the values that ask for what this server does.
    is_async: bool = False
    keep_pause: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0

    @model_validator(mode="after")
    def _check_supported(self) -> "UpdateWeightFromDiskBody":
        if self.is_async:
            raise ValueError("is_async is not supported: the update completes before the answer")
        if self.keep_pause:
            raise ValueError("keep_pause is not supported: pause with /pause_generation instead")
        # Checked here, before any file is looked at: a failure after that has one answer only.
        if self.load_format not in (None, "auto", "safetensors"):
            raise ValueError(f"load_format {self.load_format!r} is not supported: auto or safetensors")
        return self


class GetWeightsByNameBody(_Body):
    name: str = Field(min_length=1)
    truncate_size: int = Field(default=100, ge=0)


class MemoryTagsBody(_Body):
    tags: Optional[List[str]] = None


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(_Body):
    torch_empty_cache: bool = True


def add_control_routes(app: FastAPI, tokenizer_manager: TokenizerManagerProtocol) -> None:
    """The routes over `tokenizer_manager.control` (ControlCalls), looked up per call."""

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightFromDiskBody) -> Response:
        obj = UpdateWeightFromDiskReqInput(model_path=body.model_path, load_format=body.load_format,
                                           abort_all_requests=body.abort_all_requests,
                                           weight_version=body.weight_version, flush_cache=body.flush_cache)
        success, message, num_paused = await tokenizer_manager.control.update_weights_from_disk(obj)
        if success:
            return OrjsonResponse({"success": True, "message": message, "num_paused_requests": num_paused})
        logger.warning("update_weights_from_disk from %r failed: %s", body.model_path, message)
        content = {"success": False, "message": WEIGHTS_FROM_DISK_FAILED, "num_paused_requests": num_paused}
        return OrjsonResponse({**error_body(WEIGHTS_FROM_DISK_FAILED, 400), **content}, status_code=400)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: GetWeightsByNameBody) -> Response:
        try:
            parameter = await tokenizer_manager.control.get_weights_by_name(body.name, body.truncate_size)
            return OrjsonResponse(parameter)
        except EngineRequestError as exc:
            return create_error_response(exc.message, exc.status_code)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory_occupation(body: Optional[MemoryTagsBody] = None) -> Response:
        tags = body.tags if body is not None else None
        return _answer(await tokenizer_manager.control.release_memory_occupation(tags))

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory_occupation(body: Optional[MemoryTagsBody] = None) -> Response:
        tags = body.tags if body is not None else None
        return _answer(await tokenizer_manager.control.resume_memory_occupation(tags))

    @app.post("/pause_generation")
    async def pause_generation(body: Optional[PauseGenerationBody] = None) -> Response:
        result = await tokenizer_manager.control.pause_generation(body.mode if body is not None else "abort")
        if not result["success"]:
            return create_error_response(result["message"], 400)
        return OrjsonResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(body: Optional[ContinueGenerationBody] = None) -> Response:
        empty_cache = body.torch_empty_cache if body is not None else True
        result = await tokenizer_manager.control.continue_generation(empty_cache)
        if not result["success"]:
            return create_error_response(result["message"], 400)
        return OrjsonResponse({"message": "Generation continued successfully.", "status": "ok"})


def _answer(result: dict) -> Response:
    if result["success"]:
        return OrjsonResponse(result)
    return create_error_response(result["message"], 400)
