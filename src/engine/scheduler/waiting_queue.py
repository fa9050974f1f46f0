"""The waiting queue: requests admitted but not yet prefilled (fresh, retracted or preempted).

Its one owner of the list enforces the queue limit (--max-queued-requests, with priority
eviction), the waiting timeout (--req-waiting-timeout) and hands requests to the prefill builder
in the schedule policy's order. The requests it gives back to refuse are answered by the caller;
a waiting request holds no KV, so removing one frees nothing.
"""

from __future__ import annotations

import time
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from engine.scheduler.priority import EVICTED_MESSAGE, PriorityPolicy
from engine.scheduler.req import Req

QUEUE_FULL_MESSAGE = "The request queue is full."
TIMEOUT_MESSAGE = "Request waiting timeout reached."


class WaitingQueue:
    def __init__(self, max_queued_requests: Optional[int], waiting_timeout_s: float, priority: PriorityPolicy) -> None:
        self.max_queued_requests = max_queued_requests
        self.waiting_timeout_s = waiting_timeout_s  # <= 0: no limit
        self.priority = priority
        self._reqs: List[Req] = []

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(self._reqs)

    @property
    def reqs(self) -> Sequence[Req]:
        return self._reqs

    def waiting_tokens(self) -> int:
        """Prompt tokens queued but not yet admitted: the load SGLang's router balances on."""
        return sum(len(req.origin_input_ids) for req in self._reqs)

    def push(self, req: Req, is_retracted: bool = False) -> Optional[Tuple[Req, str]]:
        """Queue `req` under the limit; returns the request to refuse (with 503) and why, if any:
        the newcomer, or with priority scheduling the least urgent waiting request it displaced.

        The limit is backpressure on new arrivals (which count the retracted requests). A retracted
        request is never refused: it was admitted and may have streamed output (SGLang aborts it
        with 503 here; docs/architecture.md)."""
        req.queue_time = time.monotonic()
        limit = self.max_queued_requests
        refused: Optional[Tuple[Req, str]] = None
        if not is_retracted and limit is not None and len(self._reqs) >= limit:
            if not self.priority.enabled:
                return req, QUEUE_FULL_MESSAGE
            # With priority scheduling the least urgent waiting request (the newest among equals)
            # makes room for a strictly more urgent newcomer; otherwise the newcomer is refused.
            worst = self.priority.least_urgent_index(self._reqs)
            if not self.priority.beats(req, self._reqs[worst]):
                return req, QUEUE_FULL_MESSAGE
            refused = self._reqs.pop(worst), EVICTED_MESSAGE
        self._reqs.append(req)
        return refused

    def push_unbounded(self, req: Req) -> None:
        """A request that already passed the limit elsewhere (PD prefill: its destination is ready)."""
        req.queue_time = time.monotonic()
        self._reqs.append(req)

    def pop_expired(self) -> List[Req]:
        """Remove and return the requests that waited longer than --req-waiting-timeout."""
        if self.waiting_timeout_s <= 0:
            return []
        deadline = time.monotonic() - self.waiting_timeout_s
        expired = [r for r in self._reqs if r.queue_time < deadline]
        if expired:
            self._reqs = [r for r in self._reqs if r.queue_time >= deadline]
        return expired

    def pop_matching(self, match: Callable[[Req], bool]) -> List[Req]:
        taken = [r for r in self._reqs if match(r)]
        if taken:
            self._reqs = [r for r in self._reqs if not match(r)]
        return taken

    def remove_admitted(self, admitted: Sequence[Req]) -> None:
        ids = {id(r) for r in admitted}
        self._reqs = [r for r in self._reqs if id(r) not in ids]

    def sort(self, order: Callable[[List[Req]], None]) -> None:
        """Reorder in place by the schedule policy (`order` sorts the list it is given)."""
        order(self._reqs)
