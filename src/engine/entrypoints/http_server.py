"""The HTTP server: native SGLang endpoints and the OpenAI-compatible API over a TokenizerManager.

The app is a thin layer: it validates the request body (pydantic, at the edge), hands a
GenerateReqInput to the TokenizerManager and shapes what comes back. Whatever goes wrong, the
client gets a terminal answer with an OpenAI-style error body, never a hang or a bare 500 for bad
input.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Awaitable, Callable, Dict, List, MutableMapping, Optional

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.entrypoints.control_routes import add_control_routes
from engine.entrypoints.http_auth import OPERATOR_PATHS, ApiKeys
from engine.entrypoints.http_protocol import HttpLimits, protocol_class
from engine.entrypoints.openai.protocol import (
    AbortRequestBody,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ModelCard,
    ModelList,
)
from engine.entrypoints.openai.embedding_protocol import EmbeddingRequest, EncodeRequest
from engine.entrypoints.openai.serving_chat import OpenAIServingChat
from engine.entrypoints.openai.serving_embedding import OpenAIServingEmbedding, handle_encode
from engine.entrypoints.openai.serving_completions import OpenAIServingCompletion
from engine.entrypoints.openai.utils import (
    ClientConnection,
    OrjsonResponse,
    abort_error,
    as_output_list,
    create_error_response,
    error_body,
    error_response_from_exception,
    final_output,
    prime_stream,
    sse_event,
    sse_stream,
)
from engine.errors import EngineRequestError
from engine.tokenizer.metrics import METRICS_CONTENT_TYPE, TokenizerMetricsCollector
from engine.tokenizer.request_normalizer import GENERATE_FIELDS, GenerateReqInput
from engine.tokenizer.tokenizer_manager_protocol import TokenizerManagerProtocol
from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
# How long a /metrics scrape waits for the schedulers' state before answering without gauges.
METRICS_STATE_TIMEOUT_S = 5.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def engine_version() -> str:
    try:
        return version("engine")
    except PackageNotFoundError:
        return "unknown"


# ---------------------------------------------------------------------------- middleware
class GuardMiddleware:
    """API-key check (http_auth.py) and request-body limit, before any routing or parsing.

    A pure ASGI middleware rather than BaseHTTPMiddleware: it must not buffer streaming
    responses, and it must see the body size before FastAPI reads the body into memory.
    """

    def __init__(self, app: Any, keys: ApiKeys, max_body_bytes: int) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.keys.refusal(scope["path"], headers.get("authorization", ""))
        if refusal is not None:
            await _send_error(scope, receive, send, refusal, 401)
            return
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(scope, receive, send, self._too_large_message(), 413)
            return
        if declared is None or "transfer-encoding" in headers:
            # Chunked upload: its size is known only by reading it, so read it here (bounded), whatever
            # the method (a GET may carry a body too, and a route may parse it).
            body, too_large = await self._read_bounded(receive)
            if too_large:
                await _send_error(scope, receive, send, self._too_large_message(), 413)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _too_large_message(self) -> str:
        return f"The request body is larger than the limit of {self.max_body_bytes} bytes."

    async def _read_bounded(self, receive: Receive) -> tuple[bytes, bool]:
        chunks: List[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", True
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), False


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands out the already-read body once, then defers to the real one
    (so http.disconnect still reaches the app)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_error(scope: Scope, receive: Receive, send: Send, message: str, status_code: int) -> None:
    response = OrjsonResponse(error_body(message, status_code), status_code=status_code)
    await response(scope, receive, send)


# ---------------------------------------------------------------------------- errors
def validation_error_message(exc: RequestValidationError) -> str:
    """FastAPI's 422 details -> one readable sentence that names the offending fields."""
    parts: List[str] = []
    for error in exc.errors():
        kind = error.get("type", "")
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if kind == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            return f"The request body is not valid JSON: {detail}".rstrip(": ")
        if kind == "missing" and not loc:
            return "The request body is missing: send a JSON object."
        if kind == "model_attributes_type" and not loc:
            return "The request body must be a JSON object, sent with 'Content-Type: application/json'."
        if loc:
            parts.append(f"{'.'.join(loc)}: {message}")
        else:
            parts.append(message)
        if len(parts) == 3:
            break
    return "Invalid request: " + "; ".join(parts) if parts else "Invalid request."


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        # OpenAI clients expect 400 for a bad request, not FastAPI's 422.
        return create_error_response(validation_error_message(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return create_error_response(str(exc.detail), exc.status_code)

    @app.exception_handler(EngineRequestError)
    async def _engine(request: Request, exc: EngineRequestError) -> Response:
        return error_response_from_exception(exc)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("Unhandled error on %s %s", request.method, request.url.path)
        return create_error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500)


# ---------------------------------------------------------------------------- native /generate
async def _generate(tokenizer_manager: TokenizerManagerProtocol, body: GenerateRequest, raw_request: Request) -> Response:
    # Every field GenerateReqInput takes, options included (request_options.py), as the client sent it.
    obj = GenerateReqInput(**{name: value for name, value in body if name in GENERATE_FIELDS})
    incremental = raw_request.app.state.server_args.incremental_streaming_output
    stream = tokenizer_manager.generate_request(obj, ClientConnection(raw_request), incremental=incremental)
    if body.stream:
        first, error = await prime_stream(stream)
        if error is not None:
            return error
        # SGLang's stream format: `data: {json}` per update (cumulative text), then `data: [DONE]`.
        events = sse_stream(first, stream, lambda output: (sse_event(output),))
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        result = await final_output(stream)
    except (EngineRequestError, ValueError) as exc:
        return error_response_from_exception(exc)
    for output in as_output_list(result):
        aborted = abort_error(output["meta_info"].get("finish_reason"))
        if aborted is not None:
            return create_error_response(*aborted)
    return OrjsonResponse(result)


# ---------------------------------------------------------------------------- the app
def create_app(
    tokenizer_manager: TokenizerManagerProtocol,
    server_args: ServerArgs,
    *,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
) -> FastAPI:
    """Build the FastAPI app over `tokenizer_manager` (a TokenizerManager or anything with its API)."""
    # strict_content_type=False: a body without any Content-Type is parsed as JSON too.
    app = FastAPI(
        title="engine",
        version=engine_version(),
        default_response_class=OrjsonResponse,
        strict_content_type=False,
    )
    _install_error_handlers(app)
    app.state.tokenizer_manager = tokenizer_manager
    app.state.server_args = server_args
    labels_header = server_args.tokenizer_metrics_custom_labels_header
    serving_chat = OpenAIServingChat(tokenizer_manager, server_args.tool_call_parser, server_args.reasoning_parser,
                                     labels_header=labels_header)
    serving_completion = OpenAIServingCompletion(tokenizer_manager, labels_header=labels_header)
    serving_embedding = OpenAIServingEmbedding(tokenizer_manager)
    created = int(time.time())

    # ------------------------------------------------------------------ health and info
    @app.get("/health")
    async def health() -> Response:
        if tokenizer_manager.is_alive():
            return Response(status_code=200)
        return create_error_response("The server is not alive.", 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if await tokenizer_manager.health_generate():
            return Response(status_code=200)
        return create_error_response("The engine did not answer a health-check generation.", 503)

    # /model_info is the name SGLang's router asks for first; /get_model_info the older one.
    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> Response:
        info = dict(tokenizer_manager.get_model_info())
        info.setdefault("model_path", tokenizer_manager.model_path)
        info.setdefault("tokenizer_path", server_args.tokenizer_path or tokenizer_manager.model_path)
        info.setdefault("is_generation", True)
        info.setdefault("served_model_name", tokenizer_manager.served_model_name)
        for key, value in _model_facts(info["model_path"]).items():
            info.setdefault(key, value)
        return OrjsonResponse(info)

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> Response:
        info: Dict[str, Any] = dict(server_args.to_dict())
        info.pop("api_key", None)  # a secret has no place in a diagnostic dump
        info.pop("admin_api_key", None)
        info.pop("disaggregation_secret", None)
        # What the schedulers chose, at the top level as in SGLang (the router reads it there).
        info["max_total_num_tokens"] = tokenizer_manager.max_total_num_tokens
        info["max_req_input_len"] = tokenizer_manager.max_req_input_len
        info["internal_states"] = await tokenizer_manager.get_internal_state()
        info["version"] = engine_version()
        return OrjsonResponse(info)

    @app.get("/get_load")
    async def get_load() -> Response:
        return OrjsonResponse(load_report(await tokenizer_manager.get_internal_state()))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        result = await tokenizer_manager.flush_cache()
        if result.success:
            return OrjsonResponse({"success": True, "message": result.message or "Cache flushed."})
        message = result.message or "Cache not flushed: requests are running or waiting."
        return create_error_response(message, 400)

    @app.post("/abort_request")
    async def abort_request(body: AbortRequestBody) -> Response:
        tokenizer_manager.abort_request(rid=body.rid, abort_all=body.abort_all)
        return OrjsonResponse({"success": True})

    if server_args.enable_metrics:
        _add_metrics_route(app, tokenizer_manager)
    # Weights, memory, pause/continue (control_routes.py): every route it adds is an operator route.
    first_control_route = len(app.router.routes)
    add_control_routes(app, tokenizer_manager)
    control_paths = frozenset(route.path for route in app.router.routes[first_control_route:]
                              if isinstance(route, APIRoute))

    # ------------------------------------------------------------------ generation
    @app.post("/generate")
    async def generate(body: GenerateRequest, raw_request: Request) -> Response:
        return await _generate(tokenizer_manager, body, raw_request)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return OrjsonResponse(ModelList(data=[_model_card(tokenizer_manager, created),
                                              *_adapter_cards(tokenizer_manager, created)]).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> Response:
        if model_id != tokenizer_manager.served_model_name:
            return create_error_response(f"The model {model_id!r} does not exist.", 404, "model_not_found")
        return OrjsonResponse(_model_card(tokenizer_manager, created).model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw_request: Request) -> Response:
        return await serving_completion.handle_request(body, raw_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw_request: Request) -> Response:
        return await serving_chat.handle_request(body, raw_request)

    # ------------------------------------------------------------------ embeddings
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
        return await serving_embedding.handle_request(body, raw_request)

    @app.post("/encode")
    async def encode(body: EncodeRequest, raw_request: Request) -> Response:
        return await handle_encode(tokenizer_manager, body, raw_request)

    # Added last, once every route exists: it must know which paths are operator routes.
    keys = ApiKeys(server_args.api_key, server_args.admin_api_key, OPERATOR_PATHS | control_paths)
    app.add_middleware(GuardMiddleware, keys=keys, max_body_bytes=max_request_body_bytes)
    return app


def _add_metrics_route(app: FastAPI, tokenizer_manager: TokenizerManagerProtocol) -> None:
    """GET /metrics (only with --enable-metrics; otherwise the route does not exist: 404)."""
    collector = tokenizer_manager.metrics_collector
    if collector is None:
        collector = TokenizerMetricsCollector(tokenizer_manager.served_model_name)

    @app.get("/metrics")
    async def metrics() -> Response:
        states: Optional[List[dict]] = None
        try:
            states = await asyncio.wait_for(tokenizer_manager.get_internal_state(), METRICS_STATE_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineRequestError) as exc:
            # Counters and histograms are still worth serving; the gauges are left out.
            logger.warning("/metrics: no scheduler state (%s); gauges omitted.",
                           getattr(exc, "message", None) or type(exc).__name__)
        # Set and render with no await in between, so concurrent scrapes cannot mix states.
        collector.set_scheduler_states(states)
        return Response(collector.render(), media_type=METRICS_CONTENT_TYPE)


def load_report(internal_states: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """SGLang's /get_load: per DP replica, requests and the KV tokens they hold or will need.

    SGLang's router polls it for `power_of_two` and sums `num_tokens`: the tokens held by running
    requests (the pool minus what is free or only cached) plus the prompts still waiting.
    """
    loads = []
    for index, state in enumerate(internal_states):
        waiting = int(state["num_waiting_reqs"])
        held = state["max_total_num_tokens"] - state["available_tokens"] - state["evictable_tokens"]
        loads.append({
            # Replicas of --dp-size > 1 say which they are; the replies may come in any order.
            "dp_rank": int(state.get("dp_rank", index)),
            "num_reqs": int(state["num_running_reqs"]) + waiting,
            "num_waiting_reqs": waiting,
            "num_tokens": int(held) + int(state["waiting_tokens"]),
        })
    return loads


@functools.lru_cache(maxsize=4)
def _model_facts(model_path: Optional[str]) -> Dict[str, Any]:
    """`model_type` and `architectures` from config.json, which SGLang's router labels workers with."""
    if not model_path:
        return {}
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}
    return {"model_type": config.get("model_type"), "architectures": config.get("architectures")}


def _adapter_cards(tokenizer_manager: TokenizerManagerProtocol, created: int) -> List[ModelCard]:
    """The LoRA adapters, as SGLang lists them: id the adapter's name, root its path, parent the base."""
    registry = tokenizer_manager.lora_registry
    if registry is None:
        return []
    return [ModelCard(id=name, created=created, root=path, parent=tokenizer_manager.served_model_name,
                      max_model_len=tokenizer_manager.context_len) for name, path in registry.adapters().items()]


def _model_card(tokenizer_manager: TokenizerManagerProtocol, created: int) -> ModelCard:
    return ModelCard(
        id=tokenizer_manager.served_model_name,
        created=created,
        root=tokenizer_manager.model_path,
        max_model_len=tokenizer_manager.context_len,
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server, but requests in flight are ended before connections are closed.

    On SIGTERM uvicorn stops accepting connections and waits (a bounded time) for the open ones;
    a long stream would be cut at that deadline without a final chunk. Ending every request
    first gives each stream its final error event and `[DONE]`, and lets the wait end at once.
    """

    def __init__(self, config: uvicorn.Config, tokenizer_manager: TokenizerManagerProtocol) -> None:
        super().__init__(config)
        self.tokenizer_manager = tokenizer_manager

    async def shutdown(self, sockets: Optional[list] = None) -> None:
        self.tokenizer_manager.begin_shutdown()
        await super().shutdown(sockets=sockets)


def build_http_server(server_args: ServerArgs, tokenizer_manager: TokenizerManagerProtocol) -> GracefulServer:
    """The uvicorn server for `create_app(...)` on server_args.host:port (call .run() to serve)."""
    app = create_app(tokenizer_manager, server_args)
    limits = HttpLimits.from_server_args(server_args)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=server_args.log_level.lower(),
        access_log=server_args.log_level.lower() == "debug",
        # Deadlines for slow heads and bodies, a head size cap and a connection cap (http_protocol.py).
        http=protocol_class(limits),
        # Keep idle client connections around for benchmark clients that reuse them.
        timeout_keep_alive=limits.keep_alive_timeout,
        # Streams were already ended by begin_shutdown; this only bounds a stuck handler.
        timeout_graceful_shutdown=3,
    )
    return GracefulServer(config, tokenizer_manager)
