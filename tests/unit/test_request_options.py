"""Request options are declared once (engine/request_options.py) and every layer follows the declaration.

Each option, with a value derived from its declared type, goes in through /generate's body and the
Engine's keywords (and the OpenAI routes for those marked so), is checked, tokenized, crosses the
process boundary in TokenizedGenerateReqInput and arrives in the scheduler's Req; a value of the
wrong type is refused by name at every edge; a per-prompt option takes one value per prompt.
Then the option added to show it: SGLang's `return_prompt_token_ids`.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict

import msgspec
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from engine.entrypoints.engine import Engine
from engine.entrypoints.http_server import create_app
from engine.entrypoints.openai.protocol import ChatCompletionRequest, GenerateRequest
from engine.errors import EngineRequestError
from engine.io_struct import TokenizedGenerateReqInput, decode, encode
from engine.request_options import OPTION_FIELDS, RequestOptions
from engine.sampling.sampling_params import SamplingParams
from engine.scheduler.req import Req
from engine.server_args import ServerArgs
from engine.tokenizer.request_normalizer import GenerateReqInput, RequestNormalizer

from test_http_app import FakeTokenizerManager
from test_tokenizer_manager import build_test_tokenizer, collect, run_manager_with_fake_scheduler

# Without return_logprob the other logprob options mean nothing (they are cleared): it goes with them.
LOGPROB_OPTIONS = ("logprob_start_len", "top_logprobs_num", "token_ids_logprob")
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def _sample(tp: Any) -> Any:
    """A value other than the default that the declared type accepts."""
    if isinstance(tp, msgspec.inspect.Metadata):
        tp = tp.type
    if isinstance(tp, msgspec.inspect.UnionType):
        return _sample(next(t for t in tp.types if not isinstance(t, msgspec.inspect.NoneType)))
    if isinstance(tp, msgspec.inspect.BoolType):
        return True
    if isinstance(tp, msgspec.inspect.IntType):
        return max(tp.ge if tp.ge is not None else 0, 1)
    if isinstance(tp, msgspec.inspect.StrType):
        return "k"
    if isinstance(tp, msgspec.inspect.ListType):
        return [_sample(tp.item_type)]
    raise AssertionError(f"no sample for {tp}")


SAMPLES: Dict[str, Any] = {f.name: _sample(f.type) for f in msgspec.inspect.type_info(RequestOptions).fields}


def _wrong(name: str) -> Any:
    """A value of the wrong type for the option."""
    return 5 if isinstance(SAMPLES[name], str) else "?"


def _options_of(name: str, value: Any) -> Dict[str, Any]:
    return {name: value, "return_logprob": True} if name in LOGPROB_OPTIONS else {name: value}


def test_every_option_has_a_sample_value_other_than_its_default() -> None:
    assert set(SAMPLES) == set(OPTION_FIELDS)
    assert all(SAMPLES[name] != field.default for name, field in OPTION_FIELDS.items())


@pytest.mark.parametrize("name", sorted(OPTION_FIELDS))
def test_an_option_flows_from_every_edge_to_the_scheduler_req(name: str) -> None:
    value = SAMPLES[name]
    manager = FakeTokenizerManager()
    with TestClient(create_app(manager, ServerArgs(device="cpu"))) as client:
        reply = client.post("/generate", json={"input_ids": [1, 2, 3], **_options_of(name, value)})
    assert reply.status_code == 200, reply.text
    [from_http] = manager.requests

    # The offline Engine takes it as a keyword (or as one of its named parameters).
    named = inspect.signature(Engine.generate).parameters
    kwargs = {k: v for k, v in _options_of(name, value).items() if k in named}
    extras = {k: v for k, v in _options_of(name, value).items() if k not in named}
    call = {"prompt": None, "sampling_params": None, "input_ids": [1, 2, 3], "return_logprob": False,
            "logprob_start_len": None, "top_logprobs_num": None, "return_text_in_logprobs": False, "stream": False,
            "rid": None, **kwargs}
    from_engine = Engine._make_request(*call.values(), extras)

    normalizer = RequestNormalizer(None, 100, 64, enable_custom_logit_processor=True, dp_size=2)
    for obj in (from_http, from_engine):
        obj.normalize()
        [tokenized] = normalizer.tokenize_request(obj)
        received = decode(encode(tokenized))  # the process boundary to the scheduler
        assert isinstance(received, TokenizedGenerateReqInput)
        req = Req(received.rid, received.input_ids, SamplingParams(), options=received.options)
        assert getattr(req.options, name) == value

    if OPTION_FIELDS[name].openai:
        assert ChatCompletionRequest.model_validate({**CHAT, name: value}).generate_extras()[name] == value


@pytest.mark.parametrize("name", sorted(OPTION_FIELDS))
def test_a_wrong_value_is_refused_by_name_at_every_edge(name: str) -> None:
    bad = _wrong(name)
    with pytest.raises(ValidationError, match=name):
        GenerateRequest.model_validate({"text": "a", name: bad})
    with pytest.raises(EngineRequestError, match=name) as info:
        GenerateReqInput(text="a", **{name: bad}).normalize()
    assert info.value.status_code == 400
    if OPTION_FIELDS[name].openai:
        with pytest.raises(ValidationError, match=name):
            ChatCompletionRequest.model_validate({**CHAT, name: bad})


@pytest.mark.parametrize("name", sorted(OPTION_FIELDS))
def test_per_prompt_options_take_one_value_per_prompt(name: str) -> None:
    value, default = SAMPLES[name], OPTION_FIELDS[name].default
    body = {"text": ["a", "b"], **_options_of(name, [value, None])}
    if not OPTION_FIELDS[name].per_prompt:
        with pytest.raises(ValidationError, match=name):
            GenerateRequest.model_validate(body)
        with pytest.raises(EngineRequestError, match=name):
            GenerateReqInput(**body).normalize()
        return
    GenerateRequest.model_validate(body)
    obj = GenerateReqInput(**body)
    obj.normalize()
    assert [getattr(sub.options, name) for sub in obj.subs] == [value, default]
    with pytest.raises(EngineRequestError, match=f"{name} has 3 entries but there are 2 prompts"):
        GenerateReqInput(text=["a", "b"], **{name: [value, value, value]}).normalize()


def test_the_scheduler_reads_the_options_it_was_sent() -> None:
    options = RequestOptions(return_logprob=False, top_logprobs_num=3, priority=5, return_hidden_states="last")
    req = Req("r", [1, 2], SamplingParams(), options=options)
    # Without return_logprob the other logprob options are cleared, as SGLang ignores them.
    assert (req.return_logprob, req.top_logprobs_num, req.priority) == (False, 0, 5)
    assert req.return_hidden_states and req.hidden_states_last


# ---------------------------------------------------------------------------- return_prompt_token_ids
@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@pytest.fixture
def runtime(tokenizer, monkeypatch):
    yield from run_manager_with_fake_scheduler(tokenizer, monkeypatch)


def test_return_prompt_token_ids_puts_the_tokenized_prompt_in_every_output(runtime, tokenizer) -> None:
    manager, fake = runtime
    params = {"max_new_tokens": 3}
    outs = collect(manager, GenerateReqInput(text="Hello world", sampling_params=params, stream=True,
                                             return_prompt_token_ids=True))
    [sent] = fake.messages(TokenizedGenerateReqInput)
    assert sent.input_ids == tokenizer.encode("Hello world")
    assert outs and all(out["prompt_token_ids"] == sent.input_ids for out in outs)
    # Not asked: no such key (SGLang's output shape).
    [plain] = collect(manager, GenerateReqInput(text="Hello world", sampling_params=params))
    assert "prompt_token_ids" not in plain
    # A batch: each output carries its own prompt.
    [batch] = collect(manager, GenerateReqInput(input_ids=[[5, 6, 7], [8, 9]], sampling_params=params,
                                                return_prompt_token_ids=True))
    assert [out["prompt_token_ids"] for out in batch] == [[5, 6, 7], [8, 9]]


def test_return_prompt_token_ids_over_http(runtime) -> None:
    manager, _ = runtime
    with TestClient(create_app(manager, ServerArgs(model_path="unused", device="cpu"))) as client:
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_prompt_token_ids": True}
        reply = client.post("/generate", json=body)
        assert reply.status_code == 200 and reply.json()["prompt_token_ids"] == [5, 6, 7]
        # One value for the whole request, as SGLang's field.
        listed = client.post("/generate", json={**body, "input_ids": [[5], [6]], "return_prompt_token_ids": [True, True]})
        assert listed.status_code == 400 and "return_prompt_token_ids" in listed.text
        # The OpenAI routes do not return them: asked there, a 400 rather than a silent omission.
        chat = client.post("/v1/chat/completions", json={**CHAT, "return_prompt_token_ids": True})
        assert chat.status_code == 400 and "return_prompt_token_ids" in chat.text

