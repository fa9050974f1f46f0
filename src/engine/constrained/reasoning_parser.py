"""Reasoning parsers (`--reasoning-parser`): split `<think>...</think>` from the answer.

- `deepseek-r1`: the output starts in reasoning (the chat template opens `<think>` in the prompt);
  an optional `<think>` is dropped, and everything up to `</think>` is reasoning, even when the end
  never comes (the budget ran out while thinking).
- `qwen3`: reasoning only when the output opens with `<think>`; otherwise all of it is content.

The reasoning is stripped of surrounding whitespace and the content of the whitespace that follows
`</think>`. `parse` is `feed(text, final=True)` on a fresh parser, so the streamed pieces of a
text always concatenate to its whole parse.
"""

from __future__ import annotations

from typing import Optional, Tuple

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = {"deepseek-r1": True, "qwen3": False}  # name -> starts in reasoning

_START, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    def __init__(self, name: str) -> None:
        if name not in REASONING_PARSERS:
            raise ValueError(f"Unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
        self.name = name
        self.force_reasoning = REASONING_PARSERS[name]
        self.state = _START
        self.buffer = ""
        self.saw_reasoning = False
        self.reasoning_started = False
        self.strip_content_start = False

    def parse(self, text: str) -> Tuple[Optional[str], str]:
        """(reasoning or None when the output has none, content) of a whole output."""
        fresh = ReasoningParser(self.name)
        reasoning, content = fresh.feed(text, final=True)
        return (reasoning if fresh.saw_reasoning else None), content

    def feed(self, delta: str, final: bool = False) -> Tuple[str, str]:
        """(new reasoning text, new content text) after `delta`; `final` flushes what was held."""
        self.buffer += delta
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self.state == _START:
                head = self.buffer.lstrip()
                if head.startswith(THINK_START):
                    self.buffer = head[len(THINK_START):]
                    self._enter_reasoning()
                elif THINK_START.startswith(head) and not final:
                    break  # may still become <think>: wait
                elif self.force_reasoning:
                    self._enter_reasoning()
                else:
                    self.state = _CONTENT
            elif self.state == _REASONING:
                end = self.buffer.find(THINK_END)
                if end >= 0:
                    reasoning.append(self._reasoning_piece(self.buffer[:end].rstrip()))
                    self.buffer = self.buffer[end + len(THINK_END):]
                    self.state, self.strip_content_start = _CONTENT, True
                    continue
                if final:
                    reasoning.append(self._reasoning_piece(self.buffer.rstrip()))
                    self.buffer = ""
                    break
                # Hold back what may be the start of </think>, and trailing whitespace (it is
                # dropped if </think> follows).
                keep = len(self.buffer) - _partial_suffix(self.buffer, THINK_END)
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

    def _enter_reasoning(self) -> None:
        self.state = _REASONING
        self.saw_reasoning = True

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
