"""Reasoning models against a real server: the built-in model behind a Qwen3-Thinking style chat
template (its generation prompt opens `<think>`) and `--reasoning-parser qwen3`. A custom logit
processor makes the random model "think" a scripted text and close it with `</think>` (several
tokens in this tokenizer), so the split and the grammar's start are known exactly: the reasoning
is the script, and with a constraint only the answer after `</think>` follows it (SGLang's
ReasonerGrammarBackend), which only the grammar can make valid. The same server answers SGLang's
return_hidden_states "last" (agent and RL clients ask for it) over HTTP."""

from __future__ import annotations

import json
from typing import Any, Dict, List

import httpx
import pytest
import torch

pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar (pip install xgrammar)")
pytest.importorskip("dill", reason="the scripted thinking is a custom logit processor (pip install dill)")
jsonschema = pytest.importorskip("jsonschema", reason="schema validation needs jsonschema")

from engine.builtin_model import CHAT_TEMPLATE  # noqa: E402
from engine.sampling.custom_logit_processor import CustomLogitProcessor  # noqa: E402

pytestmark = pytest.mark.slow

_OPEN_ANSWER = "{{- '<|assistant|>\\n' -}}{%- endif -%}"
assert _OPEN_ANSWER in CHAT_TEMPLATE
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(_OPEN_ANSWER, "{{- '<|assistant|>\\n<think>\\n' -}}{%- endif -%}")
SERVER_ARGS = ["--reasoning-parser", "qwen3", "--enable-custom-logit-processor",
               "--constrained-json-disable-any-whitespace", "--chat-template", THINKING_TEMPLATE]
USER = [{"role": "user", "content": "Give me the data."}]
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "rain": {"type": "boolean"}},
    "required": ["city", "rain"],
    "additionalProperties": False,
}
THOUGHT = "Let me think about the weather"

# The processor counts its own calls per request (one per sampled token), which stays right with the
# overlap scheduler, where a request's output_ids may lag one step behind the sampling.
SCRIPT_SOURCE = """
def __call__(self, logits, custom_param_list=None):
    steps = self.__dict__.setdefault("steps", {})
    for row, params in enumerate(custom_param_list):
        rid = params["__req__"].rid
        step = steps[rid] = steps.get(rid, -1) + 1
        script = params["script"]
        if step < len(script):
            logits[row] = float("-inf")
            logits[row, script[step]] = 0.0
    return logits
"""


def _script_processor() -> str:
    """Serialized by value (a class of '__main__'), so the scheduler needs no import of this module."""
    scope: Dict[str, Any] = {"__name__": "__main__"}
    exec(SCRIPT_SOURCE, scope)
    cls = type("Script", (CustomLogitProcessor,), {"__call__": scope["__call__"], "__module__": "__main__"})
    return cls.to_str()


@pytest.fixture(scope="module")
def http(server_url: str) -> httpx.Client:
    with httpx.Client(base_url=server_url, timeout=180.0) as c:
        yield c


def scripted(tokenizer: Any, *pieces: str) -> Dict[str, Any]:
    ids: List[int] = []
    for piece in pieces:
        ids += tokenizer.encode(piece, add_special_tokens=False)
    return {"custom_logit_processor": _script_processor(), "custom_params": {"script": ids}}


def chat_message(http: httpx.Client, body: Dict[str, Any]) -> Dict[str, Any]:
    if body.get("stream"):
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        msg: Dict[str, Any] = {"content": "", "reasoning_content": "", "finish_reason": None}
        for block in response.text.split("\n\n"):
            if block.startswith("data: {"):
                for choice in json.loads(block[6:])["choices"]:
                    msg["content"] += choice["delta"].get("content") or ""
                    msg["reasoning_content"] += choice["delta"].get("reasoning_content") or ""
                    msg["finish_reason"] = choice["finish_reason"] or msg["finish_reason"]
        return msg
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {**choice["message"], "finish_reason": choice["finish_reason"]}


@pytest.mark.parametrize("stream", [False, True])
def test_the_grammar_starts_after_the_thinking(http: httpx.Client, tokenizer: Any, stream: bool) -> None:
    """response_format with a thinking model: the scripted reasoning (not JSON) is free, the answer
    after </think> follows the schema, and both come back apart."""
    msg = chat_message(http, {
        "messages": USER, "max_tokens": 200, "temperature": 0.0, "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
        **scripted(tokenizer, THOUGHT, "</think>")})
    assert msg["reasoning_content"] == THOUGHT
    assert msg["finish_reason"] == "stop"
    jsonschema.validate(json.loads(msg["content"]), SCHEMA)


def test_a_forced_tool_call_after_the_thinking(http: httpx.Client, tokenizer: Any) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}}}
    msg = chat_message(http, {"messages": USER, "max_tokens": 200, "temperature": 0.0, "tools": [tool],
                              "tool_choice": "required", **scripted(tokenizer, THOUGHT, "</think>")})
    assert msg["reasoning_content"] == THOUGHT and msg["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"] * len(msg["tool_calls"])
    assert all(json.loads(c["function"]["arguments"])["city"] in ("Oslo", "Rome") for c in msg["tool_calls"])


def test_a_template_that_opened_think_wins_over_enable_thinking(http: httpx.Client, tokenizer: Any) -> None:
    """This template opens <think> whatever enable_thinking says: the answer starts in reasoning
    (the rendered prompt's tail decides it), so the closing tag is not left in the content."""
    msg = chat_message(http, {"messages": USER, "max_tokens": 12, "temperature": 0.0,
                              "chat_template_kwargs": {"enable_thinking": False},
                              **scripted(tokenizer, "Plan", "</think>", "Answer")})
    assert msg["reasoning_content"] == "Plan"
    assert msg["content"].startswith("Answer") and "</think>" not in msg["content"]


def test_generate_with_require_reasoning(http: httpx.Client, tokenizer: Any) -> None:
    """/generate: SGLang's require_reasoning defers the constraint past </think>; without it the
    grammar applies from the first token, where the scripted thinking is a dead end."""
    sampling = {"max_new_tokens": 200, "temperature": 0.0, "json_schema": json.dumps(SCHEMA),
                **scripted(tokenizer, THOUGHT, "</think>")}
    processor = sampling.pop("custom_logit_processor")
    body = {"text": "Weather:", "sampling_params": sampling, "custom_logit_processor": processor}
    response = http.post("/generate", json={**body, "require_reasoning": True})
    assert response.status_code == 200, response.text
    out = response.json()
    thought, answer = out["text"].split("</think>")
    assert thought == THOUGHT and out["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(answer), SCHEMA)
    refused = http.post("/generate", json=body)
    assert refused.status_code == 400 and "dead end" in refused.text


def test_return_hidden_states_last_over_http(http: httpx.Client) -> None:
    """"last" gives one vector: the last entry of the full answer (the oracle, itself checked
    against transformers in test_control_server.py), on /generate, streamed, and on chat; and a
    cached prompt is reused (true recomputes every prompt position)."""
    body = {"text": "Weather in Oslo:", "sampling_params": {"max_new_tokens": 5, "temperature": 0.0,
                                                             "ignore_eos": True}}
    full = http.post("/generate", json={**body, "return_hidden_states": True}).json()
    last = http.post("/generate", json={**body, "return_hidden_states": "last"}).json()
    assert last["output_ids"] == full["output_ids"]
    assert len(last["meta_info"]["hidden_states"]) == 1
    torch.testing.assert_close(torch.tensor(last["meta_info"]["hidden_states"][0]),
                               torch.tensor(full["meta_info"]["hidden_states"][-1]), rtol=1e-4, atol=1e-4)
    assert last["meta_info"]["cached_tokens"] > 0 and full["meta_info"]["cached_tokens"] == 0
    streamed = http.post("/generate", json={**body, "return_hidden_states": "last", "stream": True})
    finals = [json.loads(b[6:]) for b in streamed.text.split("\n\n") if b.startswith("data: {")]
    assert all(len(f["meta_info"]["hidden_states"]) == 1 for f in finals)
    assert finals[-1]["meta_info"]["hidden_states"] == last["meta_info"]["hidden_states"]
    chat = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "temperature": 0.0,
                                                   "return_hidden_states": "last"})
    assert chat.status_code == 200, chat.text
    vector = chat.json()["choices"][0]["hidden_states"]
    assert isinstance(vector, list) and len(vector) == len(full["meta_info"]["hidden_states"][-1])
