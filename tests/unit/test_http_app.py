"""The HTTP app over a fake TokenizerManager: every endpoint, errors, auth, SSE, logprobs, echo.

No processes: the fake implements the runtime contract (GenerateReqInput in, SGLang-shaped dicts
out) with a toy "model" whose outputs are easy to predict, and the app runs in-process under
FastAPI's TestClient.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Dict, List, Optional

import pytest
from fastapi.testclient import TestClient

from engine.entrypoints.http_server import create_app
from engine.errors import EngineRequestError
from engine.io_struct import FlushCacheReqOutput
from engine.tokenizer.tokenizer_manager import GenerateReqInput
from engine.server_args import ServerArgs

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
CONTEXT_LEN = 64


class FakeTokenizer:
    """Token i is the letter ALPHABET[i % 26]; text encodes letter by letter."""

    def encode(self, text: str, add_special_tokens: bool = False) -> List[int]:
        return [ALPHABET.index(c) if c in ALPHABET else 25 for c in text]

    def decode(self, ids: List[int], skip_special_tokens: bool = True) -> str:
        return "".join(ALPHABET[i % 26] for i in ids)


class FakeTokenizerManager:
    """The TokenizerManager contract with a toy model: after prompt ids p, it emits
    (last(p) + 1), (last(p) + 2), ... mod 26, i.e. the alphabet continues from the prompt."""

    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()
        self.model_path = "/models/fake"
        self.served_model_name = "fake-model"
        self.context_len = CONTEXT_LEN
        self.max_req_input_len = CONTEXT_LEN - 1
        self.max_total_num_tokens = 4096
        self.server_args = None
        self.lora_registry = None  # no --enable-lora
        self.alive = True
        self.healthy = True
        self.flush_ok = True
        self.aborts: List[Dict[str, Any]] = []
        self.requests: List[GenerateReqInput] = []
        self.raw_requests: List[Any] = []
        self.incrementals: List[bool] = []
        self.closed_early: List[str] = []
        self.templates: List[List[dict]] = []
        self.template_tools: List[Optional[list]] = []
        self.template_options: List[tuple] = []

    # ------------------------------------------------------------------ generation
    async def generate_request(self, obj: GenerateReqInput, request: Any = None,
                               incremental: bool = False) -> AsyncIterator[Any]:
        obj.normalize()
        self.requests.append(obj)
        self.raw_requests.append(request)
        self.incrementals.append(incremental)
        prompts = obj.input_ids if obj.input_ids is not None else [self.tokenizer.encode(t) for t in obj.text]
        for ids in prompts:
            if len(ids) >= self.context_len:
                raise EngineRequestError(
                    f"The input ({len(ids)} tokens) is longer than the model's context length "
                    f"({self.context_len} tokens)."
                )
        for params in obj.sampling_params:
            if params.get("temperature", 1.0) > 100:
                raise EngineRequestError("temperature is absurd")
        runs = [self._run(obj, i, ids) for i, ids in enumerate(prompts)]
        if obj.stream:
            pending = list(range(len(runs)))
            step = 0
            finished: set = set()
            try:
                while len(finished) < len(runs):
                    for i in pending:
                        if i in finished:
                            continue
                        outputs = runs[i]
                        out = dict(outputs[min(step, len(outputs) - 1)])
                        if step >= len(outputs) - 1:
                            finished.add(i)
                        if not obj.is_single:
                            out["index"] = i
                        yield out
                    step += 1
            finally:
                if len(finished) < len(runs):
                    self.closed_early.append(obj.rid[0])
        elif obj.is_single:
            yield runs[0][-1]
        else:
            yield [run[-1] for run in runs]

    def _run(self, obj: GenerateReqInput, i: int, prompt: List[int]) -> List[dict]:
        """Every cumulative output of sub-request i, the last one finished."""
        params = obj.sampling_params[i]
        max_new = params.get("max_new_tokens", 8)
        prompt_text = self.tokenizer.decode(prompt)
        output_ids: List[int] = []
        finish: Optional[dict] = None
        outputs = []
        for k in range(max_new):
            token = (prompt[-1] + 1 + k) % 26
            output_ids.append(token)
            if "zz" in prompt_text:
                finish = {"type": "abort", "message": "aborted by the scheduler", "status_code": 503}
            elif "yy" in prompt_text and k == 1:
                # Aborted by a client (/abort_request) while running: no status code.
                finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            elif token in (params.get("stop_token_ids") or []):
                finish = {"type": "stop", "matched": token}
            elif k == max_new - 1:
                finish = {"type": "length", "length": max_new}
            outputs.append(self._output(obj, i, prompt, list(output_ids), finish))
            if finish is not None:
                break
        return outputs

    def _output(self, obj: GenerateReqInput, i: int, prompt: List[int], output_ids: List[int],
                finish: Optional[dict]) -> dict:
        meta: Dict[str, Any] = {
            "id": obj.rid[i],
            "prompt_tokens": len(prompt),
            "completion_tokens": len(output_ids),
            "cached_tokens": 2 if len(prompt) > 2 else 0,
            "finish_reason": finish,
            "e2e_latency": 0.01,
        }
        if obj.return_logprob[i]:
            top_n = obj.top_logprobs_num[i]

            def entry(token: int, logprob: Optional[float]) -> list:
                return [logprob, token, ALPHABET[token % 26]]

            def tops(token: int) -> list:
                return [entry((token + j) % 26, -0.5 - j) for j in range(top_n)]

            meta["output_token_logprobs"] = [entry(t, -0.5) for t in output_ids]
            meta["output_top_logprobs"] = [tops(t) for t in output_ids]
            if obj.logprob_start_len[i] >= 0:
                meta["input_token_logprobs"] = [entry(prompt[0], None)] + [entry(t, -1.0) for t in prompt[1:]]
                meta["input_top_logprobs"] = [None] + [tops(t) for t in prompt[1:]]
            else:
                meta["input_token_logprobs"] = []
                meta["input_top_logprobs"] = []
        return {"text": self.tokenizer.decode(output_ids), "output_ids": output_ids, "meta_info": meta}

    # ------------------------------------------------------------------ control
    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self.aborts.append({"rid": rid, "abort_all": abort_all})

    async def flush_cache(self) -> FlushCacheReqOutput:
        if self.flush_ok:
            return FlushCacheReqOutput(success=True, message="")
        return FlushCacheReqOutput(success=False, message="Cache not flushed: 1 request running.")

    async def get_internal_state(self) -> List[dict]:
        return [{"num_running_reqs": 2, "num_waiting_reqs": 1, "waiting_tokens": 30, "max_total_num_tokens": 100,
                 "available_tokens": 60, "evictable_tokens": 10}]

    async def health_generate(self) -> bool:
        return self.healthy

    def is_alive(self) -> bool:
        return self.alive

    def apply_chat_template(self, messages: List[dict], add_generation_prompt: bool = True,
                            tools: Optional[list] = None, continue_final_message: bool = False,
                            template_kwargs: Optional[dict] = None) -> List[int]:
        self.templates.append(messages)
        self.template_tools.append(tools)
        self.template_options.append((continue_final_message, template_kwargs))
        if any(m["content"] == "bad template" for m in messages):
            raise EngineRequestError("Failed to apply the chat template: roles must alternate")
        return self.tokenizer.encode("".join(m["content"] for m in messages))

    async def apply_chat_template_async(self, *args: Any, **kwargs: Any) -> List[int]:
        return self.apply_chat_template(*args, **kwargs)

    def get_model_info(self) -> dict:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True}


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture
def manager() -> FakeTokenizerManager:
    return FakeTokenizerManager()


@pytest.fixture
def client(manager: FakeTokenizerManager) -> TestClient:
    app = create_app(manager, ServerArgs(device="cpu"), max_request_body_bytes=64 * 1024)
    with TestClient(app, raise_server_exceptions=False) as test_client:
        yield test_client


def sse_events(response: Any) -> List[Any]:
    """Parse an SSE body: every event must be `data: ...` followed by a blank line."""
    body = response.text
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    events = []
    for block in body.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def assert_error(response: Any, status: int, needle: str = "") -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["object"] == "error"
    assert body["code"] == status
    assert body["param"] is None
    assert isinstance(body["type"], str) and body["type"]
    assert needle.lower() in body["message"].lower(), body["message"]
    return body


# ---------------------------------------------------------------------------- native endpoints
def test_health_follows_is_alive(client: TestClient, manager: FakeTokenizerManager) -> None:
    assert client.get("/health").status_code == 200
    manager.alive = False
    assert_error(client.get("/health"), 503)


def test_health_generate(client: TestClient, manager: FakeTokenizerManager) -> None:
    assert client.get("/health_generate").status_code == 200
    manager.healthy = False
    assert_error(client.get("/health_generate"), 503)


def test_model_and_server_info(client: TestClient) -> None:
    info = client.get("/get_model_info").json()
    assert info["model_path"] == "/models/fake"
    assert info["is_generation"] is True
    assert info["served_model_name"] == "fake-model"
    assert "tokenizer_path" in info
    server = client.get("/get_server_info").json()
    assert server["port"] == 30000 and server["tp_size"] == 1
    assert server["internal_states"][0]["max_total_num_tokens"] == 100
    assert server["max_total_num_tokens"] == 4096 and server["max_req_input_len"] == CONTEXT_LEN - 1
    assert isinstance(server["version"], str)
    assert client.get("/server_info").json()["port"] == 30000


def test_model_info_alias_and_load_have_the_shapes_sglang_router_reads(client: TestClient) -> None:
    assert client.get("/model_info").json() == client.get("/get_model_info").json()
    # 100 slots, 60 free, 10 only cached: running requests hold 30; 30 prompt tokens wait.
    assert client.get("/get_load").json() == [
        {"dp_rank": 0, "num_reqs": 3, "num_waiting_reqs": 1, "num_tokens": 60}]


def test_server_info_hides_api_key(manager: FakeTokenizerManager) -> None:
    app = create_app(manager, ServerArgs(device="cpu", api_key="sekret"))
    with TestClient(app) as c:
        info = c.get("/get_server_info", headers={"Authorization": "Bearer sekret"}).json()
    assert "sekret" not in json.dumps(info)


def test_flush_cache(client: TestClient, manager: FakeTokenizerManager) -> None:
    ok = client.post("/flush_cache")
    assert ok.status_code == 200 and ok.json()["success"] is True
    manager.flush_ok = False
    assert_error(client.post("/flush_cache"), 400, "not flushed")


def test_abort_request(client: TestClient, manager: FakeTokenizerManager) -> None:
    assert client.post("/abort_request", json={"rid": "abc"}).status_code == 200
    assert client.post("/abort_request", json={"abort_all": True}).status_code == 200
    assert manager.aborts == [{"rid": "abc", "abort_all": False}, {"rid": "", "abort_all": True}]
    # An empty rid is a prefix of every rid: refused rather than aborting everything.
    assert_error(client.post("/abort_request", json={}), 400, "rid")
    assert len(manager.aborts) == 2


def test_models(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert models["data"][0]["max_model_len"] == CONTEXT_LEN
    assert client.get("/v1/models/fake-model").json()["id"] == "fake-model"
    assert_error(client.get("/v1/models/other"), 404, "does not exist")


def test_generate_single_and_batch(client: TestClient, manager: FakeTokenizerManager) -> None:
    out = client.post("/generate", json={"text": "abc", "sampling_params": {"max_new_tokens": 3}}).json()
    assert out["text"] == "def" and out["output_ids"] == [3, 4, 5]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["meta_info"]["prompt_tokens"] == 3 and out["meta_info"]["completion_tokens"] == 3
    batch = client.post("/generate", json={"input_ids": [[0], [10, 11]],
                                           "sampling_params": {"max_new_tokens": 2}}).json()
    assert [b["text"] for b in batch] == ["bc", "mn"]
    # The fastapi Request is passed on so the manager can abort on disconnect.
    assert manager.raw_requests[-1] is not None


def test_generate_stream_cumulative(client: TestClient) -> None:
    response = client.post("/generate", json={"text": "a", "stream": True, "sampling_params": {"max_new_tokens": 4}})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response)
    texts = [e["text"] for e in events]
    assert texts == ["b", "bc", "bcd", "bcde"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_generate_logprobs(client: TestClient) -> None:
    out = client.post("/generate", json={
        "text": "abc", "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 0,
        "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2}}).json()
    meta = out["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 3, "d"], [-0.5, 4, "e"]]
    assert len(meta["output_top_logprobs"][0]) == 2
    assert meta["input_token_logprobs"][0] == [None, 0, "a"]


def test_generate_errors(client: TestClient) -> None:
    assert_error(client.post("/generate", json={}), 400, "exactly one of text or input_ids")
    assert_error(client.post("/generate", json={"text": "a", "input_ids": [1]}), 400, "exactly one")
    assert_error(client.post("/generate", json={"input_ids": []}), 400, "input_ids")
    assert_error(client.post("/generate", json={"input_ids": [-1]}), 400, "non-negative")
    assert_error(client.post("/generate", json={"text": "a", "bogus": 1}), 400, "bogus")
    assert_error(client.post("/generate", json={"text": 5}), 400, "text")
    assert_error(client.post("/generate", json={"text": "a", "top_logprobs_num": 99}), 400, "top_logprobs_num")
    assert_error(client.post("/generate", json={"text": "a", "sampling_params": {"n": 10 ** 9}}), 400, "n must be")
    assert_error(client.post("/generate", json={"text": "a", "sampling_params": {"sampling_seed": 2 ** 80}}),
                 400, "sampling_seed")
    assert_error(client.post("/generate", json={"text": "a", "sampling_params": {"stop_token_ids": [2 ** 70]}}),
                 400, "stop_token_ids")
    assert_error(client.post("/generate", json={"text": "a" * CONTEXT_LEN}), 400, "context length")
    stream_err = client.post("/generate", json={"text": "a" * CONTEXT_LEN, "stream": True})
    assert_error(stream_err, 400, "longer than the model's context length (64 tokens)")
    # The engine is still fine afterwards.
    assert client.post("/generate", json={"text": "a"}).status_code == 200


def test_generate_abort_finish_is_an_error(client: TestClient, manager: FakeTokenizerManager) -> None:
    assert_error(client.post("/generate", json={"text": "zz"}), 503, "aborted by the scheduler")
    events = sse_events(client.post("/generate", json={"text": ["zz", "abc"], "stream": True,
                                                       "sampling_params": {"max_new_tokens": 6}}))
    assert events[-1]["error"]["message"] == "aborted by the scheduler"
    assert events[-1]["error"]["code"] == 503
    # The stream ended early, so the manager's generator was closed (which aborts the rest).
    assert manager.closed_early


GRACEFUL_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def test_generate_aborted_by_a_client_returns_its_partial_output(client: TestClient) -> None:
    # As SGLang: a request aborted through /abort_request answers 200 with what it generated.
    out = client.post("/generate", json={"text": "yy", "sampling_params": {"max_new_tokens": 6}})
    assert out.status_code == 200, out.text
    assert out.json()["text"] == "za" and out.json()["meta_info"]["finish_reason"] == GRACEFUL_ABORT
    events = sse_events(client.post("/generate", json={"text": "yy", "stream": True,
                                                       "sampling_params": {"max_new_tokens": 6}}))
    assert [e["text"] for e in events] == ["z", "za"]
    assert events[-1]["meta_info"]["finish_reason"] == GRACEFUL_ABORT


def test_openai_routes_aborted_by_a_client_return_finish_reason_abort(client: TestClient) -> None:
    # SGLang's OpenAI layer: a graceful abort (no status code) is a normal answer, finish_reason "abort".
    out = client.post("/v1/completions", json={"prompt": "yy", "max_tokens": 6})
    assert out.status_code == 200, out.text
    choice = out.json()["choices"][0]
    assert choice["text"] == "za" and choice["finish_reason"] == "abort"
    events = sse_events(client.post("/v1/completions", json={"prompt": "yy", "max_tokens": 6, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events) == "za"
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    messages = [{"role": "user", "content": "yy"}]
    out = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6})
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["finish_reason"] == "abort"
    assert out.json()["choices"][0]["message"]["content"] == "za"
    events = sse_events(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6,
                                                                  "stream": True}))
    finishes = [c["finish_reason"] for e in events for c in e["choices"]]
    assert finishes[-1] == "abort" and "error" not in events[-1]


# ---------------------------------------------------------------------------- completions
def test_completion_basic(client: TestClient, manager: FakeTokenizerManager) -> None:
    response = client.post("/v1/completions", json={"model": "anything", "prompt": "abc", "max_tokens": 3})
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "fake-model" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": "def", "logprobs": None,
                                "finish_reason": "length", "matched_stop": None}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert manager.requests[-1].sampling_params[0]["max_new_tokens"] == 3


def test_completion_default_max_tokens_and_sampling_mapping(client: TestClient, manager: FakeTokenizerManager) -> None:
    client.post("/v1/completions", json={
        "prompt": "a", "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "frequency_penalty": 0.5,
        "presence_penalty": -0.5, "repetition_penalty": 1.2, "seed": 7, "stop": ["x"], "stop_token_ids": [4],
        "ignore_eos": True, "min_tokens": 2, "skip_special_tokens": False, "no_stop_trim": True, "user": "u"})
    params = manager.requests[-1].sampling_params[0]
    assert params == {
        "max_new_tokens": 16, "min_new_tokens": 2, "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
        "frequency_penalty": 0.5, "presence_penalty": -0.5, "repetition_penalty": 1.2, "stop": ["x"],
        "stop_token_ids": [4], "sampling_seed": 7, "ignore_eos": True, "skip_special_tokens": False,
        "spaces_between_special_tokens": True, "no_stop_trim": True}


def test_completion_prompt_forms_n_and_usage(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"prompt": ["abc", "xy"], "max_tokens": 2, "n": 2}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["de", "de", "za", "za"]
    # Each prompt counted once; completion tokens of every choice.
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 8
    ids = client.post("/v1/completions", json={"prompt": [0, 1], "max_tokens": 1}).json()
    assert [c["text"] for c in ids["choices"]] == ["c"]
    ids2 = client.post("/v1/completions", json={"prompt": [[0], [5]], "max_tokens": 1}).json()
    assert [c["text"] for c in ids2["choices"]] == ["b", "g"]


def test_completion_stop_token_finish(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 10, "stop_token_ids": [3]}).json()
    choice = body["choices"][0]
    assert choice["text"] == "bcd" and choice["finish_reason"] == "stop" and choice["matched_stop"] == 3


def test_completion_logprobs_and_echo(client: TestClient) -> None:
    body = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "logprobs": 2}).json()
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["d", "e"]
    assert lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"][0] == {"d": -0.5, "e": -1.5}
    assert lp["text_offset"] == [0, 1]
    echo = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "logprobs": 1, "echo": True}).json()
    choice = echo["choices"][0]
    assert choice["text"] == "abcde"
    assert choice["logprobs"]["tokens"] == ["a", "b", "c", "d", "e"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -1.0, -0.5, -0.5]
    assert choice["logprobs"]["top_logprobs"][0] is None
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]
    plain_echo = client.post("/v1/completions", json={"prompt": [0, 1], "max_tokens": 1, "echo": True}).json()
    assert plain_echo["choices"][0]["text"] == "abc"


def test_completion_stream_and_include_usage(client: TestClient) -> None:
    response = client.post("/v1/completions", json={
        "prompt": "abc", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}, "n": 2,
        "logprobs": 0, "echo": True})
    events = sse_events(response)
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert usage["usage"]["prompt_tokens"] == 3
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"].startswith("cmpl-") for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == "abcdef"
        assert mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])
        offsets = [o for c in mine for o in c["logprobs"]["text_offset"]]
        assert offsets == [0, 1, 2, 3, 4, 5]
        tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
        assert tokens == list("abcdef")
    # Without include_usage there is no usage chunk.
    plain = sse_events(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True}))
    assert all(e.get("usage") is None for e in plain) and all(e["choices"] for e in plain)


def test_completion_errors_then_good_request(client: TestClient) -> None:
    bad_bodies = [
        ({"max_tokens": 3}, "prompt"),
        ({"prompt": []}, "empty"),
        ({"prompt": [[]]}, "empty"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "top_k": -5}, "top_k"),
        ({"prompt": "a", "top_k": 2 ** 40}, "top_k"),
        ({"prompt": "a", "min_p": 2}, "min_p"),
        ({"prompt": "a", "frequency_penalty": 3}, "frequency_penalty"),
        ({"prompt": "a", "presence_penalty": -3}, "presence_penalty"),
        ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": 129}, "n"),
        ({"prompt": "a", "n": True}, "n"),
        ({"prompt": "a", "seed": 2 ** 70}, "seed"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "logprobs": -1}, "logprobs"),
        ({"prompt": "a", "stop": ["x"] * 33}, "stop"),
        ({"prompt": "a", "stop": [""]}, "stop"),
        ({"prompt": "a", "stop": 5}, "stop"),
        ({"prompt": "a", "suffix": "tail"}, "suffix"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1]}, "non-negative"),
        ({"prompt": "a" * CONTEXT_LEN}, "context length"),
    ]
    for body, needle in bad_bodies:
        assert_error(client.post("/v1/completions", json=body), 400, needle)
    assert_error(client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400, "not valid json")
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}),
                 400)
    assert_error(client.post("/v1/completions"), 400, "missing")
    assert_error(client.post("/v1/completions", json={"prompt": "a", "stream": True, "temperature": 1000}),
                 400, "absurd")
    good = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})
    assert good.status_code == 200 and good.json()["choices"][0]["text"] == "b"


def test_completion_abort_is_error(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": "zz"}), 503, "aborted")
    events = sse_events(client.post("/v1/completions", json={"prompt": "zz", "stream": True}))
    assert events[-1]["error"]["code"] == 503


# ---------------------------------------------------------------------------- chat
def test_chat_basic(client: TestClient, manager: FakeTokenizerManager) -> None:
    response = client.post("/v1/chat/completions", json={
        "model": "whatever", "max_tokens": 2,
        "messages": [{"role": "system", "content": "a"},
                     {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
                     {"role": "tool", "content": "b", "tool_call_id": "t"}]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["model"] == "fake-model"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "cd"}
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 2
    messages = manager.templates[-1]
    assert messages[1] == {"role": "user", "content": "b\nc"}
    assert messages[2]["tool_calls"] == [{"id": "t"}] and messages[3]["tool_call_id"] == "t"


def test_chat_template_kwargs_and_continue_final_message_reach_the_template(
        client: TestClient, manager: FakeTokenizerManager) -> None:
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    response = client.post("/v1/chat/completions", json={
        "model": "m", "max_tokens": 2, "messages": messages, "continue_final_message": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert response.status_code == 200, response.text
    assert manager.template_options[-1] == (True, {"enable_thinking": False})
    client.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": messages[:1]})
    assert manager.template_options[-1] == (False, None)


def test_chat_default_max_tokens_fills_context(client: TestClient, manager: FakeTokenizerManager) -> None:
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "abcd"}]})
    assert manager.requests[-1].sampling_params[0]["max_new_tokens"] == CONTEXT_LEN - 4
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                              "max_tokens": 9, "max_completion_tokens": 3})
    assert manager.requests[-1].sampling_params[0]["max_new_tokens"] == 3


def test_chat_logprobs(client: TestClient) -> None:
    body = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["b", "c"]
    assert content[0]["logprob"] == -0.5 and content[0]["bytes"] == [ord("b")]
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["b", "c"]
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5]
    no_lp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}],
                                                      "max_tokens": 1}).json()
    assert no_lp["choices"][0]["logprobs"] is None


def test_chat_stream(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "stream": True, "n": 2,
        "stream_options": {"include_usage": True}})
    events = sse_events(response)
    chunks, usage = events[:-1], events[-1]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 1 + 6
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == "bcd"
        assert mine[-1]["delta"] == {} and mine[-1]["finish_reason"] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_chat_stream_logprobs(client: TestClient) -> None:
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 3, "stream": True, "logprobs": True}))
    tokens = [t["token"] for e in events if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["content"]]
    assert tokens == ["b", "c", "d"]


def test_chat_errors_then_good_request(client: TestClient, manager: FakeTokenizerManager) -> None:
    user = [{"role": "user", "content": "a"}]
    bad_bodies = [
        ({}, "messages"),
        ({"messages": []}, "messages must not be empty"),
        ({"messages": [{"role": "wizard", "content": "a"}]}, "role"),
        ({"messages": [{"content": "a"}]}, "role"),
        ({"messages": [{"role": "user"}]}, "needs content"),
        ({"messages": [{"role": "user", "content": 5}]}, "content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "content"),
        ({"messages": "hello"}, "messages"),
        ({"messages": user, "max_tokens": 0}, "max_tokens"),
        ({"messages": user, "max_completion_tokens": -1}, "max_completion_tokens"),
        ({"messages": user, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"messages": user, "top_logprobs": 2}, "needs logprobs"),
        ({"messages": user, "logprobs": "yes"}, "logprobs"),
        ({"messages": user, "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": user, "response_format": {"type": "json_schema"}}, "needs a json_schema"),
        ({"messages": user, "tool_choice": "required"}, "needs tools"),
        ({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not among the tools"),
        ({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}] * 2,
          "tool_choice": "required"}, "distinct"),
        ({"messages": user, "tools": [{"type": "function", "function": {"name": "bad name!"}}],
          "tool_choice": "none"}, "name"),
        ({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "response_format": {"type": "json_object"}}, "cannot be combined"),
        ({"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
          "regex": "a+"}, "cannot be combined"),
        ({"messages": user, "regex": "a+", "ebnf": 'root ::= "a"'}, "at most one output constraint"),
        ({"messages": user, "json_schema": "{}", "response_format": {"type": "json_object"}},
         "at most one output constraint"),
        ({"messages": user, "n": 1000}, "n"),
        ({"messages": user, "continue_final_message": True}, "last message to be an assistant"),
        ({"messages": user, "chat_template_kwargs": {"tokenize": True}}, "may not set tokenize"),
        ({"messages": user, "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"messages": user, "temperature": -0.1}, "temperature"),
        ({"messages": user, "stop": ["s"] * 40}, "stop"),
        ({"messages": [{"role": "user", "content": "bad template"}]}, "chat template"),
        ({"messages": [{"role": "user", "content": "a" * CONTEXT_LEN}]}, "context length"),
    ]
    for body, needle in bad_bodies:
        assert_error(client.post("/v1/chat/completions", json=body), 400, needle)
    assert_error(client.post("/v1/chat/completions", content=b"nope", headers={"content-type": "application/json"}),
                 400, "json")
    # Tools switched off are neither shown to the model nor parsed.
    ok = client.post("/v1/chat/completions", json={
        "messages": user, "max_tokens": 1, "response_format": {"type": "text"}, "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "f"}}]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "b"
    assert manager.template_tools[-1] is None and "json_schema" not in manager.requests[-1].sampling_params[0]


def test_response_format_and_forced_tools_become_json_schema(client: TestClient, manager: FakeTokenizerManager) -> None:
    """response_format and a forced tool choice travel as the native json_schema constraint; the
    tools reach the chat template."""
    user = [{"role": "user", "content": "a"}]
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    client.post("/v1/chat/completions", json={"messages": user, "max_tokens": 1,
                                              "response_format": {"type": "json_object"}})
    assert json.loads(manager.requests[-1].sampling_params[0]["json_schema"]) == {"type": "object"}
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}})
    assert json.loads(manager.requests[-1].sampling_params[0]["json_schema"]) == schema
    # SGLang's constraint extras travel as they are.
    client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1, "regex": "[ab]+"})
    assert manager.requests[-1].sampling_params[0]["regex"] == "[ab]+"
    client.post("/v1/chat/completions", json={"messages": user, "max_tokens": 1, "ebnf": 'root ::= "x"'})
    assert manager.requests[-1].sampling_params[0]["ebnf"] == 'root ::= "x"'

    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}},
             {"type": "function", "function": {"name": "g"}}]
    client.post("/v1/chat/completions", json={"messages": user, "max_tokens": 1, "tools": tools,
                                              "tool_choice": {"type": "function", "function": {"name": "f"}},
                                              "parallel_tool_calls": False})
    constraint = json.loads(manager.requests[-1].sampling_params[0]["json_schema"])
    assert constraint["type"] == "array" and constraint["minItems"] == 1 and constraint["maxItems"] == 1
    assert constraint["items"]["properties"] == {"name": {"type": "string", "enum": ["f"]}, "parameters": schema}
    assert [t["function"]["name"] for t in manager.template_tools[-1]] == ["f", "g"]
    client.post("/v1/chat/completions", json={"messages": user, "max_tokens": 1, "tools": tools,
                                              "tool_choice": "required"})
    constraint = json.loads(manager.requests[-1].sampling_params[0]["json_schema"])
    assert "maxItems" not in constraint
    assert [item["properties"]["name"]["enum"] for item in constraint["items"]["anyOf"]] == [["f"], ["g"]]


def test_chat_abort_is_error(client: TestClient) -> None:
    assert_error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "zz"}]}),
                 503, "aborted")
    events = sse_events(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "zz"}], "stream": True}))
    assert events[-1]["error"]["code"] == 503


# ---------------------------------------------------------------------------- limits and auth
def test_unknown_route_and_method_have_openai_bodies(client: TestClient) -> None:
    assert_error(client.get("/nope"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_body_too_large(client: TestClient) -> None:
    huge = {"prompt": "a" * (70 * 1024)}
    assert_error(client.post("/v1/completions", json=huge), 413, "larger than the limit")

    def chunks():  # no Content-Length: the limit must still hold
        for _ in range(20):
            yield b"x" * 8192

    assert_error(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


def test_api_key(manager: FakeTokenizerManager) -> None:
    app = create_app(manager, ServerArgs(device="cpu", api_key="sekret"))
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200  # liveness probes need no key
        for path in ("/v1/models", "/get_model_info", "/get_server_info", "/health_generate"):
            assert_error(c.get(path), 401, "api key")
            assert_error(c.get(path, headers={"Authorization": "Bearer wrong"}), 401)
            assert_error(c.get(path, headers={"Authorization": "sekret"}), 401)
            assert c.get(path, headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert_error(c.post("/v1/completions", json={"prompt": "a"}), 401)
        assert_error(c.post("/generate", json={"text": "a"}), 401)
        good = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1},
                      headers={"Authorization": "Bearer sekret"})
        assert good.status_code == 200


def test_only_the_native_route_streams_incrementally_with_the_flag(manager: FakeTokenizerManager) -> None:
    """--incremental-streaming-output reaches the manager from /generate; the OpenAI routes compute
    their own deltas from cumulative outputs whatever the flag says."""
    app = create_app(manager, ServerArgs(device="cpu", incremental_streaming_output=True))
    with TestClient(app) as flagged:
        assert flagged.post("/generate", json={"text": "hi", "stream": True}).status_code == 200
        assert flagged.post("/v1/completions", json={"model": "fake-model", "prompt": "hi",
                                                     "stream": True}).status_code == 200
    with TestClient(create_app(manager, ServerArgs(device="cpu"))) as plain:
        assert plain.post("/generate", json={"text": "hi", "stream": True}).status_code == 200
    assert manager.incrementals == [True, False, False]
