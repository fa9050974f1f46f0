"""stop_regex: compiling the patterns and bounding how much output text a match can span.

A request ends when a stop regex matches the tail of its output text (SGLang's `stop_regex`).
The scheduler decodes only a window of the last tokens per step, so it needs the longest text a
pattern can match, counted as tokens: one character can take a token of its own, so the bound in
characters is a bound in tokens. A pattern with an unbounded repeat (`a+`, `.*`) gets UNBOUNDED,
i.e. the whole output is searched (SGLang's get_max_seq_length does the same).

The search runs on the scheduler thread at every step, so a pattern that backtracks
catastrophically (`(a+)+$`) would stall every request of the server: it runs under a time budget
(the `regex` module's timeout, same syntax as `re` for what `re` accepts), and a search over budget
ends its request instead.
"""

from __future__ import annotations

import functools
import re
from typing import Any, List, Optional

import regex

try:  # Python 3.11+
    import re._parser as _sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

UNBOUNDED = 1 << 30
MAX_STOP_REGEX = 32
MAX_STOP_REGEX_LEN = 1024
# The time one stop_regex search of one request may take at one step.
SEARCH_BUDGET_S = 0.05


class StopRegexTimeout(Exception):
    """A stop_regex search ran over SEARCH_BUDGET_S."""


def compile_stop_regex(patterns: List[str]) -> List["re.Pattern[str]"]:
    """Compile every pattern; ValueError naming the first bad one."""
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(re.compile(pattern))
            _searcher(pattern)  # the engine that runs it must accept it too
        except (re.error, regex.error) as e:
            raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
    return compiled


@functools.lru_cache(maxsize=1024)
def _searcher(pattern: str) -> "regex.Pattern[str]":
    return regex.compile(pattern)


def search(pattern: str, text: str) -> Optional[bool]:
    """Whether `pattern` matches somewhere in `text`; StopRegexTimeout past SEARCH_BUDGET_S."""
    try:
        return _searcher(pattern).search(text, timeout=SEARCH_BUDGET_S) is not None
    except TimeoutError:
        raise StopRegexTimeout(f"stop_regex {pattern!r} took over {SEARCH_BUDGET_S * 1000:g} ms to search "
                               f"{len(text)} characters of output (catastrophic backtracking?)") from None


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
