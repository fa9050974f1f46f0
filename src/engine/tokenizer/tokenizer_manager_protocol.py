"""The HTTP layer's view of the TokenizerManager: what the routes and the OpenAI serving classes
call, typed.

`TokenizerManager` (tokenizer/tokenizer_manager.py) is the implementation; the HTTP tests plug in
managers of their own (a toy model, scripted outputs) through `create_app`. Data members are
read-only properties here so that a plain attribute and a property both satisfy them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncGenerator, Optional, Protocol, Union

if TYPE_CHECKING:
    from engine.tokenizer.lora_registry import LoRARegistry
    from engine.tokenizer.control_calls import ControlCalls
    from engine.tokenizer.embedding_requests import EmbeddingReqInput, EmbeddingResult
    from engine.io_struct import FlushCacheReqOutput
    from engine.tokenizer.metrics import TokenizerMetricsCollector
    from engine.tokenizer.request_normalizer import GenerateReqInput

# What generate_request yields: one dict per update for a single prompt or any stream, one list
# for a whole (non-streamed) batch. A generator: closing it aborts what is still running.
GenerateOutputs = AsyncGenerator[Union[dict, "list[dict]"], None]


class TokenizerManagerProtocol(Protocol):
    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (None with --skip-tokenizer-init)."""

    @property
    def model_path(self) -> Optional[str]: ...

    @property
    def served_model_name(self) -> str: ...

    @property
    def context_len(self) -> int: ...

    @property
    def max_req_input_len(self) -> int: ...

    @property
    def max_total_num_tokens(self) -> Optional[int]: ...

    @property
    def control(self) -> ControlCalls:
        """The control-plane calls (weights, memory, pause), for control_routes.py."""

    @property
    def lora_registry(self) -> Optional[LoRARegistry]:
        """The LoRA adapters requests may name (None without --enable-lora)."""

    @property
    def metrics_collector(self) -> Optional[TokenizerMetricsCollector]:
        """The request metrics observed as outputs arrive (None without --enable-metrics)."""

    def generate_request(self, obj: GenerateReqInput, request: Any = None, incremental: bool = False) -> GenerateOutputs:
        """The outputs of `obj`; `request` (Starlette's) is polled for a client disconnect; with
        `incremental`, a stream's outputs carry only what is new."""

    async def encode_request(self, obj: EmbeddingReqInput, request: Any = None) -> list[EmbeddingResult]:
        """One embedding per input of `obj`, in order (embedding models)."""

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None: ...

    async def flush_cache(self) -> FlushCacheReqOutput: ...

    async def get_internal_state(self) -> list[dict]: ...

    async def health_generate(self, timeout: Optional[float] = None) -> bool: ...

    def is_alive(self) -> bool: ...

    def begin_shutdown(self) -> None:
        """End every request in flight and refuse new ones (the HTTP server is stopping)."""

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list] = None, continue_final_message: bool = False,
                            template_kwargs: Optional[dict] = None) -> list[int]: ...

    async def apply_chat_template_async(self, messages: list[dict], add_generation_prompt: bool = True,
                                        tools: Optional[list] = None, continue_final_message: bool = False,
                                        template_kwargs: Optional[dict] = None) -> list[int]:
        """apply_chat_template off the event loop (rendering and tokenizing a long chat takes a while)."""

    def get_model_info(self) -> dict: ...
