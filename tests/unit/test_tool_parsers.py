"""Tool-call and reasoning parsers: every format parsed whole, and streamed in every chunking to
the same content, names and arguments."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.parsers.reasoning import (
    REASONING_PARSER_NAMES,
    ReasoningParser,
    reasoning_parser_error,
    starts_in_reasoning,
)
from engine.parsers.tool_calls import (
    JsonArrayParser,
    ToolCallStream,
    create_tool_call_parser,
    json_value_end,
)

WEATHER = {"city": "Paris", "days": [1, 2], "note": "a \"quoted\" }] text"}
TIME = {"tz": "UTC"}

# (parser, text, expected content, expected [(name, arguments)])
CASES = [
    ("qwen25", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}\n</tool_call>',
     "Sure.\n", [("get_weather", WEATHER)]),
    ("qwen25", '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
     "", [("get_weather", WEATHER), ("get_time", TIME)]),
    ("qwen25", "No tools needed <tool here.", "No tools needed <tool here.", []),
    ("llama3", '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
     "", [("get_weather", WEATHER)]),
    ("llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC"}}', "",
     [("get_weather", {"city": "Paris"}), ("get_time", TIME)]),
    ("llama3", "Just text {not a call}", "Just text {not a call}", []),
    ("mistral", 'Calling [TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}, "
     '{"name": "get_time", "arguments": {"tz": "UTC"}}]', "Calling ",
     [("get_weather", WEATHER), ("get_time", TIME)]),
    ("pythonic", 'Let me check. [get_weather(city="Paris", days=[1, 2]), get_time(tz="UTC")]', "Let me check. ",
     [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", TIME)]),
    ("pythonic", "A list [1, 2] is not a call.", "A list [1, 2] is not a call.", []),
]


def _parse(name: str):
    return JsonArrayParser() if name == "json_array" else create_tool_call_parser(name)


def _stream(name: str, text: str, cuts: list[int]):
    stream = ToolCallStream(_parse(name))
    content = ""
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    ids: dict[int, str] = {}
    bounds = sorted(set([0, *cuts, len(text)]))
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] + [""]
    for i, piece in enumerate(pieces):
        delta, calls = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta
        for call in calls:
            if call.name is not None:
                assert call.index not in names, "a call is announced once"
                names[call.index], ids[call.index] = call.name, call.id
                args.setdefault(call.index, "")
            else:
                assert call.index in names, "arguments come after the announcement"
            args[call.index] += call.arguments
    calls = [(names[i], json.loads(args[i])) for i in sorted(names)]
    return content, calls, ids


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parse_whole_text(name, text, content, calls):
    normal, items = _parse(name).parse(text)
    assert normal == content
    assert [(c.name, json.loads(c.arguments)) for c in items] == calls
    assert [c.index for c in items] == list(range(len(calls)))


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_stream_char_by_char_equals_whole(name, text, content, calls):
    got_content, got_calls, ids = _stream(name, text, list(range(len(text))))
    if calls:
        assert (got_content, got_calls) == (content, calls)
        assert len(set(ids.values())) == len(calls) and all(i.startswith("call_") for i in ids.values())
    else:
        assert got_content == text and got_calls == []


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_stream_any_chunking_equals_whole(case, cuts):
    name, text, content, calls = case
    got_content, got_calls, _ = _stream(name, text, [c for c in cuts if c < len(text)])
    assert got_calls == calls
    assert got_content == (content if calls else text)


def test_constrained_json_array_form():
    text = '[{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}, {"name": "get_time", "parameters": {}}]'
    normal, items = JsonArrayParser().parse(text)
    assert normal == "" and [(c.name, json.loads(c.arguments)) for c in items] == [
        ("get_weather", WEATHER), ("get_time", {})]
    content, calls, _ = _stream("json_array", text, list(range(0, len(text), 3)))
    assert content == "" and calls == [("get_weather", WEATHER), ("get_time", {})]


def test_invalid_arguments_fall_back_to_content():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>'
    assert create_tool_call_parser("qwen25").parse(text) == (text, [])
    cut = '[{"name": "f", "parameters": {"a": '  # a length-limited constrained answer
    assert JsonArrayParser().parse(cut) == (cut, [])


def test_json_value_end():
    assert json_value_end('{"a": "}"} tail', 0) == 10
    assert json_value_end('{"a": [1, {"b": 2}', 0) is None
    assert json_value_end('"x\\"y" ', 0) == 6
    assert json_value_end("12", 0) is None and json_value_end("12,", 0) == 2


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="Unknown tool-call parser"):
        create_tool_call_parser("nope")


# ------------------------------------------------------------------------------------ reasoning
CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
REASONING_CASES = [
    # (parser, starts in reasoning (None: the format's default), text, reasoning, content)
    ("deepseek-r1", None, "<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek-r1", None, "I start thinking at once.</think>\n\nDone.", "I start thinking at once.", "Done."),
    ("deepseek-r1", None, "Still thinking when the budget ran out", "Still thinking when the budget ran out", ""),
    ("qwen3", False, "<think>\nplan\n</think>\n\nHello", "plan", "Hello"),
    ("qwen3", False, "No thinking here.", None, "No thinking here."),
    ("qwen3", False, "<think>unfinished", "unfinished", ""),
    # The template opened <think> in the prompt (Qwen3 thinking models): no opening tag in the answer.
    ("qwen3", None, "plan\n</think>\n\nHello", "plan", "Hello"),
    ("qwen3", True, "<think>plan</think>Hi", "plan", "Hi"),
    ("qwen3-thinking", None, "I reason.</think>\n\nAnswer.", "I reason.", "Answer."),
    ("qwen3-thinking", False, "I reason.</think>Answer.", "I reason.", "Answer."),
    # A tool call straight from the thinking ends it and stays whole in the content.
    ("qwen3", True, "Need the weather.\n" + CALL, "Need the weather.", CALL),
    ("glm45", True, "a</think>b", "a", "b"),
    ("kimi_k2", True, "a<|tool_calls_section_begin|>x", "a", "<|tool_calls_section_begin|>x"),
    ("deepseek-v3", False, "plain", None, "plain"),
    ("kimi", None, "◁think▷hmm◁/think▷ ok", "hmm", "ok"),
    ("kimi", None, "plain ◁/think▷", None, "plain ◁/think▷"),
    ("minimax-append-think", None, "abc</think>def", None, "<think>abc</think>def"),
    ("deepseek-r1", None, "</think>Only an answer.", None, "Only an answer."),
]


@pytest.mark.parametrize("name,start,text,reasoning,content", REASONING_CASES)
def test_reasoning_whole_text(name, start, text, reasoning, content):
    assert ReasoningParser(name, start).parse(text) == (reasoning, content)


@pytest.mark.parametrize("name,start,text,reasoning,content", REASONING_CASES)
@pytest.mark.parametrize("step", [1, 2, 5])
def test_reasoning_streamed_equals_whole(name, start, text, reasoning, content, step):
    parser = ReasoningParser(name, start)
    got_reasoning, got_content = "", ""
    for i in range(0, len(text), step):
        r, c = parser.feed(text[i:i + step])
        got_reasoning += r
        got_content += c
    r, c = parser.feed("", final=True)
    got_reasoning += r
    got_content += c
    assert got_reasoning == (reasoning or "")
    assert got_content == content


@pytest.mark.parametrize("name,kwargs,prompt_opens,expected", [
    # SGLang's rule: hybrid models think unless the template switch turns it off ...
    ("qwen3", None, False, True),
    ("qwen3", {"enable_thinking": False}, False, False),
    ("qwen3", {"enable_thinking": True}, False, True),
    ("glm45", {"enable_thinking": False}, False, False),
    ("kimi_k2", {"thinking": False}, False, False),
    # ... DeepSeek-V3 / MiMo only when it is turned on ...
    ("deepseek-v3", None, False, False),
    ("deepseek-v3", {"thinking": True}, False, True),
    ("mimo", {"enable_thinking": True}, False, True),
    # ... thinking models always; and a template that opened <think> wins over the switch.
    ("qwen3-thinking", {"enable_thinking": False}, False, True),
    ("deepseek-r1", None, False, True),
    ("deepseek-v3", None, True, True),
    ("qwen3", {"enable_thinking": False}, True, True),
    ("kimi", None, True, False),
])
def test_starts_in_reasoning(name, kwargs, prompt_opens, expected):
    assert starts_in_reasoning(name, kwargs, prompt_opens) is expected


def test_every_sglang_reasoning_parser_name_is_served_or_refused_clearly():
    for name in REASONING_PARSER_NAMES:
        assert reasoning_parser_error(name) is None
    for name in ("gpt-oss", "mistral", "gemma4", "minimax-m3", "hunyuan"):
        error = reasoning_parser_error(name)
        assert error is not None and "not implemented" in error and "qwen3-thinking" in error
    assert "must be one of" in (reasoning_parser_error("nope") or "")
    with pytest.raises(ValueError, match="must be one of"):
        ReasoningParser("nope")
