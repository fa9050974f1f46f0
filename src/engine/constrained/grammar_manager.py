"""The scheduler's grammar queue: constrained requests wait here while their grammar compiles.

A constrained request whose grammar is cached gets its matcher at once and goes to the waiting
queue; otherwise it waits in the grammar queue and the compilation runs on the backend's thread
pool, so neither the scheduling thread nor the other requests wait for it. Every scheduling step
moves the requests whose grammar is ready (in arrival order) to the waiting queue. A grammar that
failed to compile, took longer than the timeout, or a server without a grammar backend, turns the
request into an abort with a message that says why.

With tensor parallelism every rank compiles on its own: the ranks agree on how many requests
leave the queue in a step (the minimum over ranks), so they keep making the same decisions.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

from engine.constrained.base_grammar_backend import BaseGrammarBackend, CacheEntry, GrammarKey
from engine.constrained.reasoner_grammar import ReasonerGrammar
from engine.parsers.reasoning import REASONING_FORMATS

if TYPE_CHECKING:
    from engine.scheduler.req import Req
    from engine.server_args import ServerArgs

logger = logging.getLogger(__name__)

# Seconds a request may wait for its grammar (--grammar-timeout; SGLANG_GRAMMAR_TIMEOUT's role);
# then it is refused and the constraint is remembered as failed.
GRAMMAR_TIMEOUT_S = 300.0


@dataclass
class _Waiting:
    """A request whose grammar compiles (PendingGrammar: the PD decode side holds it outside the queue)."""

    req: "Req"
    key: GrammarKey
    future: concurrent.futures.Future
    since: float


PendingGrammar = _Waiting

BackendFactory = Callable[[], Tuple[Optional[BaseGrammarBackend], Optional[str]]]


class GrammarManager:
    def __init__(self, backend_factory: BackendFactory, sync_ready_count: Optional[Callable[[int], int]] = None,
                 timeout_s: float = GRAMMAR_TIMEOUT_S, think_end_ids: Optional[Sequence[int]] = None) -> None:
        # The backend is built when the first constrained request arrives: a server that never
        # sees one never imports xgrammar or indexes its vocabulary.
        self._backend_factory: Optional[BackendFactory] = backend_factory
        self.backend: Optional[BaseGrammarBackend] = None
        self.disabled_reason: Optional[str] = None
        # TP > 1: reduces a rank's ready count to the minimum over ranks.
        self.sync_ready_count = sync_ready_count
        self.timeout_s = timeout_s
        # With --reasoning-parser: the token ids of its closing tag. A request that starts in its
        # reasoning (require_reasoning) gets its grammar only after them (reasoner_grammar.py).
        self.think_end_ids = tuple(think_end_ids) if think_end_ids else None
        self.grammar_queue: List[_Waiting] = []

    def __len__(self) -> int:
        return len(self.grammar_queue)

    # ------------------------------------------------------------------ admission
    def process_req_with_grammar(self, req: "Req") -> Tuple[bool, Optional[str]]:
        """Attach a matcher to a constrained request: (queued, error).

        (False, None): the matcher is attached, the request may be scheduled now; (True, None):
        it waits in the grammar queue; (False, message): refuse the request with that message.
        """
        key = req.sampling_params.constraint
        if key is None:
            return False, None
        if self._backend_factory is not None:
            factory, self._backend_factory = self._backend_factory, None
            self.backend, self.disabled_reason = factory()
        if self.backend is None:
            return False, self.disabled_reason
        entry, future = self.backend.get_cached_or_future_value(key)
        if entry is not None:
            return False, self._attach(req, entry)
        assert future is not None  # no cached entry: the backend returned the compile's future
        self.grammar_queue.append(_Waiting(req, key, future, time.monotonic()))
        return True, None

    def _attach(self, req: "Req", entry: CacheEntry) -> Optional[str]:
        if entry.grammar is None:
            return entry.error
        grammar = entry.grammar.copy()
        if req.require_reasoning and self.think_end_ids is not None:
            grammar = ReasonerGrammar(grammar, self.think_end_ids)
        req.grammar = grammar
        return None

    # ------------------------------------------------------------------ PD decode
    def start(self, req: "Req") -> Tuple[Optional[_Waiting], Optional[str]]:
        """Attach a matcher or start its compilation without queueing `req`: (pending, error).

        A PD decode server compiles while the KV transfers (SGLang does too), so its transfer queue
        holds the request; it asks `is_ready` and then `attach_pending` instead of the grammar queue.
        """
        queued, error = self.process_req_with_grammar(req)
        if not queued:
            return None, error
        return self.grammar_queue.pop(), None

    def is_ready(self, pending: _Waiting) -> bool:
        """The compilation finished, or it ran past the timeout (then `attach_pending` refuses)."""
        return pending.future.done() or time.monotonic() - pending.since > self.timeout_s

    def compile_error(self, pending: _Waiting) -> Optional[str]:
        """Why a `start`ed grammar cannot be used, once its compilation has finished; else None."""
        if not pending.future.done():
            return None
        entry = self._resolve(pending)
        return entry.error if entry.grammar is None else None

    def attach_pending(self, pending: _Waiting) -> Optional[str]:
        """Attach the compiled grammar of a `start`ed request, or say why it has none."""
        return self._attach(pending.req, self._resolve(pending))

    # ------------------------------------------------------------------ every step
    def get_ready_grammar_requests(self) -> Tuple[List["Req"], List[Tuple["Req", str]]]:
        """Requests leaving the queue this step: (ready to schedule, refused with a message)."""
        if not self.grammar_queue:
            return [], []
        now = time.monotonic()
        count = 0
        for waiting in self.grammar_queue:
            if not (waiting.future.done() or now - waiting.since > self.timeout_s):
                break
            count += 1
        if self.sync_ready_count is not None:
            count = self.sync_ready_count(count)
        leaving, self.grammar_queue = self.grammar_queue[:count], self.grammar_queue[count:]
        ready: List["Req"] = []
        refused: List[Tuple["Req", str]] = []
        for waiting in leaving:
            entry = self._resolve(waiting)
            error = self._attach(waiting.req, entry)
            if error is None:
                ready.append(waiting.req)
            else:
                refused.append((waiting.req, error))
        return ready, refused

    def _resolve(self, waiting: _Waiting) -> CacheEntry:
        assert self.backend is not None
        entry = self.backend.cache.get(waiting.key)
        if entry is not None:
            return entry
        if waiting.future.done():
            entry = waiting.future.result()
        else:
            entry = CacheEntry(error=f"The grammar did not compile within {self.timeout_s:g} s.")
            logger.warning("Grammar compilation timed out for request %s", waiting.req.rid)
        self.backend.set_cache(waiting.key, entry)
        return entry

    def wait_for_progress(self, timeout_s: float) -> None:
        """Block until the oldest compilation finishes (or `timeout_s`): used when the scheduler
        has nothing else to do, so it neither spins nor sleeps longer than needed."""
        if self.grammar_queue:
            concurrent.futures.wait([self.grammar_queue[0].future], timeout=timeout_s)

    # ------------------------------------------------------------------ aborts and control
    def abort_requests(self, match: Callable[["Req"], bool]) -> List["Req"]:
        """Remove and return the waiting requests `match` selects (their compilations go on and
        are cached for the next request with the same constraint)."""
        aborted = [w.req for w in self.grammar_queue if match(w.req)]
        if aborted:
            self.grammar_queue = [w for w in self.grammar_queue if not match(w.req)]
        return aborted

    def reset(self) -> None:
        if self.backend is not None:
            self.backend.reset()

    def shutdown(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()


def create_grammar_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: List[int], any_whitespace: bool = True
) -> Tuple[Optional[BaseGrammarBackend], Optional[str]]:
    """(backend, None), or (None, why constrained requests will be refused)."""
    if name == "none":
        return None, "Constrained decoding is disabled on this server (--grammar-backend none)."
    if name != "xgrammar":
        raise ValueError(f"Unknown grammar backend {name!r}")
    if tokenizer is None:
        return None, "Constrained decoding needs the tokenizer, which this server does not load."
    try:
        from engine.constrained.xgrammar_backend import XGrammarGrammarBackend
    except ImportError:
        logger.warning("xgrammar is not installed: constrained decoding is off (pip install 'engine[grammar]').")
        return None, "Constrained decoding needs the xgrammar package, which is not installed on this server."
    threads = max(1, min(4, os.cpu_count() or 1))
    try:
        backend = XGrammarGrammarBackend(tokenizer, vocab_size, stop_token_ids, any_whitespace=any_whitespace,
                                         num_threads=threads)
    except Exception as e:  # noqa: BLE001 - a tokenizer xgrammar cannot index: refuse, do not crash
        logger.warning("Constrained decoding is off: xgrammar cannot use this tokenizer (%s)", e)
        return None, f"Constrained decoding is unavailable: xgrammar cannot use this model's tokenizer ({e})."
    return backend, None


def server_grammar_backend(server_args: ServerArgs, tokenizer: Any, vocab_size: int,
                           eos_token_ids: Sequence[int]) -> Tuple[Optional[BaseGrammarBackend], Optional[str]]:
    """The backend of --grammar-backend for this model, or why constrained requests are refused."""
    return create_grammar_backend(server_args.grammar_backend, tokenizer, vocab_size, sorted(eos_token_ids),
                                  any_whitespace=not server_args.constrained_json_disable_any_whitespace)


def server_grammar_manager(server_args: ServerArgs, tokenizer: Any, vocab_size: int,
                           eos_token_ids: Sequence[int]) -> GrammarManager:
    """A scheduler's GrammarManager: its backend built at the first constrained request (a server
    without one never imports xgrammar), --reasoning-parser's end-of-thinking ids, and with TP > 1
    the collective that makes every rank take the same number of ready grammars."""
    from engine.distributed.parallel_state import all_reduce_min_int, get_tp_size

    think_end_ids: Optional[List[int]] = None
    if server_args.reasoning_parser is not None and tokenizer is not None:
        think_end = REASONING_FORMATS[server_args.reasoning_parser].think_end
        think_end_ids = list(tokenizer.encode(think_end, add_special_tokens=False)) or None
    return GrammarManager(lambda: server_grammar_backend(server_args, tokenizer, vocab_size, eos_token_ids),
                          sync_ready_count=all_reduce_min_int if get_tp_size() > 1 else None,
                          timeout_s=server_args.grammar_timeout, think_end_ids=think_end_ids)
