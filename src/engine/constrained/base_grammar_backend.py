"""Grammar backends for constrained decoding: one interface, compiled grammars cached by constraint.

A request's constraint is a `GrammarKey`, (kind, text) with kind in json_schema | regex | ebnf |
structural_tag.
The backend compiles it into a template `BaseGrammarObject` on a thread pool (compilation can take
from microseconds to seconds, and the scheduling thread must not wait for it); the template is
cached under its key, and every request gets its own matcher with `copy()`. A constraint that fails
to compile is cached too, as its error message, so a client that resends it is answered at once.
The cache is an LRU bounded in entries and bytes (`GrammarCache`): every client can send new
constraints, so a plain dict would grow without bound.

The vocabulary mask is the format xgrammar and SGLang use: an int32 tensor [batch, ceil(vocab/32)]
where bit j of word w allows token 32 * w + j. `constrained/vocab_mask.py` builds and applies it.
"""

from __future__ import annotations

import logging
import re
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

GrammarKey = Tuple[str, str]

# Bounds of the compiled-grammar cache (docs/security.md): the least recently used entries go first.
GRAMMAR_CACHE_MAX_ENTRIES = 1024
GRAMMAR_CACHE_MAX_BYTES = 256 * 1024 * 1024


class GrammarCompileError(ValueError):
    """A constraint that cannot be compiled; the message says what is wrong with it."""


class BaseGrammarObject(ABC):
    """One request's position in its grammar (a matcher over token ids).

    `num_accepted` counts the tokens accepted since the start, so the scheduler can check that the
    matcher state and the request's output ids agree (after a retraction) and repair it.
    """

    # Whether `rollback` undoes a few tokens cheaply: a speculative verify step walks each draft
    # and goes back; a grammar that cannot would replay the whole output at every step.
    supports_rollback: ClassVar[bool] = True

    def __init__(self) -> None:
        self.num_accepted = 0

    @abstractmethod
    def _accept(self, token: int) -> bool:
        """Advance by `token`; False (state unchanged) if the grammar does not allow it."""

    @abstractmethod
    def _rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` accepted tokens; False if the backend cannot go that far back."""

    @abstractmethod
    def _reset(self) -> None:
        """Back to the start of the grammar."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""

    @abstractmethod
    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into row `row` of an int32 bitmask."""

    @abstractmethod
    def copy(self) -> "BaseGrammarObject":
        """A fresh matcher at the start of the same compiled grammar."""

    def memory_size_bytes(self) -> int:
        """The memory the compiled grammar holds (what a cached template costs); 0 if unknown."""
        return 0

    def accept_token(self, token: int) -> bool:
        if not self._accept(token):
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` accepted tokens (speculative decoding walks its drafts and goes
        back); False, state unchanged, if the backend cannot go that far back."""
        if num_tokens > self.num_accepted or not self._rollback(num_tokens):
            return False
        self.num_accepted -= num_tokens
        return True

    def sync_with(self, output_ids: Sequence[int]) -> bool:
        """Bring the matcher to the state after `output_ids` (a retraction may have dropped
        tokens it had accepted): roll back, or rebuild from the start. False if the output ids
        themselves do not match the grammar."""
        n = len(output_ids)
        if self.num_accepted > n:
            if self._rollback(self.num_accepted - n):
                self.num_accepted = n
            else:
                self._reset()
                self.num_accepted = 0
        for token in output_ids[self.num_accepted:]:
            if not self.accept_token(token):
                return False
        return True


@dataclass
class CacheEntry:
    """A compiled constraint: its template matcher, or why it could not be compiled."""

    grammar: Optional[BaseGrammarObject] = None
    error: Optional[str] = None

    def size_bytes(self, key: GrammarKey) -> int:
        """What keeping this entry under `key` costs: the key's text, the grammar or the message."""
        held = self.grammar.memory_size_bytes() if self.grammar is not None else len(self.error or "")
        return len(key[0]) + len(key[1]) + held


class GrammarCache:
    """Compiled constraints by key, least recently used first out, within an entry and a byte bound."""

    def __init__(self, max_entries: int = GRAMMAR_CACHE_MAX_ENTRIES,
                 max_bytes: int = GRAMMAR_CACHE_MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[GrammarKey, Tuple[CacheEntry, int]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, key: GrammarKey) -> Optional[CacheEntry]:
        item = self._entries.get(key)
        if item is None:
            return None
        self._entries.move_to_end(key)
        return item[0]

    def put(self, key: GrammarKey, entry: CacheEntry) -> None:
        """Keep `entry`, dropping the least recently used ones over the bounds (an entry larger than
        the byte bound on its own is not kept: its requests have it from their compilation)."""
        self._drop(key)
        size = entry.size_bytes(key)
        if size > self.max_bytes:
            return
        self._entries[key] = (entry, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _drop(self, key: GrammarKey) -> None:
        item = self._entries.pop(key, None)
        if item is not None:
            self._bytes -= item[1]


class BaseGrammarBackend(ABC):
    """Compiles constraints off the scheduling thread and caches them by key.

    Only the scheduling thread calls these methods; the thread pool runs `_compile` only.
    """

    def __init__(self, num_threads: int = 2) -> None:
        self.executor = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="grammar-compile")
        self.cache = GrammarCache()
        # Compilations in flight: requests with the same constraint share one.
        self.pending: Dict[GrammarKey, Future] = {}

    def get_cached_or_future_value(self, key: GrammarKey) -> Tuple[Optional[CacheEntry], Optional[Future]]:
        """(entry, None) when the key was compiled before, else (None, future of its entry)."""
        self._collect_finished()
        entry = self.cache.get(key)
        if entry is not None:
            return entry, None
        future = self.pending.get(key)
        if future is None:
            future = self.executor.submit(self._compile, key)
            self.pending[key] = future
        return None, future

    def set_cache(self, key: GrammarKey, entry: CacheEntry) -> None:
        self.cache.put(key, entry)
        self.pending.pop(key, None)

    def _collect_finished(self) -> None:
        """Cache the compilations that finished after all their requests were aborted (nothing else
        would take them out of `pending`, which would then grow with every such constraint)."""
        for key in [key for key, future in self.pending.items() if future.done()]:
            future = self.pending.pop(key)
            if not future.cancelled():
                self.set_cache(key, future.result())

    def _compile(self, key: GrammarKey) -> CacheEntry:
        kind, text = key
        try:
            if kind == "json_schema":
                grammar = self.dispatch_json(text)
            elif kind == "regex":
                grammar = self.dispatch_regex(text)
            elif kind == "ebnf":
                grammar = self.dispatch_ebnf(text)
            elif kind == "structural_tag":
                grammar = self.dispatch_structural_tag(text)
            else:
                raise GrammarCompileError(f"Unknown constraint kind {kind!r}")
        except GrammarCompileError as e:
            return CacheEntry(error=str(e))
        except Exception as e:  # noqa: BLE001 - any backend failure is this request's error
            logger.exception("Grammar compilation failed for %s", kind)
            return CacheEntry(error=f"Invalid {kind}: {e}")
        return CacheEntry(grammar=grammar)

    @abstractmethod
    def dispatch_json(self, schema: str) -> BaseGrammarObject:
        """Compile a JSON schema (JSON text); raise GrammarCompileError when it is invalid."""

    @abstractmethod
    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        """Compile a regular expression; raise GrammarCompileError when it is invalid."""

    @abstractmethod
    def dispatch_ebnf(self, ebnf: str) -> BaseGrammarObject:
        """Compile an EBNF grammar (GBNF dialect, root rule `root`); raise GrammarCompileError."""

    def dispatch_structural_tag(self, structural_tag: str) -> BaseGrammarObject:
        """Compile SGLang's structural tag (JSON text); raise GrammarCompileError."""
        raise GrammarCompileError("Invalid structural_tag: this grammar backend does not support structural tags.")

    def reset(self) -> None:
        """Forget every compiled grammar (flush_cache). In-flight compilations finish unseen."""
        self.cache.clear()
        self.pending.clear()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


# xgrammar's C++ errors start with a timestamp and a source location; the rest is the message.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false:\s*")


def clean_backend_error(error: Exception) -> str:
    """The user-facing part of a backend error message (one line)."""
    text = str(error).strip()
    text = _CPP_PREFIX.sub("", text)
    text = _CHECK_PREFIX.sub("", text)
    return " ".join(text.split())
