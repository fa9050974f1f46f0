"""Issue 34, items 2 and 5: what tokenizing a request and its input logprobs may cost.

The TokenizerManager runs against the fake scheduler of test_tokenizer_manager (real ZMQ sockets),
and the HTTP app over it in-process (httpx's ASGI transport), so the event loop is the real one.
- Tokenization and chat templates run off the event loop: a tokenizer whose encode blocks until the
  test releases it shows /health answering meanwhile (on the loop, it would block it).
- A text far past the context length is refused before it is tokenized.
- Input logprobs are bounded in positions and values per request, summed over its samples.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator

import httpx
import pytest

import engine.tokenizer.request_normalizer as normalizer_module
from engine.entrypoints.http_server import create_app
from engine.tokenizer.embedding_requests import EmbeddingModelInfo, EmbeddingNormalizer, EmbeddingReqInput
from engine.errors import EngineRequestError
from engine.io_struct import TokenizedGenerateReqInput
from engine.tokenizer.request_normalizer import MAX_CHARS_PER_TOKEN, GenerateReqInput
from test_tokenizer_manager import CONTEXT_LEN, build_test_tokenizer, run_manager_with_fake_scheduler

TEXT_LIMIT = CONTEXT_LEN * MAX_CHARS_PER_TOKEN


class GatedTokenizer:
    """The test tokenizer, whose encode waits until `release` is set (and counts its calls)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.release = threading.Event()
        self.encoded: list[int] = []  # the length of each text encoded
        self.gated = False

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(len(text))
        if self.gated:
            self.started.set()
            assert self.release.wait(10), "the event loop did not run while a text was being tokenized"
        return self.inner.encode(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@pytest.fixture
def runtime(tokenizer, monkeypatch) -> Iterator[tuple]:
    gated = GatedTokenizer(tokenizer)
    for manager, fake in run_manager_with_fake_scheduler(tokenizer, monkeypatch):
        manager.tokenizer = gated
        yield manager, fake, gated


async def _poll(condition, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _client(manager) -> httpx.AsyncClient:
    app = create_app(manager, manager.server_args)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


# ------------------------------------------------------------------------------ item 2: off the loop


@pytest.mark.parametrize("path, body", [
    ("/generate", {"text": "Hello world", "sampling_params": {"max_new_tokens": 3}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 3}),
])
def test_health_answers_while_a_request_is_being_tokenized(runtime, path, body):
    manager, fake, gated = runtime
    gated.gated = True

    async def run():
        async with _client(manager) as client:
            pending = asyncio.create_task(client.post(path, json=body))
            await _poll(gated.started.is_set)
            # The tokenizer is busy with the request (its encode is blocked): the loop serves others.
            health = await client.get("/health")
            assert health.status_code == 200
            assert not pending.done()
            gated.release.set()
            return await pending

    response = _run(run())
    assert response.status_code == 200, response.text
    sent = fake.messages(TokenizedGenerateReqInput)
    assert len(sent) == 1 and len(sent[0].input_ids) > 0


def test_tokenization_results_are_unchanged(runtime, tokenizer):
    manager, fake, _ = runtime

    async def run():
        obj = GenerateReqInput(text=["Hello world", "The lazy dog"], sampling_params={"max_new_tokens": 2, "n": 2})
        return [out async for out in manager.generate_request(obj)]

    _run(run())
    sent = fake.messages(TokenizedGenerateReqInput)
    assert [m.input_ids for m in sent] == [tokenizer.encode("Hello world")] * 2 + [tokenizer.encode("The lazy dog")] * 2
    assert manager.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        _run(manager.apply_chat_template_async([{"role": "user", "content": "hi"}]))


def test_an_oversized_text_is_refused_before_it_is_tokenized(runtime):
    manager, fake, gated = runtime
    huge = "fox " * (TEXT_LIMIT // 4 + 1)

    async def run():
        async with _client(manager) as client:
            return (await client.post("/generate", json={"text": huge}),
                    await client.post("/v1/completions", json={"prompt": huge, "max_tokens": 1}),
                    await client.post("/v1/chat/completions",
                                      json={"messages": [{"role": "user", "content": huge}], "max_tokens": 1}))

    for response in _run(run()):
        assert response.status_code == 400
        body = response.json()
        assert body["object"] == "error" and body["code"] == 400
        assert f"more than {TEXT_LIMIT} characters" in body["message"]
    assert all(length <= TEXT_LIMIT for length in gated.encoded)  # the huge text was never encoded
    assert fake.messages(TokenizedGenerateReqInput) == []


def test_with_auto_truncate_an_oversized_text_is_cut_before_it_is_tokenized(tokenizer, monkeypatch):
    gated = GatedTokenizer(tokenizer)
    huge = "The quick brown fox jumps over the lazy dog. " * (TEXT_LIMIT // 20)
    for manager, fake in run_manager_with_fake_scheduler(tokenizer, monkeypatch, allow_auto_truncate=True):
        manager.tokenizer = gated

        async def run():
            obj = GenerateReqInput(text=huge, sampling_params={"max_new_tokens": 1})
            return [out async for out in manager.generate_request(obj)]

        _run(run())
        assert gated.encoded == [TEXT_LIMIT]
        sent = fake.messages(TokenizedGenerateReqInput)[0]
        # The same tokens as truncating the whole text's: the cut lies far past the kept ones.
        assert sent.input_ids == tokenizer.encode(huge)[: manager.max_req_input_len]


def test_an_oversized_embedding_input_is_refused_before_it_is_tokenized(tokenizer):
    gated = GatedTokenizer(tokenizer)
    model = EmbeddingModelInfo(is_generation=False, max_input_len=CONTEXT_LEN, vocab_size=len(tokenizer),
                               embedding_dim=8, is_matryoshka=False, matryoshka_dimensions=None, model_name="m")
    normalizer = EmbeddingNormalizer(gated, model, allow_auto_truncate=False)
    gated.inner = tokenizer
    with pytest.raises(EngineRequestError, match="characters"):
        normalizer.tokenize(EmbeddingReqInput(text=["ok", "x" * (TEXT_LIMIT + 1)]))
    assert gated.encoded == []


# ------------------------------------------------------------------------------ item 5: input logprobs


@pytest.fixture
def small_caps(monkeypatch):
    monkeypatch.setattr(normalizer_module, "MAX_INPUT_LOGPROB_TOKENS", 100)
    monkeypatch.setattr(normalizer_module, "MAX_INPUT_LOGPROB_VALUES", 500)


def _logprob_request(n: int, top: int, prompt_len: int = 20, start: int = 0, **kwargs: Any) -> GenerateReqInput:
    return GenerateReqInput(input_ids=list(range(5, 5 + prompt_len)), sampling_params={"max_new_tokens": 1, "n": n},
                            return_logprob=True, logprob_start_len=start, top_logprobs_num=top, **kwargs)


@pytest.mark.parametrize("request_kwargs, message", [
    (dict(n=8, top=0), "input logprobs at 160 prompt positions"),  # 8 samples x 20 positions > 100
    (dict(n=4, top=10), "asks 880 input logprob values"),  # 80 positions x (1 + 10) > 500
    (dict(n=4, top=2, token_ids_logprob=[1, 2, 3, 4]), "asks 560 input logprob values"),  # 80 x (1 + 2 + 4)
])
def test_input_logprobs_over_the_caps_are_refused_before_anything_is_sent(runtime, small_caps, request_kwargs,
                                                                           message):
    manager, fake, _ = runtime

    async def run():
        return [out async for out in manager.generate_request(_logprob_request(**request_kwargs))]

    with pytest.raises(EngineRequestError, match=message) as info:
        _run(run())
    assert info.value.status_code == 400
    assert fake.messages(TokenizedGenerateReqInput) == []


def test_input_logprobs_within_the_caps_pass(runtime, small_caps):
    manager, fake, _ = runtime

    async def run(obj):
        return [out async for out in manager.generate_request(obj)]

    _run(run(_logprob_request(n=4, top=2)))  # 80 positions, 240 values
    _run(run(_logprob_request(n=8, top=50, start=19)))  # 8 positions: a late start costs little
    _run(run(_logprob_request(n=16, top=20, start=-1)))  # output logprobs only: no input positions
    assert len(fake.messages(TokenizedGenerateReqInput)) == 4 + 8 + 16


def test_the_completions_echo_route_gets_the_400(runtime, small_caps):
    manager, fake, _ = runtime

    async def run():
        async with _client(manager) as client:
            return await client.post("/v1/completions", json={"prompt": list(range(5, 25)), "echo": True,
                                                              "logprobs": 5, "n": 8, "max_tokens": 1})

    response = _run(run())
    assert response.status_code == 400 and "input logprobs" in response.json()["message"]
    assert fake.messages(TokenizedGenerateReqInput) == []


def test_top_logprobs_num_is_at_most_the_vocabulary(runtime, tokenizer):
    manager, fake, _ = runtime

    async def run():
        return [out async for out in manager.generate_request(_logprob_request(n=1, top=len(tokenizer) + 1))]

    with pytest.raises(EngineRequestError, match="top_logprobs_num must be at most the vocabulary size"):
        _run(run())
