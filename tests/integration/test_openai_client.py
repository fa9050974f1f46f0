"""The OpenAI-compatible API through the official `openai` client against a real server."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


USER = [{"role": "user", "content": "Write a short poem about the sea."}]
GREEDY = {"temperature": 0.0}
NO_EOS = {"extra_body": {"ignore_eos": True}}


def test_models_list(client: openai.OpenAI, model: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model]


def test_chat_non_stream(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(model=model, messages=USER, max_tokens=6, **GREEDY, **NO_EOS)
    assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
    assert response.model == model
    choice = response.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6


def test_chat_usage_reports_the_cached_prefix(client: openai.OpenAI, model: str) -> None:
    # A prompt no other test sends: only the chat template's head can be cached the first time.
    # Sent again, every prompt token but the last comes from the prefix cache (the last one is
    # always recomputed, to produce the first output's logits).
    messages = [{"role": "user", "content": "A prompt only the cached-tokens test sends: tally ho."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=2, **GREEDY, **NO_EOS)
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=2, **GREEDY, **NO_EOS)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 1


def test_chat_stream_equals_non_stream_with_usage(client: openai.OpenAI, model: str) -> None:
    full = client.chat.completions.create(model=model, messages=USER, max_tokens=8, **GREEDY, **NO_EOS)
    stream = client.chat.completions.create(
        model=model, messages=USER, max_tokens=8, stream=True, stream_options={"include_usage": True},
        **GREEDY, **NO_EOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert content == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_chat_n2_and_logprobs(client: openai.OpenAI, model: str) -> None:
    response = client.chat.completions.create(
        model=model, messages=USER, max_tokens=4, n=2, logprobs=True, top_logprobs=3, **GREEDY, **NO_EOS)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.usage.completion_tokens == 8
    for choice in response.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        for token in content:
            assert token.logprob <= 0 and len(token.top_logprobs) == 3
            # Greedy picks the most likely token.
            assert token.logprob == pytest.approx(token.top_logprobs[0].logprob, abs=1e-5)
    # Greedy choices are identical.
    assert response.choices[0].message.content == response.choices[1].message.content


def test_chat_logprob_bytes_are_each_tokens_own_bytes(client: openai.OpenAI, model: str) -> None:
    # The constraint makes the model spell 東 byte by byte (three tokens whose text alone is
    # U+FFFD): their bytes must be the raw ones, which join to the content's UTF-8.
    response = client.chat.completions.create(
        model=model, messages=USER, max_tokens=16, logprobs=True, top_logprobs=2, **GREEDY,
        extra_body={"regex": "(東京){3}"})
    choice = response.choices[0]
    assert choice.message.content == "東京東京東京"
    tokens = [t for t in choice.logprobs.content if t.token != "<|end_of_text|>"]
    assert any(t.token == "\ufffd" for t in tokens)
    assert b"".join(bytes(t.bytes) for t in tokens) == choice.message.content.encode()
    # Greedy: the first alternative is the chosen token, with the same bytes.
    assert all(t.top_logprobs[0].bytes == t.bytes for t in tokens)


def test_completions_non_stream_and_stream(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                     **GREEDY, **NO_EOS)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY, **NO_EOS))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 8


def test_completions_batch_n_logprobs_echo(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(model=model, prompt=["Hello", "Good morning"], max_tokens=3, n=2,
                                         logprobs=2, **GREEDY, **NO_EOS)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 12
    for choice in response.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
        for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
            assert chosen <= 0 and 1 <= len(top) <= 3
            assert chosen == pytest.approx(max(top.values()), abs=1e-5)
    echo = client.completions.create(model=model, prompt="Echo this", max_tokens=2, echo=True, logprobs=1,
                                     **GREEDY, **NO_EOS)
    choice = echo.choices[0]
    assert choice.text.startswith("Echo this")
    assert choice.logprobs.token_logprobs[0] is None  # the first prompt token has no logprob
    assert len(choice.logprobs.tokens) == echo.usage.prompt_tokens + 2


def test_completions_token_prompt(client: openai.OpenAI, model: str) -> None:
    response = client.completions.create(model=model, prompt=[[1, 2, 3], [4, 5]], max_tokens=2, **GREEDY,
                                         **NO_EOS)
    assert len(response.choices) == 2 and response.usage.prompt_tokens == 5


def test_stop_string_and_stop_token(client: openai.OpenAI, model: str) -> None:
    prompt = "Once upon a time there was"
    base = client.completions.create(model=model, prompt=prompt, max_tokens=16, **GREEDY, **NO_EOS)
    text = base.choices[0].text
    # A stop string taken from the middle of the greedy output (no replacement characters).
    stop = next((text[i:i + 2] for i in range(2, len(text) - 2)
                 if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip()), None)
    if stop is not None:
        stopped = client.completions.create(model=model, prompt=prompt, max_tokens=16, stop=[stop],
                                             **GREEDY, **NO_EOS)
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == text[: text.index(stop)]
    ids = client.completions.create(model=model, prompt=prompt, max_tokens=6, logprobs=0, **GREEDY, **NO_EOS)
    tokens = ids.choices[0].logprobs.tokens
    assert len(tokens) == 6


def test_bad_requests_raise_bad_request(client: openai.OpenAI, model: str) -> None:
    cases = [
        dict(messages=[], max_tokens=2),
        dict(messages=USER, max_tokens=0),
        dict(messages=USER, n=0),
        dict(messages=USER, temperature=-1),
        dict(messages=USER, logprobs=True, top_logprobs=25),
        dict(messages=[{"role": "user", "content": "word " * 2100}], max_tokens=2),
    ]
    for kwargs in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, **kwargs)
        assert info.value.status_code == 400
        assert isinstance(info.value.body, dict) and info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=model, prompt="word " * 2100, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        list(client.completions.create(model=model, prompt="word " * 2100, max_tokens=2, stream=True))
    # The server is fine afterwards.
    ok = client.chat.completions.create(model=model, messages=USER, max_tokens=1)
    assert ok.usage.completion_tokens == 1
