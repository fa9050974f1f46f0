"""Tokenization on the HTTP process side: the tokenizer, the request normalizers that use it, the
chat template, and the one thread they all run on.

Tokenization and chat templates run off the event loop: a long text takes seconds to encode, and
/health and every stream would wait for it. One thread keeps them in order, as on the loop, and
never runs two at once on the tokenizer (the Rust tokenizer's truncation setting, changed per call,
is shared by all callers).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

from engine.io_struct import TokenizedEmbeddingReqInput, TokenizedGenerateReqInput
from engine.tokenizer.embedding_requests import EmbeddingNormalizer, EmbeddingReqInput
from engine.tokenizer.request_normalizer import (
    GenerateReqInput,
    RequestNormalizer,
    apply_chat_template,
)

_T = TypeVar("_T")


class Tokenization:
    def __init__(self, tokenizer: Any, normalizer: RequestNormalizer, embedding_normalizer: EmbeddingNormalizer,
                 chat_template: Optional[str], context_len: int, allow_auto_truncate: bool) -> None:
        self.normalizer = normalizer
        self.embedding_normalizer = embedding_normalizer
        self.chat_template = chat_template
        self.context_len = context_len
        self.allow_auto_truncate = allow_auto_truncate
        self._tokenizer = tokenizer
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        # Both normalizers tokenize with the same tokenizer.
        self._tokenizer = tokenizer
        self.normalizer.tokenizer = tokenizer
        self.embedding_normalizer.tokenizer = tokenizer

    async def tokenize_generate(self, obj: GenerateReqInput) -> list[TokenizedGenerateReqInput]:
        """Validate and tokenize every sub-request of `obj` (a refusal raises EngineRequestError)."""
        return await self._off_loop(self.normalizer.tokenize_request, obj)

    async def tokenize_embedding(self, obj: EmbeddingReqInput) -> list[TokenizedEmbeddingReqInput]:
        return await self._off_loop(self.embedding_normalizer.tokenize, obj)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None,
        continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
    ) -> list[int]:
        return apply_chat_template(self._tokenizer, self.chat_template, messages, add_generation_prompt, tools,
                                   continue_final_message, template_kwargs, self.context_len, self.allow_auto_truncate)

    async def apply_chat_template_async(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: Optional[list] = None,
        continue_final_message: bool = False, template_kwargs: Optional[dict] = None,
    ) -> list[int]:
        return await self._off_loop(self.apply_chat_template, messages, add_generation_prompt, tools,
                                    continue_final_message, template_kwargs)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    async def _off_loop(self, fn: Callable[..., _T], *args: Any) -> _T:
        """Run `fn(*args)` on the tokenizer thread; its exception (a 400) is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, functools.partial(fn, *args))
