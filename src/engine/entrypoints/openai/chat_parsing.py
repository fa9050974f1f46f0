"""Chat outputs with tools and reasoning: the constraint a request's tools imply, and the split of
each choice's text into reasoning, content and tool calls (whole, or streamed as OpenAI deltas).

tool_choice:
- "none": tools are neither shown to the model nor parsed;
- "auto": the model decides; its text is parsed with the server's `--tool-call-parser`, and is
  plain content when the server has none (as SGLang);
- "required" / a named function: the output is constrained (SGLang's way) to a JSON array
  `[{"name": ..., "parameters": {...}}]` whose items follow the tools' parameter schemas, so the
  calls always parse; `parallel_tool_calls: false` allows exactly one item.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from engine.parsers.reasoning import REASONING_FORMATS, ReasoningParser, starts_in_reasoning
from engine.parsers.tool_calls import (
    JsonArrayParser,
    ToolCallDelta,
    ToolCallParser,
    ToolCallStream,
    create_tool_call_parser,
    new_tool_call_id,
)
from engine.entrypoints.openai.protocol import ChatCompletionRequest
from engine.entrypoints.openai.protocol_tools import DeltaToolCall, FunctionCall, Tool, ToolCall, ToolChoice
from engine.errors import EngineRequestError


def tool_call_schema(tools: List[Tool], tool_choice: Union[str, ToolChoice], parallel_tool_calls: bool) -> str:
    """The JSON schema of a forced tool choice: an array of {name, parameters} items."""
    chosen = tools
    if isinstance(tool_choice, ToolChoice):
        chosen = [t for t in tools if t.function.name == tool_choice.function.name]
    defs: Dict[str, Any] = {}
    items = []
    for tool in chosen:
        parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
        for name, definition in (parameters.pop("$defs", None) or {}).items():
            if name in defs and defs[name] != definition:
                raise EngineRequestError(f"The tools define $defs/{name} twice, differently; give it one schema.")
            defs[name] = definition
        items.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: Dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": items[0] if len(items) == 1 else {"anyOf": items}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return json.dumps(schema)


@dataclass(frozen=True)
class ChatParsing:
    """How one request's choices are parsed (built once per request)."""

    reasoning_parser: Optional[str] = None
    tool_parser: Optional[Callable[[], ToolCallParser]] = None
    stream_reasoning: bool = True
    # The answer starts inside its reasoning (answer_starts_in_reasoning, once the prompt is known).
    in_reasoning: bool = False

    @classmethod
    def for_request(cls, request: ChatCompletionRequest, tool_call_parser: Optional[str],
                    reasoning_parser: Optional[str]) -> Tuple["ChatParsing", Optional[str]]:
        """(parsing, json_schema constraint or None); raises EngineRequestError (400)."""
        choice = request.resolved_tool_choice()
        constraint: Optional[str] = None
        tool_parser: Optional[Callable[[], ToolCallParser]] = None
        if choice == "auto":
            # As SGLang: the text is parsed for calls only when the server has a parser; without one
            # the answer is plain content (agent clients send `tools` on every request).
            if tool_call_parser is not None:
                tool_parser = lambda: create_tool_call_parser(tool_call_parser)  # noqa: E731
        elif choice != "none":
            constraint = tool_call_schema(request.tools or [], choice, request.parallel_tool_calls)
            tool_parser = JsonArrayParser
        # A constrained answer is split too: its grammar applies only after the reasoning
        # (require_reasoning; constrained/reasoner_grammar.py), as SGLang's ReasonerGrammarBackend.
        reasoning = reasoning_parser if request.separate_reasoning else None
        return cls(reasoning, tool_parser, request.stream_reasoning), constraint


def answer_starts_in_reasoning(reasoning_parser: Optional[str], request: ChatCompletionRequest,
                               prompt_tail: str) -> bool:
    """SGLang's rule (reasoning_parser.starts_in_reasoning) for this request; `prompt_tail` is the
    end of the rendered prompt, where a thinking template leaves the opening tag. A continued
    assistant message is in its reasoning when it opened the tag and did not close it."""
    if reasoning_parser is None:
        return False
    fmt = REASONING_FORMATS[reasoning_parser]
    if request.continue_final_message:
        previous = request.messages[-1].text()
        if fmt.think_end in previous:
            return False
        if fmt.think_start in previous:
            return True
    return starts_in_reasoning(reasoning_parser, request.chat_template_kwargs,
                               prompt_tail.rstrip().endswith(fmt.think_start))


def tools_for_template(request: ChatCompletionRequest) -> Optional[List[Dict[str, Any]]]:
    """The tools as the chat template sees them (OpenAI's shape); none with tool_choice "none"."""
    if request.resolved_tool_choice() == "none" or not request.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in request.tools]


@dataclass
class ParsedChoice:
    reasoning: Optional[str]
    content: Optional[str]
    tool_calls: List[ToolCall] = field(default_factory=list)


def parse_choice(parsing: ChatParsing, text: str) -> ParsedChoice:
    """A whole choice: reasoning split off first, then tool calls out of the rest."""
    reasoning: Optional[str] = None
    content = text
    if parsing.reasoning_parser is not None:
        reasoning, content = ReasoningParser(parsing.reasoning_parser, parsing.in_reasoning).parse(text)
    calls: List[ToolCall] = []
    if parsing.tool_parser is not None:
        normal, items = parsing.tool_parser().parse(content)
        if items:
            content = normal
            calls = [ToolCall(id=new_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in items]
    # OpenAI's shape of an answer that is only tool calls: no content at all.
    return ParsedChoice(reasoning, None if calls and not content.strip() else content, calls)


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: List[DeltaToolCall] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.reasoning or self.content or self.tool_calls)


class ChoiceStreamParser:
    """One streamed choice: text deltas in, reasoning / content / tool-call deltas out."""

    def __init__(self, parsing: ChatParsing) -> None:
        self.reasoning = (ReasoningParser(parsing.reasoning_parser, parsing.in_reasoning)
                          if parsing.reasoning_parser else None)
        self.tools = ToolCallStream(parsing.tool_parser()) if parsing.tool_parser is not None else None
        self.stream_reasoning = parsing.stream_reasoning
        self.held_reasoning = ""

    def feed(self, delta: str, final: bool = False) -> ChoiceDelta:
        reasoning, content = "", delta
        if self.reasoning is not None:
            reasoning, content = self.reasoning.feed(delta, final)
        if not self.stream_reasoning:
            # Reasoning in one piece, when the answer starts (or at the end).
            self.held_reasoning += reasoning
            reasoning = ""
            if self.held_reasoning and (content or final):
                reasoning, self.held_reasoning = self.held_reasoning, ""
        out = ChoiceDelta(reasoning=reasoning)
        if self.tools is None:
            out.content = content
            return out
        out.content, calls = self.tools.feed(content, final)
        out.tool_calls = [_delta_tool_call(c) for c in calls]
        return out

    @property
    def has_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.has_calls


def _delta_tool_call(call: ToolCallDelta) -> DeltaToolCall:
    if call.id is not None:
        return DeltaToolCall(index=call.index, id=call.id, type="function",
                             function=FunctionCall(name=call.name, arguments=call.arguments))
    return DeltaToolCall(index=call.index, function=FunctionCall(arguments=call.arguments))
