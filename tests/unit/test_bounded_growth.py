"""Issue 34, item 6: what grows with what clients send is bounded: the compiled-grammar cache (every
client can send new constraints) and the scheduler's waiting queue (--max-queued-requests).

A fake backend compiles instantly; the cache must stay within its entry and byte bounds, keep what
was used recently, and take in the compilations whose requests were all aborted.
"""

from __future__ import annotations

import threading

import pytest

from engine.constrained.base_grammar_backend import (
    GRAMMAR_CACHE_MAX_ENTRIES,
    BaseGrammarBackend,
    BaseGrammarObject,
    CacheEntry,
    GrammarCache,
    GrammarCompileError,
)
from engine.constrained.grammar_manager import GrammarManager
from engine.server_args import DEFAULT_MAX_QUEUED_REQUESTS, ServerArgs
from sched_utils import Harness
from test_grammar_manager import FakeGrammar, FakeReq


class SizedGrammar(FakeGrammar):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def memory_size_bytes(self) -> int:
        return self.size


class InstantBackend(BaseGrammarBackend):
    """A regex "<size>:<anything>" compiles to a grammar of that many bytes; "bad..." fails; a
    regex starting with "gated" waits for `gate`."""

    def __init__(self) -> None:
        super().__init__(num_threads=2)
        self.gate = threading.Event()

    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        if regex.startswith("bad"):
            raise GrammarCompileError(f"Invalid regex: {regex}")
        if regex.startswith("gated"):
            assert self.gate.wait(timeout=30)
        return SizedGrammar(int(regex.split(":")[0]) if ":" in regex else 10)

    dispatch_json = dispatch_ebnf = dispatch_regex


def _admit_until_cached(manager: GrammarManager, req: FakeReq) -> None:
    queued, error = manager.process_req_with_grammar(req)
    assert error is None
    if queued:
        manager.grammar_queue[-1].future.result(timeout=30)
        ready, refused = manager.get_ready_grammar_requests()
        assert ready == [req] and refused == []


def test_many_distinct_constraints_keep_the_cache_within_its_entry_bound():
    backend = InstantBackend()
    manager = GrammarManager(lambda: (backend, None))
    for i in range(GRAMMAR_CACHE_MAX_ENTRIES + 300):
        _admit_until_cached(manager, FakeReq(f"r{i}", f"10:{i}"))
    assert backend.cache is not None and len(backend.cache) == GRAMMAR_CACHE_MAX_ENTRIES
    # The oldest went first; the newest are answered from the cache at once.
    assert backend.cache.get(("regex", "10:0")) is None
    assert manager.process_req_with_grammar(FakeReq("again", f"10:{GRAMMAR_CACHE_MAX_ENTRIES + 299}")) == \
        (False, None)


def test_failed_constraints_count_too():
    backend = InstantBackend()
    manager = GrammarManager(lambda: (backend, None))
    for i in range(GRAMMAR_CACHE_MAX_ENTRIES + 50):
        req = FakeReq(f"r{i}", f"bad {i}")
        queued, _ = manager.process_req_with_grammar(req)
        if queued:
            manager.grammar_queue[-1].future.result(timeout=30)
            ready, refused = manager.get_ready_grammar_requests()
            assert refused and refused[0][1] == f"Invalid regex: bad {i}"
    assert len(backend.cache) == GRAMMAR_CACHE_MAX_ENTRIES


def test_the_byte_bound_drops_the_least_recently_used():
    cache = GrammarCache(max_entries=100, max_bytes=1000)
    for name in ("a", "b", "c"):
        cache.put(("regex", name), CacheEntry(grammar=SizedGrammar(300)))
    assert cache.get(("regex", "a")) is not None  # "a" is now the most recently used
    cache.put(("regex", "d"), CacheEntry(grammar=SizedGrammar(300)))
    assert cache.get(("regex", "b")) is None
    assert all(cache.get(("regex", k)) is not None for k in "acd")
    assert cache.size_bytes <= 1000 and len(cache) == 3
    cache.put(("regex", "huge"), CacheEntry(grammar=SizedGrammar(5000)))  # never kept
    assert cache.get(("regex", "huge")) is None and len(cache) == 3
    # The key's text counts: a long constraint costs its length even when it failed to compile.
    cache.put(("regex", "x" * 900), CacheEntry(error="Invalid regex"))
    assert cache.size_bytes <= 1000


def test_a_compilation_whose_requests_were_aborted_is_cached_and_leaves_pending():
    backend = InstantBackend()
    manager = GrammarManager(lambda: (backend, None))
    req = FakeReq("gone", "gated:1")
    assert manager.process_req_with_grammar(req) == (True, None)
    future = manager.grammar_queue[0].future
    assert manager.abort_requests(lambda r: r is req) == [req]
    backend.gate.set()
    future.result(timeout=30)
    # The next constrained request collects it: pending does not keep it, the cache does.
    _admit_until_cached(manager, FakeReq("next", "10:other"))
    assert backend.pending == {}
    assert backend.cache.get(("regex", "gated:1")) is not None


def test_xgrammar_keeps_no_unbounded_cache_of_its_own():
    pytest.importorskip("xgrammar")
    from engine.builtin_model import builtin_model_dir
    from engine.constrained.xgrammar_backend import XGrammarGrammarBackend
    from engine.utils.tokenizer_utils import load_tokenizer

    tokenizer = load_tokenizer(str(builtin_model_dir()), False)
    backend = XGrammarGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], num_threads=1)
    try:
        for i in range(3):
            grammar = backend.dispatch_json(f'{{"type": "object", "properties": {{"k{i}": {{"type": "integer"}}}}}}')
            assert grammar.memory_size_bytes() > 0
        assert backend.compiler.get_cache_size_bytes() == 0
    finally:
        backend.shutdown()


def test_the_waiting_queue_is_bounded_by_default():
    assert ServerArgs().max_queued_requests == DEFAULT_MAX_QUEUED_REQUESTS
    h = Harness(max_running_requests=1)
    rids = [h.submit([1, 2, 3], max_new_tokens=1) for _ in range(DEFAULT_MAX_QUEUED_REQUESTS + 3)]
    h.step()  # all arrive at once: one runs, the queue fills up, the rest are refused
    refused = [rid for rid in rids if (h.outputs[rid].finished_reason or {}).get("type") == "abort"]
    assert len(refused) >= 2
    for rid in refused:
        reason = h.outputs[rid].finished_reason
        assert reason["status_code"] == 503 and reason["message"] == "The request queue is full."
    assert len(h.scheduler.waiting_queue) <= DEFAULT_MAX_QUEUED_REQUESTS
