"""stop_regex: checking and compiling the patterns, and bounding how much output text a match can span.

A request ends when a stop regex matches the tail of its output text (SGLang's `stop_regex`).
The scheduler decodes only a window of the last tokens per step, so it needs the longest text a
pattern can match, counted as tokens: one character can take a token of its own, so the bound in
characters is a bound in tokens. A pattern with an unbounded repeat (`a+`, `.*`), or one whose
matches may be longer than STOP_REGEX_MAX_WINDOW, is searched in the last STOP_REGEX_MAX_WINDOW
tokens (SGLang searches the whole output, so its per-token cost grows with the output).

Costs a pattern could impose, and their bounds (docs/security.md):
- Compiling: the `regex` module unrolls counted repeats, so `(((a{100}){100}){100})` (22 bytes)
  compiles to a million nodes (~280 MB, a second). Before anything is compiled, the parse tree is
  walked and the nodes the pattern can unroll to (each bounded repeat counted at its upper bound)
  are summed over the request's patterns: over MAX_STOP_REGEX_SIZE the request is refused. The
  tree comes from Python's own parser (the syntax SGLang's `re` accepts); a pattern it cannot
  parse is refused, so none of `regex`'s extensions reaches the compiler unchecked. Compiled
  patterns belong to their request, never to a process-wide cache (`cache_pattern=False`).
- Searching: it runs on the scheduler thread at every step, so a pattern that backtracks
  catastrophically (`(a+)+$`) would stall every request of the server: it runs under a time budget
  (the `regex` module's timeout), and a search over budget ends its request instead.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple, TypeAlias

import regex

try:  # Python 3.11+
    import re._parser as _sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre_parse  # type: ignore[no-redef]

# A compiled stop regex (the `regex` module's, for its search timeout).
CompiledStopRegex: TypeAlias = "regex.Pattern[str]"

UNBOUNDED = 1 << 30
MAX_STOP_REGEX = 32
MAX_STOP_REGEX_LEN = 1024
# The nodes all stop_regex patterns of one request may unroll to when compiled: ~250 bytes and
# ~1-5 us of compile time each (a 1,024-character literal costs ~1,000).
MAX_STOP_REGEX_SIZE = 2048
# Output tokens a stop_regex is searched in at most (decoded at every step: ~0.5 ms per 1,024 tokens).
STOP_REGEX_MAX_WINDOW = 1024
# The time one stop_regex search of one request may take at one step.
SEARCH_BUDGET_S = 0.05

# Parse-tree items that match one character (or none) and contain no sub-pattern.
_ATOMS = frozenset({"LITERAL", "NOT_LITERAL", "ANY", "AT", "GROUPREF", "CATEGORY"})
_REPEATS = frozenset({"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"})


class StopRegexTimeout(Exception):
    """A stop_regex search ran over SEARCH_BUDGET_S."""


class StopRegexCompiler:
    """Compiles a request's patterns, remembering only the last request's (one entry).

    The n samples of a request reach the scheduler one after another with the same patterns:
    they share one compilation, and nothing a client sent outlives the next request's patterns.
    """

    def __init__(self) -> None:
        self._last: Tuple[Tuple[str, ...], List[CompiledStopRegex]] = ((), [])

    def compile(self, patterns: Sequence[str]) -> List[CompiledStopRegex]:
        key = tuple(patterns)
        if key != self._last[0]:
            self._last = (key, compile_stop_regex(key))
        return self._last[1]


def compile_stop_regex(patterns: Sequence[str]) -> List[CompiledStopRegex]:
    """Check every pattern and compile it (outside any cache); ValueError naming the first bad one."""
    total = 0
    for pattern in patterns:
        total += _compiled_size(pattern, MAX_STOP_REGEX_SIZE - total)
        if total > MAX_STOP_REGEX_SIZE:
            raise ValueError(
                f"stop_regex {pattern!r} is too complex: the request's patterns would compile to more than "
                f"{MAX_STOP_REGEX_SIZE} nodes (each counted repeat multiplies its body by its upper bound).")
    compiled = []
    for pattern in patterns:
        try:
            compiled.append(regex.compile(pattern, cache_pattern=False))
        except regex.error as e:
            raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None
        except RecursionError:
            raise ValueError(f"stop_regex {pattern!r} nests its groups too deeply.") from None
    return compiled


def search(pattern: CompiledStopRegex, text: str) -> bool:
    """Whether `pattern` matches somewhere in `text`; StopRegexTimeout past SEARCH_BUDGET_S."""
    try:
        return pattern.search(text, timeout=SEARCH_BUDGET_S) is not None
    except TimeoutError:
        raise StopRegexTimeout(f"stop_regex {pattern.pattern!r} took over {SEARCH_BUDGET_S * 1000:g} ms to "
                               f"search {len(text)} characters of output (catastrophic backtracking?)") from None


def _parse(pattern: str) -> Any:
    try:
        return _sre_parse.parse(pattern)
    except (_sre_parse.error, RecursionError, OverflowError) as e:
        raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None


def _compiled_size(pattern: str, budget: int) -> int:
    """The nodes `pattern` can unroll to, or a number over `budget` once it is known to exceed it."""
    tree = _parse(pattern)
    try:
        return _size(tree, budget, pattern)
    except RecursionError:
        raise ValueError(f"stop_regex {pattern!r} nests its groups too deeply.") from None


def _size(items: Any, budget: int, pattern: str) -> int:
    total = 0
    for op, arg in items:
        total += _item_size(str(op), arg, budget - total, pattern)
        if total > budget:
            return total
    return total


def _item_size(name: str, arg: Any, budget: int, pattern: str) -> int:
    if name in _ATOMS:
        return 1
    if name == "IN":
        return max(len(arg), 1)  # a set is one node with one member per range or class
    if name == "SUBPATTERN":
        return 1 + _size(arg[-1], budget, pattern)
    if name == "BRANCH":
        total = 1
        for branch in arg[1]:
            total += _size(branch, budget - total, pattern)
            if total > budget:
                break
        return total
    if name in _REPEATS:
        low, high, body = arg
        # The compiler unrolls up to the upper bound (the lower one when there is none).
        count = max(low if high == _sre_parse.MAXREPEAT else high, 1)
        body_size = _size(body, budget, pattern)
        return count * body_size
    if name in ("ASSERT", "ASSERT_NOT"):
        return 1 + _size(arg[1], budget, pattern)
    if name == "ATOMIC_GROUP":
        return 1 + _size(arg, budget, pattern)
    if name == "GROUPREF_EXISTS":
        _, yes, no = arg
        size = 1 + _size(yes, budget, pattern)
        return size + (_size(no, budget - size, pattern) if no is not None else 0)
    raise ValueError(f"stop_regex {pattern!r} uses a construct ({name}) whose cost is not bounded here.")


def max_match_len(pattern: str) -> int:
    """An upper bound of the length of any text `pattern` matches (UNBOUNDED for `*`, `+`, ...)."""
    try:
        return min(_max_len(_sre_parse.parse(pattern)), UNBOUNDED)
    except RecursionError:  # compile_stop_regex refuses such nesting; nothing to bound it by here
        return UNBOUNDED


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
