"""Tool-call parsers: find the function calls in a model's output text (`--tool-call-parser`).

Formats (SGLang's parser names):
- `llama3`: Llama 3.1 / 3.2 JSON, `{"name": ..., "parameters": {...}}` as the whole answer (an
  optional `<|python_tag|>` first), several calls separated by `;`.
- `qwen25` (`qwen`, `hermes`): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  after optional text, one block per call.
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` after optional text.
- `pythonic`: `[get_weather(city="Paris"), ...]` (Llama 4 style), Python literals as arguments.
- `json_array` (internal): the output of tool_choice "required" or a named function, a JSON array
  `[{"name": ..., "parameters": {...}}, ...]` constrained by the tools' schemas.

Every parser implements one method, `scan(text, final)`: the text before the calls that is certainly
not part of one, and each call so far with its name once complete and the raw text of its arguments
as far as it got. Non-streaming parsing is `scan(text, final=True)`; streaming re-scans the text so
far and emits what is new (`ToolCallStream`), so both paths agree by construction: the argument
deltas of a call concatenate to the raw JSON text of its arguments.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

_WHITESPACE = " \t\r\n"


@dataclass
class PartialCall:
    name: Optional[str] = None  # known once its JSON string is complete
    arguments: str = ""  # raw JSON text of the arguments, possibly incomplete
    complete: bool = False


@dataclass
class Scan:
    normal_text: str
    calls: List[PartialCall] = field(default_factory=list)


@dataclass
class ToolCallItem:
    """A finished call: its index in the answer, function name and JSON arguments text."""

    index: int
    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """What is new about call `index`: its id and name the first time, then argument text."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""


# ---------------------------------------------------------------------------------------------
# Partial JSON scanning
# ---------------------------------------------------------------------------------------------


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WHITESPACE:
        pos += 1
    return pos


def json_value_end(text: str, pos: int) -> Optional[int]:
    """End (exclusive) of the JSON value starting at `pos`, or None if it is not complete yet.

    A number or literal counts as complete only when something follows it: `12` may become `123`.
    """
    if pos >= len(text):
        return None
    first = text[pos]
    if first == '"':
        i = pos + 1
        while i < len(text):
            if text[i] == "\\":
                i += 2
                continue
            if text[i] == '"':
                return i + 1
            i += 1
        return None
    if first in "{[":
        depth, i, in_string = 0, pos, False
        while i < len(text):
            c = text[i]
            if in_string:
                if c == "\\":
                    i += 1
                elif c == '"':
                    in_string = False
            elif c == '"':
                in_string = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return None
    i = pos
    while i < len(text) and text[i] not in _WHITESPACE + ",}]":
        i += 1
    return i if i < len(text) else None


def scan_call_object(text: str, pos: int, name_keys: Sequence[str] = ("name",),
                     args_keys: Sequence[str] = ("arguments", "parameters")) -> Tuple[Optional[PartialCall], int]:
    """Scan a `{"name": ..., "arguments": ...}` object at `pos`: (call so far, end). The call is
    None when `pos` does not start an object; `complete` tells whether it was closed."""
    pos = skip_ws(text, pos)
    if pos >= len(text) or text[pos] != "{":
        return None, pos
    call = PartialCall()
    pos += 1
    while True:
        pos = skip_ws(text, pos)
        if pos >= len(text):
            return call, pos
        if text[pos] == "}":
            call.complete = call.name is not None
            return call, pos + 1
        if text[pos] == ",":
            pos += 1
            continue
        key_end = json_value_end(text, pos)
        if text[pos] != '"' or key_end is None:
            return call, len(text)
        key = json.loads(text[pos:key_end])
        pos = skip_ws(text, key_end)
        if pos >= len(text) or text[pos] != ":":
            return call, len(text)
        value_start = skip_ws(text, pos + 1)
        value_end = json_value_end(text, value_start)
        if key in args_keys:
            call.arguments = text[value_start:value_end] if value_end is not None else text[value_start:]
        elif key in name_keys and value_end is not None and text[value_start] == '"':
            call.name = json.loads(text[value_start:value_end])
        if value_end is None:
            return call, len(text)
        pos = value_end


def scan_call_sequence(text: str, pos: int, separator: str,
                       args_keys: Sequence[str] = ("arguments", "parameters")) -> List[PartialCall]:
    """Call objects from `pos` on, separated by `separator`, up to the first unfinished one."""
    calls: List[PartialCall] = []
    while True:
        call, pos = scan_call_object(text, pos, args_keys=args_keys)
        if call is None:
            return calls
        calls.append(call)
        if not call.complete:
            return calls
        pos = skip_ws(text, pos)
        if pos < len(text) and text[pos] == separator:
            pos += 1


def _held_back(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that could begin one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                best = max(best, n)
                break
    return best


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------


class ToolCallParser(ABC):
    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The normal text and the calls in `text` (see the module docstring)."""

    def parse(self, text: str) -> Tuple[str, List[ToolCallItem]]:
        """Non-streaming: (normal text, finished calls). Calls whose arguments are not valid JSON
        are dropped; when none is left the whole text is content."""
        scan = self.scan(text, final=True)
        calls: List[ToolCallItem] = []
        for call in scan.calls:
            if not call.complete or call.name is None:
                continue
            arguments = normalize_arguments(call.arguments)
            if arguments is not None:
                calls.append(ToolCallItem(len(calls), call.name, arguments))
        if not calls:
            return text, []
        return scan.normal_text, calls


def normalize_arguments(raw: str) -> Optional[str]:
    """Compact JSON text of a call's arguments ({} when absent), or None if they do not parse."""
    if not raw.strip():
        return "{}"
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return json.dumps(value, ensure_ascii=False)


class JsonArrayParser(ToolCallParser):
    """`[{"name": ..., "parameters": {...}}, ...]` after an optional start marker."""

    def __init__(self, marker: str = "") -> None:
        self.marker = marker

    def scan(self, text: str, final: bool) -> Scan:
        if self.marker:
            start = text.find(self.marker)
            if start < 0:
                keep = len(text) if final else len(text) - _held_back(text, [self.marker])
                return Scan(text[:keep])
            normal, pos = text[:start], start + len(self.marker)
        else:
            # The constrained form: the whole answer is the array (parse() falls back to content).
            normal, pos = "", 0
        pos = skip_ws(text, pos)
        if pos >= len(text) or text[pos] != "[":
            return Scan(normal)
        return Scan(normal, scan_call_sequence(text, pos + 1, ","))


class HermesParser(ToolCallParser):
    """Qwen 2.5 / Hermes: `<tool_call>\\n{json}\\n</tool_call>` blocks; text around them is content."""

    start, end = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        normal: List[str] = []
        calls: List[PartialCall] = []
        pos = 0
        while True:
            start = text.find(self.start, pos)
            if start < 0:
                rest = text[pos:]
                keep = len(rest) if final else len(rest) - _held_back(rest, [self.start])
                normal.append(rest[:keep])
                return Scan("".join(normal), calls)
            normal.append(text[pos:start])
            call, pos = scan_call_object(text, start + len(self.start), args_keys=("arguments", "parameters"))
            if call is None:
                # Not JSON after the tag (yet): nothing after it is content.
                return Scan("".join(normal), calls)
            calls.append(call)
            if not call.complete:
                return Scan("".join(normal), calls)
            close = text.find(self.end, pos)
            if close < 0:
                return Scan("".join(normal), calls)
            pos = close + len(self.end)
            # The newline between blocks belongs to the format, not to the content.
            while pos < len(text) and text[pos] == "\n":
                pos += 1


class Llama3Parser(ToolCallParser):
    """Llama 3.1 / 3.2 JSON tool calls: the answer is `{"name": ..., "parameters": ...}` (`;`
    between several), optionally after `<|python_tag|>`; anything else is content."""

    tag = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        tag_at = text.find(self.tag)
        if tag_at >= 0:
            normal, pos = text[:tag_at], tag_at + len(self.tag)
        else:
            pos = skip_ws(text, 0)
            if pos >= len(text):
                return Scan(text if final else "")
            if text[pos] != "{":
                keep = len(text) if final else len(text) - _held_back(text, [self.tag])
                return Scan(text[:keep])
            normal = ""
        return Scan(normal, scan_call_sequence(text, pos, ";", args_keys=("parameters", "arguments")))


_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.]*\s*\(")
# The end of a text that may still grow into a call list's start.
_PYTHONIC_PARTIAL = re.compile(r"\[\s*([A-Za-z_][A-Za-z0-9_.]*\s*)?$")


class PythonicParser(ToolCallParser):
    """`[f(a=1, b="x"), g()]`: a Python list of calls with literal keyword arguments. A call is
    reported once the whole list is complete (its arguments are converted to JSON then)."""

    markers = ("<|python_start|>", "<|python_end|>")

    def scan(self, text: str, final: bool) -> Scan:
        match = _PYTHONIC_START.search(text)
        if match is None:
            keep = len(text)
            if not final:
                partial = _PYTHONIC_PARTIAL.search(text)
                keep = partial.start() if partial is not None else len(text) - _held_back(text, self.markers)
            return Scan(_strip_markers(text[:keep], self.markers))
        normal = _strip_markers(text[:match.start()], self.markers)
        end = json_value_end(text, match.start())  # bracket matching, strings respected
        if end is None:
            return Scan(normal)
        try:
            tree = ast.parse(text[match.start():end], mode="eval").body
        except (SyntaxError, ValueError, RecursionError):
            return Scan(normal)
        calls = [_pythonic_call(node) for node in getattr(tree, "elts", [])]
        if not calls or any(c is None for c in calls):
            return Scan(normal)
        return Scan(normal, [c for c in calls if c is not None])


def _strip_markers(text: str, markers: Sequence[str]) -> str:
    for marker in markers:
        text = text.replace(marker, "")
    return text


def _pythonic_call(node: Any) -> Optional[PartialCall]:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func)
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return None
    return PartialCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False), complete=True)


TOOL_CALL_PARSERS: Dict[str, Callable[[], ToolCallParser]] = {
    "llama3": Llama3Parser,
    "qwen25": HermesParser,
    "qwen": HermesParser,
    "hermes": HermesParser,
    "mistral": lambda: JsonArrayParser("[TOOL_CALLS]"),
    "pythonic": PythonicParser,
}


def create_tool_call_parser(name: str) -> ToolCallParser:
    try:
        factory = TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}") from None
    return factory()


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """Turns a growing output text into content deltas and OpenAI-style tool-call deltas.

    Each call is announced once (index, id, name, empty arguments) when its name is complete,
    then its argument text follows in pieces; finished calls keep their ids for the final message.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.ids: List[str] = []
        self.args_sent: List[int] = []

    def feed(self, delta: str, final: bool = False) -> Tuple[str, List[ToolCallDelta]]:
        self.text += delta
        scan = self.parser.scan(self.text, final)
        content = scan.normal_text[self.content_sent:]
        # Content already sent stays sent: a later scan never takes text back.
        self.content_sent = max(self.content_sent, len(scan.normal_text))
        deltas: List[ToolCallDelta] = []
        for index, call in enumerate(scan.calls):
            if call.name is None:
                break
            if index == len(self.ids):
                self.ids.append(new_tool_call_id())
                self.args_sent.append(0)
                deltas.append(ToolCallDelta(index, id=self.ids[index], name=call.name))
            new_args = call.arguments[self.args_sent[index]:]
            if new_args:
                self.args_sent[index] = len(call.arguments)
                if deltas and deltas[-1].index == index:
                    deltas[-1].arguments += new_args
                else:
                    deltas.append(ToolCallDelta(index, arguments=new_args))
        return content, deltas

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)
