"""The grammar queue on its own (a fake backend, no xgrammar): requests leave in arrival order once
compiled, the TP ranks' minimum decides how many leave, timeouts and failures are refused."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Dict, List, Optional

import torch

from engine.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject, GrammarCompileError
from engine.constrained.grammar_manager import GrammarManager
from engine.constrained.reasoner_grammar import ReasonerGrammar
from engine.constrained.vocab_mask import allocate_vocab_mask
from engine.sampling.sampling_params import SamplingParams


class FakeGrammar(BaseGrammarObject):
    def _accept(self, token: int) -> bool:
        return True

    def _rollback(self, num_tokens: int) -> bool:
        return True

    def _reset(self) -> None:
        pass

    def is_terminated(self) -> bool:
        return False

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        pass

    def copy(self) -> "FakeGrammar":
        return FakeGrammar()


class GateBackend(BaseGrammarBackend):
    """Each regex compiles when its gate opens; "bad" fails."""

    def __init__(self) -> None:
        super().__init__(num_threads=4)
        self.gates: Dict[str, threading.Event] = {}

    def gate(self, text: str) -> threading.Event:
        return self.gates.setdefault(text, threading.Event())

    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        assert self.gate(regex).wait(timeout=30)
        if regex == "bad":
            raise GrammarCompileError("Invalid regex: bad")
        return FakeGrammar()

    dispatch_json = dispatch_ebnf = dispatch_regex


class FakeReq:
    def __init__(self, rid: str, regex: Optional[str], require_reasoning: bool = False) -> None:
        self.rid = rid
        self.sampling_params = SamplingParams(regex=regex)
        self.grammar: Optional[BaseGrammarObject] = None
        self.require_reasoning = require_reasoning


def _wait_done(manager: GrammarManager, index: int) -> None:
    manager.grammar_queue[index].future.result(timeout=30)


def test_requests_leave_in_arrival_order_once_compiled():
    backend = GateBackend()
    manager = GrammarManager(lambda: (backend, None))
    reqs = [FakeReq("a", "x"), FakeReq("b", "y"), FakeReq("c", "x"), FakeReq("free", None)]
    assert [manager.process_req_with_grammar(r) for r in reqs] == [(True, None)] * 3 + [(False, None)]
    assert manager.grammar_queue[0].future is manager.grammar_queue[2].future  # one compilation of "x"
    backend.gate("y").set()
    _wait_done(manager, 1)
    assert manager.get_ready_grammar_requests() == ([], [])  # "b" waits behind "a"
    backend.gate("x").set()
    _wait_done(manager, 0)
    ready, refused = manager.get_ready_grammar_requests()
    assert [r.rid for r in ready] == ["a", "b", "c"] and refused == [] and len(manager) == 0
    assert all(isinstance(r.grammar, FakeGrammar) for r in ready) and ready[0].grammar is not ready[2].grammar
    # Now cached: a new request gets its matcher at once.
    late = FakeReq("d", "x")
    assert manager.process_req_with_grammar(late) == (False, None) and late.grammar is not None
    backend.shutdown()


def test_tp_ranks_take_the_minimum_ready_count():
    backend = GateBackend()
    calls: List[int] = []

    def other_rank_has_none_ready(count: int) -> int:
        calls.append(count)
        return 0 if len(calls) == 1 else count

    manager = GrammarManager(lambda: (backend, None), sync_ready_count=other_rank_has_none_ready)
    manager.process_req_with_grammar(FakeReq("a", "x"))
    backend.gate("x").set()
    _wait_done(manager, 0)
    assert manager.get_ready_grammar_requests() == ([], []) and len(manager) == 1
    ready, _ = manager.get_ready_grammar_requests()
    assert [r.rid for r in ready] == ["a"] and calls == [1, 1]
    backend.shutdown()


def test_failures_timeouts_and_a_disabled_backend_are_refused():
    backend = GateBackend()
    manager = GrammarManager(lambda: (backend, None), timeout_s=0.0)
    manager.process_req_with_grammar(FakeReq("slow", "never"))
    _, refused = manager.get_ready_grammar_requests()
    assert [(r.rid, msg) for r, msg in refused] == [("slow", "The grammar did not compile within 0 s.")]
    # The timed-out constraint is remembered as failed.
    assert manager.process_req_with_grammar(FakeReq("again", "never")) == (
        False, "The grammar did not compile within 0 s.")
    backend.gate("bad").set()
    manager.timeout_s = 30.0
    manager.process_req_with_grammar(FakeReq("bad", "bad"))
    _wait_done(manager, 0)
    _, refused = manager.get_ready_grammar_requests()
    assert [(r.rid, msg) for r, msg in refused] == [("bad", "Invalid regex: bad")]
    backend.gate("never").set()
    backend.shutdown()

    disabled = GrammarManager(lambda: (None, "Constrained decoding is disabled."))
    assert disabled.process_req_with_grammar(FakeReq("x", "a")) == (False, "Constrained decoding is disabled.")
    assert disabled.process_req_with_grammar(FakeReq("free", None)) == (False, None)


def test_the_backend_is_built_at_the_first_constrained_request_only():
    built: List[int] = []

    def factory():
        built.append(1)
        return None, "off"

    manager = GrammarManager(factory)
    manager.process_req_with_grammar(FakeReq("free", None))
    assert built == []
    manager.process_req_with_grammar(FakeReq("a", "x"))
    manager.process_req_with_grammar(FakeReq("b", "x"))
    assert built == [1]


def test_abort_removes_waiting_requests():
    backend = GateBackend()
    manager = GrammarManager(lambda: (backend, None))
    for rid in ("r1-0", "r1-1", "r2"):
        manager.process_req_with_grammar(FakeReq(rid, "x"))
    aborted = manager.abort_requests(lambda r: r.rid.startswith("r1"))
    assert [r.rid for r in aborted] == ["r1-0", "r1-1"] and [w.req.rid for w in manager.grammar_queue] == ["r2"]
    backend.gate("x").set()
    backend.shutdown()


def test_a_miss_compiles_on_the_pool_and_returns_its_entry():
    backend = GateBackend()
    _, future = backend.get_cached_or_future_value(("regex", "z"))
    assert isinstance(future, Future)
    backend.gate("z").set()
    assert future.result(timeout=30).grammar is not None
    backend.shutdown()


class DigitsGrammar(BaseGrammarObject):
    """Allows only token 1 ("a digit"), then terminates on token 0 (the stop token)."""

    def __init__(self) -> None:
        super().__init__()
        self.accepted: List[int] = []

    def _accept(self, token: int) -> bool:
        if self.is_terminated() or token not in (0, 1):
            return False
        self.accepted.append(token)
        return True

    def _rollback(self, num_tokens: int) -> bool:
        del self.accepted[len(self.accepted) - num_tokens:]
        return True

    def _reset(self) -> None:
        self.accepted = []

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == 0

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        vocab_mask[row] = 0
        vocab_mask[row, 0] = 0b11

    def copy(self) -> "DigitsGrammar":
        return DigitsGrammar()


def allowed(grammar: BaseGrammarObject) -> List[int]:
    mask = allocate_vocab_mask(1, 40)
    grammar.fill_vocab_mask(mask, 0)
    return [t for t in range(40) if (int(mask[0, t // 32]) >> (t % 32)) & 1]


def test_a_reasoning_request_is_unconstrained_until_the_closing_tag():
    """SGLang's ReasonerGrammarObject: while the model thinks every token is allowed and none is
    checked; the grammar starts after the closing tag's token ids (here two: 7, 8), from its start."""
    grammar = ReasonerGrammar(DigitsGrammar(), [7, 8])
    for token in (5, 7, 9, 8, 7):  # 7 8 must come together: "7 9 8" is still thinking
        assert allowed(grammar) == list(range(40)) and grammar.accept_token(token)
    assert grammar.thinking and not grammar.is_terminated()
    assert grammar.accept_token(8) and not grammar.thinking
    assert allowed(grammar) == [0, 1]
    assert not grammar.accept_token(5)  # the inner grammar refuses
    assert grammar.accept_token(1) and grammar.accept_token(0) and grammar.is_terminated()
    # A retraction back into the thinking rebuilds the state from the output ids.
    assert grammar.sync_with([5, 7, 9]) and grammar.thinking and grammar.num_accepted == 3
    assert grammar.sync_with([5, 7, 9, 7, 8, 1]) and not grammar.thinking and not grammar.is_terminated()
    assert not grammar.copy().sync_with([7, 8, 4])


def test_the_manager_wraps_the_matcher_of_reasoning_requests_only():
    backend = GateBackend()
    backend.gate("x").set()
    manager = GrammarManager(lambda: (backend, None), think_end_ids=[7, 8])
    thinking, plain = FakeReq("t", "x", require_reasoning=True), FakeReq("p", "x")
    for req in (thinking, plain):
        if manager.process_req_with_grammar(req) == (True, None):
            _wait_done(manager, 0)
            manager.get_ready_grammar_requests()
    assert isinstance(thinking.grammar, ReasonerGrammar) and isinstance(thinking.grammar.inner, FakeGrammar)
    assert isinstance(plain.grammar, FakeGrammar)
    # Without --reasoning-parser there is no closing tag to wait for: the grammar applies at once.
    no_parser = GrammarManager(lambda: (backend, None))
    req = FakeReq("t2", "x", require_reasoning=True)
    assert no_parser.process_req_with_grammar(req) == (False, None) and isinstance(req.grammar, FakeGrammar)
    backend.shutdown()
