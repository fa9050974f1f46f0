"""Reasoning parsers (`--reasoning-parser`): split `<think>...</think>` from the answer.

Each of SGLang's parser names that uses a plain pair of think tags is a `ReasoningFormat`: the
tags, whether an answer starts inside its reasoning, and the tool-call tag that ends reasoning
without a closing tag (Qwen3.5 and GLM open `<tool_call>` straight from their thinking).

Whether an answer starts inside its reasoning is SGLang's rule (serving_chat.py's
`_get_reasoning_from_request` and the template's force-reasoning pattern): true when the chat
template opened the think tag in the prompt (Qwen3-Thinking, DeepSeek-R1), for the parsers whose
models always think, and, for hybrid models, according to the chat template switch the request
sets (`chat_template_kwargs.enable_thinking`, `thinking`): on unless switched off for Qwen3 / GLM /
Kimi-K2, off unless switched on for DeepSeek-V3 / MiMo. Started in reasoning, everything up to
the closing tag is reasoning, even when the tag never comes (the budget ran out while thinking);
otherwise only an answer that opens with the think tag has reasoning.

The reasoning is stripped of surrounding whitespace and the content of the whitespace that follows
the closing tag. `parse` is `feed(text, final=True)` on a fresh parser, so the streamed pieces of a
text always concatenate to its whole parse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

THINK_START = "<think>"
THINK_END = "</think>"
_TOOL_CALL = "<tool_call>"


@dataclass(frozen=True)
class ReasoningFormat:
    think_start: str = THINK_START
    think_end: str = THINK_END
    # "always": the answer starts in reasoning; "never": only an opening tag starts it; "switch":
    # as the request's chat_template_kwargs[switch] says, `switch_default` when it is not set.
    starts: str = "switch"
    switch: str = "enable_thinking"
    switch_default: bool = True
    # A tag that ends the reasoning when it comes before the closing one (it stays in the content,
    # where the tool-call parser finds it).
    tool_start: Optional[str] = None
    # MiniMax's "append-think": no split at all; the answer gets the opening tag the prompt ate.
    split: bool = True


_ALWAYS = ReasoningFormat(starts="always")
_QWEN3 = ReasoningFormat(tool_start=_TOOL_CALL)

# SGLang's --reasoning-parser names (python/sglang/srt/parser/reasoning_parser.py) with plain think
# tags; the models each one serves are in docs/api.md.
REASONING_FORMATS: Mapping[str, ReasoningFormat] = {
    "deepseek-r1": _ALWAYS,
    "step3": _ALWAYS,
    "step3p5": _ALWAYS,
    "qwen3": _QWEN3,
    "interns1": _QWEN3,
    "glm45": _QWEN3,
    "nemotron_3": _QWEN3,
    "qwen3-thinking": ReasoningFormat(starts="always", tool_start=_TOOL_CALL),
    "minimax": ReasoningFormat(starts="always", tool_start=_TOOL_CALL),
    "minimax-append-think": ReasoningFormat(starts="always", split=False),
    "deepseek-v3": ReasoningFormat(switch="thinking", switch_default=False, tool_start=_TOOL_CALL),
    "mimo": ReasoningFormat(switch_default=False, tool_start=_TOOL_CALL),
    "poolside_v1": ReasoningFormat(switch_default=False, tool_start=_TOOL_CALL),
    "kimi_k2": ReasoningFormat(switch="thinking", tool_start="<|tool_calls_section_begin|>"),
    "kimi": ReasoningFormat(think_start="◁think▷", think_end="◁/think▷", starts="never"),
}
REASONING_PARSER_NAMES: Tuple[str, ...] = tuple(REASONING_FORMATS)

# SGLang's other --reasoning-parser names: formats that need more than a pair of tags. A server
# started with one of them is refused at start-up with this reason (never a silently wrong split).
UNSUPPORTED_REASONING_PARSERS: Mapping[str, str] = {
    "gpt-oss": "the Harmony channel format",
    "mistral": "[THINK] special tokens switched by reasoning_effort",
    "gemma4": "channel special tokens with a label",
    "minimax-m3": "<mm:think> with stray closing tags in multi-turn chats",
    "hunyuan": "tags that depend on the tokenizer, switched by reasoning_effort",
    "kimi_k3": "the XTML channel markers",
    "inkling": "typed content blocks",
    "cohere_command4": "the START/END_THINKING and text/action block markers",
    "apertus2509": "inner prefix/suffix markers with embedded tool calls",
    "deepseek-v4": "the DeepSeek-V4 encoding's markers",
    "telechat4": "reasoning turned into content when the answer is empty",
}


def reasoning_parser_error(name: str) -> Optional[str]:
    """Why `--reasoning-parser name` cannot be served, or None when it can."""
    if name in REASONING_FORMATS:
        return None
    supported = ", ".join(REASONING_PARSER_NAMES)
    reason = UNSUPPORTED_REASONING_PARSERS.get(name)
    if reason is not None:
        return f"--reasoning-parser {name} (an SGLang parser for {reason}) is not implemented; supported: {supported}"
    return f"--reasoning-parser must be one of {supported}, got {name!r}"


def starts_in_reasoning(name: str, template_kwargs: Optional[Mapping[str, Any]] = None,
                        prompt_opens_think: bool = False) -> bool:
    """Whether an answer of the `name` format begins inside its reasoning (SGLang's rule, above):
    `template_kwargs` are the request's chat_template_kwargs, `prompt_opens_think` says the
    rendered prompt ends with the opening tag."""
    fmt = REASONING_FORMATS[name]
    if fmt.starts == "never":
        return False
    if fmt.starts == "always" or prompt_opens_think:
        return True
    value = (template_kwargs or {}).get(fmt.switch)
    return value is not False if fmt.switch_default else value is True


_START, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    """One answer's split. `in_reasoning`: the answer starts inside its reasoning (default: the
    format's answer to a request that sets no template switch); only formats with a switch take it."""

    def __init__(self, name: str, in_reasoning: Optional[bool] = None) -> None:
        error = reasoning_parser_error(name)
        if error is not None:
            raise ValueError(error)
        self.name = name
        self.format = REASONING_FORMATS[name]
        if in_reasoning is None or self.format.starts != "switch":
            # The formats of models that always (or never) think decide alone, as in SGLang.
            in_reasoning = starts_in_reasoning(name)
        self.force_reasoning = in_reasoning
        self.state = _START if self.format.split else _CONTENT
        self.buffer = self.format.think_start if not self.format.split else ""
        self.reasoning_started = False
        self.strip_content_start = False

    def parse(self, text: str) -> Tuple[Optional[str], str]:
        """(reasoning or None when the output has none, content) of a whole output; empty
        reasoning is none (as SGLang answers it)."""
        reasoning, content = ReasoningParser(self.name, self.force_reasoning).feed(text, final=True)
        return reasoning or None, content

    def feed(self, delta: str, final: bool = False) -> Tuple[str, str]:
        """(new reasoning text, new content text) after `delta`; `final` flushes what was held."""
        self.buffer += delta
        reasoning: list[str] = []
        content: list[str] = []
        start = self.format.think_start
        while True:
            if self.state == _START:
                head = self.buffer.lstrip()
                if head.startswith(start):
                    self.buffer = head[len(start):]
                    self._enter_reasoning()
                elif start.startswith(head) and not final:
                    break  # may still become the opening tag: wait
                elif self.force_reasoning:
                    self._enter_reasoning()
                else:
                    self.state = _CONTENT
            elif self.state == _REASONING:
                end, after = self._reasoning_end()
                if end >= 0:
                    reasoning.append(self._reasoning_piece(self.buffer[:end].rstrip()))
                    self.buffer = self.buffer[after:]
                    # Whitespace after a closing tag is dropped; a tool call is kept whole.
                    self.state, self.strip_content_start = _CONTENT, after > end
                    continue
                if final:
                    reasoning.append(self._reasoning_piece(self.buffer.rstrip()))
                    self.buffer = ""
                    break
                # Hold back what may be the start of a closing tag, and trailing whitespace (it
                # is dropped if the tag follows).
                keep = len(self.buffer) - self._partial_marker_len()
                keep = len(self.buffer[:keep].rstrip())
                reasoning.append(self._reasoning_piece(self.buffer[:keep]))
                self.buffer = self.buffer[keep:]
                break
            else:
                piece, self.buffer = self.buffer, ""
                if self.strip_content_start:
                    piece = piece.lstrip()
                    self.strip_content_start = not piece
                content.append(piece)
                break
        return "".join(reasoning), "".join(content)

    def _reasoning_end(self) -> Tuple[int, int]:
        """(where the reasoning ends in the buffer, where the content starts), or (-1, -1)."""
        end = self.buffer.find(self.format.think_end)
        tool = self.format.tool_start
        tool_at = self.buffer.find(tool) if tool is not None else -1
        if tool_at >= 0 and (end < 0 or tool_at < end):
            return tool_at, tool_at
        if end >= 0:
            return end, end + len(self.format.think_end)
        return -1, -1

    def _partial_marker_len(self) -> int:
        markers = [self.format.think_end] + ([self.format.tool_start] if self.format.tool_start else [])
        return max(_partial_suffix(self.buffer, marker) for marker in markers)

    def _enter_reasoning(self) -> None:
        self.state = _REASONING

    def _reasoning_piece(self, piece: str) -> str:
        if not self.reasoning_started:
            piece = piece.lstrip()
            self.reasoning_started = bool(piece)
        return piece


def _partial_suffix(text: str, marker: str) -> int:
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
