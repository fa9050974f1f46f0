"""Priority scheduling (SGLang's --enable-priority-scheduling and its companion flags).

A request's `priority` is an integer; by default larger values are more urgent, with
--schedule-low-priority-values-first smaller ones are. Everything here compares `urgency(req)`,
which is smaller for the more urgent request whatever the direction, so the rest of the scheduler
never needs to know the direction:
- the waiting queue is sorted by (urgency, queue entry time) for fcfs (and urgency first for lof);
- a full queue (--max-queued-requests) drops its least urgent request (the newest among equals)
  for a strictly more urgent newcomer, which otherwise is the one refused;
- a waiting request preempts running ones that it beats by more than
  --priority-scheduling-preemption-threshold (schedule_policy.PrefillAdder.preempt_to_schedule).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, List, Optional, Tuple

from engine.scheduler.req import Req

if TYPE_CHECKING:
    from engine.server_args import ServerArgs

# Messages and status codes of SGLang's scheduler.
PRIORITY_DISABLED_MESSAGE = ("Using priority is disabled for this server. Please send a new request without "
                             "a priority.")
EVICTED_MESSAGE = "The request is aborted by a higher priority request."


class PriorityPolicy:
    def __init__(self, server_args: ServerArgs) -> None:
        self.enabled: bool = server_args.enable_priority_scheduling
        self.sign = 1 if server_args.schedule_low_priority_values_first else -1
        self.preemption_enabled: bool = self.enabled and not server_args.disable_priority_preemption
        self.threshold: int = server_args.priority_scheduling_preemption_threshold
        self.abort_when_disabled: bool = server_args.abort_on_priority_when_disabled
        default = server_args.default_priority_value
        # No priority given: the least urgent value there is, unless --default-priority-value.
        self.default: int = default if default is not None else (sys.maxsize if self.sign > 0 else -sys.maxsize - 1)

    def assign(self, req: Req) -> Optional[str]:
        """Set the request's effective priority; a message when it must be refused (503)."""
        if self.enabled:
            if req.priority is None:
                req.priority = self.default
            return None
        if req.priority is not None and self.abort_when_disabled:
            return PRIORITY_DISABLED_MESSAGE
        req.priority = None  # ignored, as SGLang does by default
        return None

    def urgency(self, req: Req) -> int:
        """Smaller is more urgent."""
        return (req.priority if req.priority is not None else self.default) * self.sign

    def queue_order_key(self, req: Req) -> Tuple[int, float]:
        return self.urgency(req), req.queue_time

    def least_urgent_index(self, queue: List[Req]) -> int:
        """The waiting request to drop first: the least urgent, and among equals the newest."""
        return max(range(len(queue)), key=lambda i: self.queue_order_key(queue[i]))

    def beats(self, newcomer: Req, other: Req) -> bool:
        return self.urgency(newcomer) < self.urgency(other)

    def can_preempt(self, newcomer: Req, running: Req) -> bool:
        return self.urgency(running) - self.urgency(newcomer) > self.threshold
