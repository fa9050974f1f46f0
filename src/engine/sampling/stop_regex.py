"""stop_regex: compiling the patterns and bounding how much output text a match can span.

A request ends when a stop regex matches the tail of its output text (SGLang's `stop_regex`).
The scheduler decodes only a window of the last tokens per step, so it needs the longest text a
pattern can match, counted as tokens: one character can take a token of its own, so the bound in
characters is a bound in tokens. A pattern with an unbounded repeat (`a+`, `.*`) gets UNBOUNDED,
i.e. the whole output is searched (SGLang's get_max_seq_length does the same).
"""

from __future__ import annotations

import re
from typing import Any, List

try:  # Python 3.11+
    import re._parser as _sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

UNBOUNDED = 1 << 30
MAX_STOP_REGEX = 32
MAX_STOP_REGEX_LEN = 1024


def compile_stop_regex(patterns: List[str]) -> List["re.Pattern[str]"]:
    """Compile every pattern; ValueError naming the first bad one."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    return compiled


def max_match_len(pattern: str) -> int:
    """An upper bound of the length of any text `pattern` matches (UNBOUNDED for `*`, `+`, ...)."""
    return min(_max_len(_sre_parse.parse(pattern)), UNBOUNDED)


def _max_len(items: Any) -> int:
    total = 0
    for op, arg in items:
        total += _item_len(op, arg)
        if total >= UNBOUNDED:
            return UNBOUNDED
    return total


def _item_len(op: Any, arg: Any) -> int:
    name = str(op)
    if name in ("LITERAL", "NOT_LITERAL", "ANY", "IN", "CATEGORY"):
        return 1
    if name in ("AT", "ASSERT", "ASSERT_NOT"):
        return 0  # anchors and lookarounds consume nothing
    if name == "SUBPATTERN":
        return _max_len(arg[-1])
    if name == "BRANCH":
        return max((_max_len(branch) for branch in arg[1]), default=0)
    if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
        low, high, body = arg
        if high == _sre_parse.MAXREPEAT:
            return UNBOUNDED
        return high * _max_len(body)
    if name == "ATOMIC_GROUP":
        return _max_len(arg)
    if name == "GROUPREF_EXISTS":
        _, yes, no = arg
        return max(_max_len(yes), _max_len(no) if no is not None else 0)
    # Back-references and anything unknown: no bound we can trust.
    return UNBOUNDED
