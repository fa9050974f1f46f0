"""Structured outputs and tool calls against a real server with the built-in random model: only
the grammar can make its output valid, so every parse below proves the whole path (HTTP, manager,
scheduler, mask, detokenizer, parsers)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar (pip install xgrammar)")
jsonschema = pytest.importorskip("jsonschema", reason="schema validation needs jsonschema")

from utils_process import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

SERVER_ARGS = ["--constrained-json-disable-any-whitespace", "--tool-call-parser", "qwen25"]
USER = [{"role": "user", "content": "Give me the data."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "temperature": {"type": "integer", "minimum": -40, "maximum": 50},
        "rain": {"type": "boolean"},
    },
    "required": ["city", "temperature", "rain"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(server_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120.0)


@pytest.fixture(scope="module")
def http(server_url: str) -> httpx.Client:
    with httpx.Client(base_url=server_url, timeout=120.0) as c:
        yield c


def sse(response: httpx.Response) -> List[Dict[str, Any]]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---------------------------------------------------------------------------------------------
# response_format and the OpenAI client's parse()
# ---------------------------------------------------------------------------------------------
class Forecast(BaseModel):
    city: str = Field(max_length=8)
    temperature: int = Field(ge=-40, le=50)
    conditions: List[Literal["sun", "rain", "snow"]] = Field(max_length=3)


def test_openai_client_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    # chat.completions.parse in current clients, beta.chat.completions.parse in older ones.
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    completion = parse(model="default", messages=USER, response_format=Forecast, max_tokens=200, temperature=0.0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert Forecast.model_validate_json(choice.message.content) == choice.message.parsed


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_with_n(http: httpx.Client, route: str, stream: bool) -> None:
    body: Dict[str, Any] = {"max_tokens": 120, "n": 3, "temperature": 1.0, "seed": 7, "stream": stream,
                            "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}}
    if route == "chat":
        body["messages"] = USER
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "The weather data:"
        path = "/v1/completions"
    response = http.post(path, json=body)
    texts = ["", "", ""]
    finishes: Dict[int, str] = {}
    if stream:
        for chunk in sse(response):
            for choice in chunk["choices"]:
                piece = choice["delta"].get("content") if route == "chat" else choice["text"]
                texts[choice["index"]] += piece or ""
                if choice["finish_reason"]:
                    finishes[choice["index"]] = choice["finish_reason"]
    else:
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            texts[choice["index"]] = choice["message"]["content"] if route == "chat" else choice["text"]
            finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == {0: "stop", 1: "stop", 2: "stop"}
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_response_format_json_object(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={
        "messages": USER, "max_tokens": 60, "temperature": 0.0, "response_format": {"type": "json_object"}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":  # the random model may also run out of tokens mid-object
        assert isinstance(json.loads(text), dict)


# ---------------------------------------------------------------------------------------------
# Native /generate: json_schema, regex, ebnf, streaming and n
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_generate_native_constraints(http: httpx.Client, stream: bool) -> None:
    constraints = [
        ({"json_schema": json.dumps(SCHEMA)}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"regex": r"[A-Z][a-z]{2,6} [0-9]{2}"}, lambda t: __import__("re").fullmatch(r"[A-Z][a-z]{2,6} [0-9]{2}", t)),
        ({"ebnf": 'root ::= ("yes" | "no") "," [0-9]'}, lambda t: __import__("re").fullmatch(r"(yes|no),[0-9]", t)),
    ]
    for params, check in constraints:
        response = http.post("/generate", json={
            "text": "Answer:", "stream": stream,
            "sampling_params": {"max_new_tokens": 100, "temperature": 0.9, "n": 2, **params}})
        if stream:
            assert response.status_code == 200
            finals: Dict[int, Dict[str, Any]] = {}
            for block in response.text.split("\n\n"):
                if block.startswith("data: ") and block != "data: [DONE]":
                    out = json.loads(block[len("data: "):])
                    finals[out.get("index", 0)] = out
            outputs = [finals[i] for i in sorted(finals)]
        else:
            assert response.status_code == 200, response.text
            outputs = response.json()
        assert len(outputs) == 2
        for out in outputs:
            assert out["meta_info"]["finish_reason"]["type"] == "stop", out
            assert check(out["text"]), (params, out["text"])


# ---------------------------------------------------------------------------------------------
# Bad constraints: a 400 that says what is wrong, streaming or not
# ---------------------------------------------------------------------------------------------
BAD = [
    ("/generate", {"text": "x", "sampling_params": {"regex": "(a"}}, "Invalid regex"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= nothing"}}, "not defined"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": "{bad"}}, "not valid JSON"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "Only one of"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}}, "Unsupported type"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema"}}, "needs a json_schema"),
    ("/v1/chat/completions", {"messages": USER, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "wrong"}}}}}],
        "tool_choice": "required"}, "Unsupported type"),
]


# ---------------------------------------------------------------------------------------------
# Structural tags (SGLang's sampling parameter and response_format type, both shapes)
# ---------------------------------------------------------------------------------------------
TAG_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}, "days": {"type": "integer",
              "minimum": 1, "maximum": 9}}, "required": ["city", "days"], "additionalProperties": False}
LEGACY_TAG = {"structures": [{"begin": "<weather>", "schema": TAG_SCHEMA, "end": "</weather>"}],
              "triggers": ["<weather>"], "at_least_one": True}
FORMAT_TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<weather>"], "at_least_one": True, "stop_after_first": True,
    "tags": [{"begin": "<weather>", "content": {"type": "json_schema", "json_schema": TAG_SCHEMA},
              "end": "</weather>"}]}}


def check_tagged(text: str, only_one: bool) -> None:
    """Every <weather>...</weather> part follows TAG_SCHEMA; at_least_one makes the output open with
    one (the random model would never type the trigger itself)."""
    assert text.startswith("<weather>"), text
    parts = __import__("re").findall(r"<weather>(.*?)</weather>", text, flags=__import__("re").S)
    assert parts and text.count("<weather>") == len(parts)
    for part in parts:
        jsonschema.validate(json.loads(part), TAG_SCHEMA)
    if only_one:
        assert text.endswith("</weather>") and len(parts) == 1


@pytest.mark.parametrize("tag,only_one", [(LEGACY_TAG, False), (FORMAT_TAG, True)])
def test_structural_tag_on_generate_and_chat(http: httpx.Client, tag: Dict[str, Any], only_one: bool) -> None:
    out = http.post("/generate", json={"text": "Forecast:", "sampling_params": {
        "max_new_tokens": 80, "temperature": 0.0, "structural_tag": json.dumps(tag)}})
    assert out.status_code == 200, out.text
    check_tagged(out.json()["text"], only_one)
    if only_one:
        assert out.json()["meta_info"]["finish_reason"]["type"] == "stop"
    response_format = {**tag, "type": "structural_tag"}
    for path, body in (("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "Forecast:"})):
        response = http.post(path, json={**body, "max_tokens": 80, "temperature": 0.7, "seed": 3, "n": 2,
                                         "response_format": response_format})
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            check_tagged(choice["message"]["content"] if "message" in choice else choice["text"], only_one)


BAD_TAGS = [
    ("/generate", {"text": "x", "sampling_params": {"structural_tag": "{bad"}}, "not valid JSON"),
    ("/generate", {"text": "x", "sampling_params": {"structural_tag": json.dumps({"triggers": ["<a>"]})}},
     'either "structures"'),
    ("/generate", {"text": "x", "sampling_params": {"structural_tag": json.dumps(
        {"structures": [{"begin": "<b>", "schema": {}, "end": "</b>"}], "triggers": ["<a>"]})}},
     "does not match any trigger"),
    ("/generate", {"text": "x", "sampling_params": {"structural_tag": json.dumps({"format": {"type": "bogus"}})}},
     "not recognized"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "structural_tag": json.dumps(LEGACY_TAG)}},
     "Only one of"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "structural_tag", "triggers": ["<a>"]}},
     "needs either"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {**LEGACY_TAG, "type": "structural_tag"},
                              "regex": "a"}, "at most one output constraint"),
]
BAD += BAD_TAGS


@pytest.mark.parametrize("path,body,needle", BAD)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_get_400(http: httpx.Client, path: str, body: Dict[str, Any], needle: str,
                                 stream: bool) -> None:
    response = http.post(path, json={**body, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["object"] == "error" and error["code"] == 400
    assert needle in error["message"], error["message"]


# ---------------------------------------------------------------------------------------------
# Tool calls
# ---------------------------------------------------------------------------------------------
def _check_calls(calls: List[Dict[str, Any]], names: List[str]) -> None:
    assert calls and [c["function"]["name"] for c in calls][: len(names)] == names or not names
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[call["function"]["name"]])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("parallel", [True, False])
def test_forced_tool_calls_always_parse(http: httpx.Client, tool_choice: Any, parallel: bool) -> None:
    for seed in range(2):
        response = http.post("/v1/chat/completions", json={
            "messages": USER, "tools": TOOLS, "tool_choice": tool_choice, "parallel_tool_calls": parallel,
            "max_tokens": 200, "temperature": 1.0, "seed": seed})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = choice["message"]["tool_calls"]
        assert choice["message"]["content"] is None
        if not parallel:
            assert len(calls) == 1
        if isinstance(tool_choice, dict):
            assert {c["function"]["name"] for c in calls} == {"get_time"}
        _check_calls(calls, [])


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_equal_the_whole_answer(http: httpx.Client, client: openai.OpenAI,
                                                    tool_choice: Any) -> None:
    body = {"messages": USER, "tools": TOOLS, "tool_choice": tool_choice, "max_tokens": 200, "temperature": 0.0}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    chunks = sse(http.post("/v1/chat/completions", json={**body, "stream": True}))
    calls: Dict[int, Dict[str, Any]] = {}
    finish = None
    for chunk in chunks:
        choice = chunk["choices"][0]
        delta = choice["delta"]
        assert "content" not in delta or delta["content"] == "" or delta.get("role")
        for call in delta.get("tool_calls", []):
            if "id" in call:  # the first delta of a call: id, type, name and empty arguments
                assert call["index"] not in calls and call["type"] == "function"
                assert call["function"]["arguments"] == "" or call["function"]["name"]
                calls[call["index"]] = {"id": call["id"], "type": "function",
                                        "function": {"name": call["function"]["name"], "arguments": ""}}
            else:
                assert set(call["function"]) == {"arguments"}
            calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        finish = choice["finish_reason"] or finish
    assert finish == "tool_calls" == whole["finish_reason"]
    streamed = [calls[i] for i in sorted(calls)]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]
    _check_calls(streamed, [])
    # The official client assembles the same calls from the stream.
    stream = client.chat.completions.create(model="default", stream=True, **body)
    names = {}
    for chunk in stream:
        for call in chunk.choices[0].delta.tool_calls or []:
            if call.function and call.function.name:
                names[call.index] = call.function.name
    assert [names[i] for i in sorted(names)] == [c["function"]["name"] for c in streamed]


def test_tools_reach_the_chat_template_and_auto_answers(http: httpx.Client) -> None:
    plain = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4}).json()
    auto = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "tools": TOOLS}).json()
    off = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4, "tools": TOOLS,
                                                  "tool_choice": "none"}).json()
    assert auto["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] == off["usage"]["prompt_tokens"]
    message = auto["choices"][0]["message"]
    assert message.get("tool_calls") is None and isinstance(message["content"], str)


# ---------------------------------------------------------------------------------------------
# Nothing left behind
# ---------------------------------------------------------------------------------------------
def test_no_leak_and_no_waiting_grammar_after_all_of_it(http: httpx.Client) -> None:
    def state() -> Dict[str, Any]:
        return http.get("/get_server_info").json()["internal_states"][0]

    assert wait_until(lambda: state()["num_running_reqs"] == 0 and state()["num_waiting_reqs"] == 0, timeout=60)
    final = state()
    assert final["num_grammar_queue_reqs"] == 0
    assert final["available_tokens"] + final["evictable_tokens"] == final["max_total_num_tokens"]
    assert final["protected_tokens"] == 0
