"""HTTP routes of the control plane, with SGLang's paths, bodies and answers.

    POST      /update_weights_from_disk        {"model_path", "load_format", "abort_all_requests",
                                                "weight_version", "flush_cache", ...}
    POST      /update_weights_from_tensor      {"serialized_named_tensors": [base64, one per TP rank],
                                                "load_format", "flush_cache", "abort_all_requests",
                                                "weight_version"}
    POST      /init_weights_update_group       {"master_address", "master_port", "rank_offset",
                                                "world_size", "group_name", "backend"}
    POST      /update_weights_from_distributed {"names", "dtypes", "shapes", "group_name",
                                                "flush_cache", "abort_all_requests", "weight_version"}
    POST      /destroy_weights_update_group    {"group_name"}
    POST      /load_lora_adapter               {"lora_name", "lora_path", "pinned"}
    POST      /unload_lora_adapter             {"lora_name"} (waits for the requests that use it)
    POST      /update_weight_version           {"new_version", "abort_all_requests"}
    GET       /get_weight_version
    GET|POST  /get_weights_by_name             {"name", "truncate_size"}
    GET|POST  /release_memory_occupation       {"tags": ["kv_cache", "weights", "cuda_graph", ...] | null}
    GET|POST  /resume_memory_occupation        {"tags": ...}
    POST      /pause_generation                {"mode": "abort" | "retract" | "in_place"} (optional body)
    POST      /continue_generation             {"torch_empty_cache": true} (optional body)
    GET|POST  /start_expert_distribution_record  (mixture-of-experts models; no body)
    GET|POST  /stop_expert_distribution_record
    GET|POST  /dump_expert_distribution_record   -> {"success", "message", "logical_count": [layer][expert]}

A refusal is HTTP 400 with the OpenAI-style error body; the weight routes' bodies also keep
SGLang's keys (`success`, `message`, `num_paused_requests`) so that its clients read them as usual.
A payload of /update_weights_from_tensor is a safetensors file, or SGLang's pickled tensors on a
server started with --enable-pickled-weight-updates (model_executor/tensor_payload.py).
"""

from __future__ import annotations

import base64
import binascii
import logging
from typing import Annotated, List, Literal, Optional

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.distributed.weight_update_group import DTYPES, MAX_TENSOR_DIMS, parse_dtype
from engine.entrypoints.openai.utils import OrjsonResponse, create_error_response, error_body
from engine.errors import EngineRequestError
from engine.lora.lora_config import MAX_LORA_NAME_LEN
from engine.tokenizer.control_calls import load_lora_adapter, unload_lora_adapter
from engine.io_struct import (
    ExpertDistributionReqOutput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
)
from engine.tokenizer.tokenizer_manager_protocol import TokenizerManagerProtocol

logger = logging.getLogger(__name__)

# What a failed /update_weights_from_disk answers, whatever the reason: a reason naming what the
# path holds (no such directory, no config.json, another architecture) would let a client map the
# server's files. The reason goes to the server log.
WEIGHTS_FROM_DISK_FAILED = (
    "The weights were not updated from model_path: it must be a directory, readable by the server, holding "
    "a safetensors checkpoint of the running model's architecture, and no request may hold KV cache of the "
    "current weights unless flush_cache is false. The server log has the reason.")

# Bounds of the weight-sync bodies (the request body itself is bounded by the server's body limit).
MAX_TP_PAYLOADS = 1024  # serialized_named_tensors entries (one per TP rank)
MAX_DISTRIBUTED_TENSORS = 100_000  # tensors in one update_weights_from_distributed
MAX_NAME_CHARS = 1024  # a weight's or a group's name, an address
MAX_VERSION_CHARS = 256
MAX_WORLD_SIZE = 1 << 16

WeightName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
Shape = Annotated[List[Annotated[int, Field(ge=0)]], Field(max_length=MAX_TENSOR_DIMS)]
Version = Annotated[str, Field(min_length=1, max_length=MAX_VERSION_CHARS)]


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


class UpdateWeightsFromTensorBody(_Body):
    serialized_named_tensors: List[str] = Field(min_length=1, max_length=MAX_TP_PAYLOADS)
    load_format: Optional[Literal["direct", "flattened_bucket"]] = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[Version] = None
    disable_draft_model: Optional[bool] = None  # SGLang's; there is no draft model here


class InitWeightsUpdateGroupBody(_Body):
    master_address: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, le=MAX_WORLD_SIZE)  # rank 0 is the trainer
    world_size: int = Field(ge=2, le=MAX_WORLD_SIZE)
    group_name: WeightName = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"


class UpdateWeightsFromDistributedBody(_Body):
    names: List[WeightName] = Field(min_length=1, max_length=MAX_DISTRIBUTED_TENSORS)
    dtypes: List[str] = Field(min_length=1, max_length=MAX_DISTRIBUTED_TENSORS)
    shapes: List[Shape] = Field(min_length=1, max_length=MAX_DISTRIBUTED_TENSORS)
    group_name: WeightName = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Optional[Version] = None
    load_format: Optional[str] = None  # only null: each tensor is its own broadcast
    torch_empty_cache: bool = False  # SGLang's; the CUDA cache is emptied by /continue_generation

    @model_validator(mode="after")
    def _check_metadata(self) -> "UpdateWeightsFromDistributedBody":
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes must have the same length, got {len(self.names)}, "
                             f"{len(self.dtypes)} and {len(self.shapes)}")
        unknown = sorted({d for d in self.dtypes if parse_dtype(d) is None})
        if unknown:
            raise ValueError(f"unknown dtype(s) {', '.join(unknown[:5])}: one of {', '.join(DTYPES)}")
        if self.load_format is not None:
            raise ValueError(f"load_format {self.load_format!r} is not supported: broadcast the tensors one by one "
                             "(load_format null)")
        return self


class DestroyWeightsUpdateGroupBody(_Body):
    group_name: WeightName = "weight_update_group"


class UpdateWeightVersionBody(_Body):
    new_version: Version
    abort_all_requests: bool = True


class GetWeightsByNameBody(_Body):
    name: str = Field(min_length=1)
    truncate_size: int = Field(default=100, ge=0)


class MemoryTagsBody(_Body):
    tags: Optional[List[str]] = None


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(_Body):
    torch_empty_cache: bool = True


LoRAName = Annotated[str, Field(min_length=1, max_length=MAX_LORA_NAME_LEN)]


class LoadLoRAAdapterBody(_Body):
    lora_name: LoRAName
    lora_path: str = Field(min_length=1, max_length=4096)
    pinned: bool = False


class UnloadLoRAAdapterBody(_Body):
    lora_name: LoRAName


def _lora_answer(result: dict) -> Response:
    """SGLang's {"success", "error_message", "loaded_adapters"}; a refusal is a 400 with the error body too."""
    content = {"success": result["success"], "message": result["message"],
               "error_message": None if result["success"] else result["message"],
               "loaded_adapters": result["loaded_adapters"]}
    if result["success"]:
        return OrjsonResponse(content)
    return OrjsonResponse({**error_body(result["message"], 400), **content}, status_code=400)


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

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorBody) -> Response:
        payloads: List[bytes] = []
        for i, text in enumerate(body.serialized_named_tensors):
            try:
                payloads.append(base64.b64decode(text, validate=True))
            except (binascii.Error, ValueError):
                return _weights_answer(False, f"serialized_named_tensors[{i}] is not base64.")
        success, message = await tokenizer_manager.control.update_weights_from_tensor_payloads(
            payloads, load_format=body.load_format, flush_cache=body.flush_cache,
            abort_all_requests=body.abort_all_requests, weight_version=body.weight_version)
        return _weights_answer(success, message)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupBody) -> Response:
        obj = InitWeightsUpdateGroupReqInput(
            master_address=body.master_address, master_port=body.master_port, rank_offset=body.rank_offset,
            world_size=body.world_size, group_name=body.group_name, backend=body.backend)
        return _weights_answer(*await tokenizer_manager.control.init_weights_update_group(obj))

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody) -> Response:
        obj = UpdateWeightsFromDistributedReqInput(
            names=body.names, dtypes=body.dtypes, shapes=body.shapes, group_name=body.group_name,
            flush_cache=body.flush_cache, abort_all_requests=body.abort_all_requests,
            weight_version=body.weight_version)
        return _weights_answer(*await tokenizer_manager.control.update_weights_from_distributed(obj))

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: Optional[DestroyWeightsUpdateGroupBody] = None) -> Response:
        name = body.group_name if body is not None else "weight_update_group"
        return _weights_answer(*await tokenizer_manager.control.destroy_weights_update_group(name))

    @app.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionBody) -> Response:
        success, message = await tokenizer_manager.control.update_weight_version(body.new_version,
                                                                                 body.abort_all_requests)
        return OrjsonResponse({"success": success, "message": message, "new_version": body.new_version})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return OrjsonResponse({"weight_version": tokenizer_manager.control.weight_version})

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: GetWeightsByNameBody) -> Response:
        try:
            parameter = await tokenizer_manager.control.get_weights_by_name(body.name, body.truncate_size)
            return OrjsonResponse(parameter)
        except EngineRequestError as exc:
            return create_error_response(exc.message, exc.status_code)

    # SGLang answers these with a line of text and writes the dump to a file; we answer JSON and the dump
    # is the body (tokens routed per layer and expert id during the recording).
    @app.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
    async def start_expert_distribution_record() -> Response:
        return _expert_answer(await tokenizer_manager.control.expert_distribution("start_record"))

    @app.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
    async def stop_expert_distribution_record() -> Response:
        return _expert_answer(await tokenizer_manager.control.expert_distribution("stop_record"))

    @app.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
    async def dump_expert_distribution_record() -> Response:
        return _expert_answer(await tokenizer_manager.control.expert_distribution("dump_record"))

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

    _add_lora_routes(app, tokenizer_manager)


def _add_lora_routes(app: FastAPI, tokenizer_manager: TokenizerManagerProtocol) -> None:
    @app.post("/load_lora_adapter")
    async def load_lora(body: LoadLoRAAdapterBody) -> Response:
        try:
            result = await load_lora_adapter(tokenizer_manager.control, body.lora_name, body.lora_path, body.pinned)
        except EngineRequestError as exc:
            return create_error_response(exc.message, exc.status_code)
        return _lora_answer(result)

    @app.post("/unload_lora_adapter")
    async def unload_lora(body: UnloadLoRAAdapterBody) -> Response:
        try:
            result = await unload_lora_adapter(tokenizer_manager.control, body.lora_name)
        except EngineRequestError as exc:
            return create_error_response(exc.message, exc.status_code)
        return _lora_answer(result)


def _answer(result: dict) -> Response:
    if result["success"]:
        return OrjsonResponse(result)
    return create_error_response(result["message"], 400)


def _expert_answer(result: ExpertDistributionReqOutput) -> Response:
    """200 with the result, 400 where the model has no experts."""
    if not result.success:
        return create_error_response(result.message, 400)
    content = {"success": True, "message": result.message}
    if result.logical_count is not None:
        content["logical_count"] = result.logical_count
    return OrjsonResponse(content)


def _weights_answer(success: bool, message: str) -> Response:
    """SGLang's {"success", "message"}: 200, or 400 with the error body around the same keys."""
    content = {"success": success, "message": message}
    if success:
        return OrjsonResponse(content)
    return OrjsonResponse({**error_body(message, 400), **content}, status_code=400)
