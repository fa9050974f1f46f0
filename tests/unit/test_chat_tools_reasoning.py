"""/v1/chat/completions with tool calls and reasoning through the real FastAPI app, over a scripted
manager whose model "says" a given text: non-streaming and streaming answers carry the same
reasoning_content, content and tool calls, shaped as OpenAI sends them."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Dict, List, Optional

import pytest
from fastapi.testclient import TestClient

from engine.entrypoints.http_server import create_app
from engine.tokenizer.request_normalizer import GenerateReqInput
from engine.server_args import ServerArgs

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
USER = [{"role": "user", "content": "hi"}]


class ScriptedManager:
    """A TokenizerManager stand-in: every sub-request outputs `script`, 3 characters at a time."""

    def __init__(self) -> None:
        self.script = ""
        self.finish: Dict[str, Any] = {"type": "stop", "matched": 2}
        self.tokenizer = None
        self.model_path = "/models/scripted"
        self.served_model_name = "scripted"
        self.context_len = 4096
        self.server_args = None
        self.lora_registry = None  # no --enable-lora
        self.requests: List[GenerateReqInput] = []
        self.template_tools: List[Optional[list]] = []

    def apply_chat_template(self, messages: List[dict], add_generation_prompt: bool = True,
                            tools: Optional[list] = None, continue_final_message: bool = False,
                            template_kwargs: Optional[dict] = None) -> List[int]:
        self.template_tools.append(tools)
        return [1, 2, 3]

    async def apply_chat_template_async(self, *args: Any, **kwargs: Any) -> List[int]:
        return self.apply_chat_template(*args, **kwargs)

    def _outputs(self, obj: GenerateReqInput, i: int) -> List[dict]:
        text = self.script
        cuts = list(range(3, len(text), 3)) + [len(text)]
        outs = []
        for n, end in enumerate(cuts):
            last = n == len(cuts) - 1
            outs.append({"text": text[:end], "output_ids": list(range(n + 1)), "meta_info": {
                "id": obj.rid[i], "prompt_tokens": 3, "completion_tokens": n + 1, "cached_tokens": 0,
                "finish_reason": dict(self.finish) if last else None}})
        return outs

    async def generate_request(self, obj: GenerateReqInput, request: Any = None,
                               incremental: bool = False) -> AsyncIterator[Any]:
        obj.normalize()
        self.requests.append(obj)
        runs = [self._outputs(obj, i) for i in range(obj.batch_size)]
        if obj.stream:
            for step in range(max(len(r) for r in runs)):
                for i, run in enumerate(runs):
                    if step < len(run):
                        out = dict(run[step])
                        if not obj.is_single:
                            out["index"] = i
                        yield out
        elif obj.is_single:
            yield runs[0][-1]
        else:
            yield [run[-1] for run in runs]

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        pass

    def is_alive(self) -> bool:
        return True


def make_client(manager: ScriptedManager, **server_kwargs: Any) -> TestClient:
    return TestClient(create_app(manager, ServerArgs(device="cpu", **server_kwargs)), raise_server_exceptions=False)


@pytest.fixture
def manager() -> ScriptedManager:
    return ScriptedManager()


def stream_message(client: TestClient, body: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    """Assemble each choice's streamed deltas into {content, reasoning_content, tool_calls, finish}."""
    response = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200, response.text
    blocks = [b[len("data: "):] for b in response.text.split("\n\n") if b.startswith("data: ")]
    assert blocks[-1] == "[DONE]"
    choices: Dict[int, Dict[str, Any]] = {}
    for chunk in map(json.loads, blocks[:-1]):
        for choice in chunk["choices"]:
            msg = choices.setdefault(choice["index"], {"content": "", "reasoning_content": "", "tool_calls": {},
                                                       "finish": None})
            delta = choice["delta"]
            assert set(delta) <= {"role", "content", "reasoning_content", "tool_calls"}
            msg["content"] += delta.get("content") or ""
            msg["reasoning_content"] += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["type"] == "function" and call["function"]["name"]
                    msg["tool_calls"][call["index"]] = {"id": call["id"], "name": call["function"]["name"],
                                                        "arguments": call["function"]["arguments"]}
                else:
                    assert list(call) == ["index", "function"] and list(call["function"]) == ["arguments"]
                    msg["tool_calls"][call["index"]]["arguments"] += call["function"]["arguments"]
            msg["finish"] = choice["finish_reason"] or msg["finish"]
    return choices


def whole_message(client: TestClient, body: Dict[str, Any]) -> Dict[str, Any]:
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_auto_tool_calls_with_hermes_parser(manager: ScriptedManager) -> None:
    client = make_client(manager, tool_call_parser="qwen25")
    manager.script = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                      '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    body = {"messages": USER, "tools": TOOLS}
    choice = whole_message(client, body)
    assert choice["finish_reason"] == "tool_calls" and choice["matched_stop"] is None
    message = choice["message"]
    assert message["content"] == "Let me check.\n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    assert [t["function"]["name"] for t in manager.template_tools[-1]] == ["get_weather", "get_time"]

    streamed = stream_message(client, {**body, "n": 2})
    for index in (0, 1):
        msg = streamed[index]
        assert msg["finish"] == "tool_calls" and msg["content"] == "Let me check.\n"
        assert [(c["name"], json.loads(c["arguments"])) for c in msg["tool_calls"].values()] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_text_without_calls_stays_content(manager: ScriptedManager) -> None:
    client = make_client(manager, tool_call_parser="qwen25")
    manager.script = "No call here, <tool but not a tag."
    choice = whole_message(client, {"messages": USER, "tools": TOOLS})
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": manager.script}
    assert stream_message(client, {"messages": USER, "tools": TOOLS})[0]["content"] == manager.script


def test_reasoning_split_whole_and_streamed(manager: ScriptedManager) -> None:
    client = make_client(manager, reasoning_parser="qwen3")
    manager.script = "<think>\nFirst, the weather.\n</think>\n\nIt is sunny."
    message = whole_message(client, {"messages": USER})["message"]
    assert message["reasoning_content"] == "First, the weather." and message["content"] == "It is sunny."
    streamed = stream_message(client, {"messages": USER})[0]
    assert streamed["reasoning_content"] == "First, the weather." and streamed["content"] == "It is sunny."
    # separate_reasoning false: the raw text, no reasoning_content.
    raw = whole_message(client, {"messages": USER, "separate_reasoning": False})["message"]
    assert raw == {"role": "assistant", "content": manager.script}
    # stream_reasoning false: the reasoning arrives in one piece.
    response = client.post("/v1/chat/completions", json={"messages": USER, "stream": True, "stream_reasoning": False})
    pieces = [json.loads(b[6:])["choices"][0]["delta"].get("reasoning_content")
              for b in response.text.split("\n\n") if b.startswith("data: {")]
    assert [p for p in pieces if p] == ["First, the weather."]


def test_qwen3_answer_without_an_opening_tag_is_reasoning_until_the_closing_one(manager: ScriptedManager) -> None:
    """SGLang's rule for --reasoning-parser qwen3: Qwen3 thinks unless the request switches it off
    (chat_template_kwargs.enable_thinking false), so an answer that starts without <think> (the
    Qwen3 thinking templates open it in the prompt) is reasoning up to </think>."""
    client = make_client(manager, reasoning_parser="qwen3")
    manager.script = "First, the weather.\n</think>\n\nIt is sunny."
    for msg in (whole_message(client, {"messages": USER})["message"], stream_message(client, {"messages": USER})[0]):
        assert msg["reasoning_content"] == "First, the weather." and msg["content"] == "It is sunny."
    manager.script = "Plain answer, no thinking."
    off = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    assert whole_message(client, off)["message"] == {"role": "assistant", "content": manager.script}
    assert stream_message(client, off)[0]["content"] == manager.script


class TailTokenizer:
    """Decodes any prompt to a chat template's generation prompt that opened <think>."""

    def decode(self, ids: List[int]) -> str:
        return "<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize("parser", ["qwen3-thinking", "deepseek-v3"])
def test_a_prompt_that_opened_think_starts_the_answer_in_reasoning(manager: ScriptedManager, parser: str) -> None:
    """qwen3-thinking always starts in reasoning; deepseek-v3 (reasoning off unless `thinking`
    is set) does when the rendered prompt ends with the opening tag, as a thinking template leaves it."""
    client = make_client(manager, reasoning_parser=parser)
    manager.tokenizer = TailTokenizer()
    manager.script = "Plan.</think>Answer."
    for msg in (whole_message(client, {"messages": USER})["message"], stream_message(client, {"messages": USER})[0]):
        assert msg["reasoning_content"] == "Plan." and msg["content"] == "Answer."


@pytest.mark.parametrize("name", ["gpt-oss", "mistral", "not-a-parser"])
def test_reasoning_parsers_we_lack_are_refused_at_start_up(name: str) -> None:
    from engine.server_args import ServerArgsError

    with pytest.raises(ServerArgsError, match="qwen3-thinking") as info:
        ServerArgs(device="cpu", reasoning_parser=name).check()
    assert name in str(info.value)


def test_reasoning_then_tool_call(manager: ScriptedManager) -> None:
    client = make_client(manager, tool_call_parser="qwen25", reasoning_parser="deepseek-r1")
    manager.script = ('I need the weather.</think>\n<tool_call>\n{"name": "get_weather", "arguments": '
                      '{"city": "Oslo"}}\n</tool_call>')
    for msg in (whole_message(client, {"messages": USER, "tools": TOOLS})["message"],
                stream_message(client, {"messages": USER, "tools": TOOLS})[0]):
        assert msg["reasoning_content"] == "I need the weather."
        assert msg["content"] in (None, "")
        calls = msg["tool_calls"]
        calls = list(calls.values()) if isinstance(calls, dict) else [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_tools_without_a_parser_answer_plain_content(manager: ScriptedManager) -> None:
    """SGLang parses tool calls only when the server has a --tool-call-parser: agent clients send
    `tools` on every request, and without a parser the answer is the plain text, with the tools
    still shown to the model through the chat template."""
    client = make_client(manager)
    manager.script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    choice = whole_message(client, {"messages": USER, "tools": TOOLS})
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == manager.script and not choice["message"].get("tool_calls")
    assert "json_schema" not in manager.requests[-1].sampling_params[0]
    # As SGLang, tools keep the special tokens in the text (tool-call markers may be special tokens).
    assert manager.requests[-1].sampling_params[0]["skip_special_tokens"] is False
    streamed = stream_message(client, {"messages": USER, "tools": TOOLS})[0]
    assert streamed["content"] == manager.script and not streamed["tool_calls"]
    whole_message(client, {"messages": USER, "tools": TOOLS, "tool_choice": "none"})
    assert manager.requests[-1].sampling_params[0]["skip_special_tokens"] is True


def test_forced_tool_choice_parses_the_constrained_array(manager: ScriptedManager) -> None:
    client = make_client(manager)  # no --tool-call-parser needed
    manager.script = '[{"name": "get_weather", "parameters": {"city": "Rome"}}]'
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required"}
    choice = whole_message(client, body)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assert "json_schema" in manager.requests[-1].sampling_params[0]
    streamed = stream_message(client, body)[0]
    assert streamed["content"] == "" and streamed["finish"] == "tool_calls"
    assert json.loads(streamed["tool_calls"][0]["arguments"]) == {"city": "Rome"}


def test_forced_tool_choice_cut_by_length_is_content(manager: ScriptedManager) -> None:
    client = make_client(manager)
    manager.script = '[{"name": "get_weather", "parameters": {"city": "Ro'
    manager.finish = {"type": "length", "length": 20}
    choice = whole_message(client, {"messages": USER, "tools": TOOLS, "tool_choice": "required"})
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == manager.script and "tool_calls" not in choice["message"]
