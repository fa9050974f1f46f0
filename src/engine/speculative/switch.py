"""SpeculationSwitch: decode plainly where drafts do not pay for their verify step (the issue's floor:
never below 0.9x of speculation off where acceptance is low).

Per decode batch size (a verify step's cost relative to a plain step grows with the batch), the
switch keeps the fastest of the recent wall times of a plain decode step and of a verify step (on a
shared machine a step that took long measured the neighbours, and a spike must not flip the switch;
catch-up of a draft model excluded: it is a one-off per skipped token, not a cost of the step), and
one server-wide exponential moving average of the tokens a request emits per verify step (the accept
length; acceptance is a property of the workload, not of the batch size). Speculation pays while
accept_length / verify_time >= 1 / plain_time (to turn on again: ON_MARGIN faster). A batch size starts speculating; after WARMUP samples
of each kind it follows the rule:
- on: every decode step verifies, except one in PLAIN_REFRESH_INTERVAL that decodes plainly so the
  plain cost stays current (a fraction of a percent of the speed-up);
- off: decode steps are plain, except a probe (one verify step) every `interval` steps, which
  doubles from MIN_PROBE_INTERVAL to MAX_PROBE_INTERVAL while the probes keep finding speculation
  unprofitable. A probe costs its verify step less the tokens it emits, (verify - accept x plain), so
  the interval is never below that over PROBE_BUDGET plain steps (capped at MAX_PROBE_INTERVAL):
  probing costs at most PROBE_BUDGET of the plain speed (a draft model's catch-up aside) from the first
  probe on, not only once the doubling has run (a young server, or a slow verify step, probed every
  16 steps: ~5% of the speed at batch 1 with a draft model beside a small target).
Outputs never depend on it: a plain step and a verify step are both exact.

Under tensor parallelism every rank schedules the same batches, so each rank must take the same
decision; acceptance agrees across ranks (same logits, same random draws) but wall times do not,
so after each measurement the ranks agree on one decision (`agree`: on only where every rank
measured that it pays).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, Optional

logger = logging.getLogger(__name__)

EMA_ALPHA = 0.25  # weight of the newest accept length
PROBE_ALPHA = 0.5  # weight of a probe's accept length (the workload may have changed since the last one)
WARMUP = 2  # samples of each kind before a decision; the first of each kind is discarded (one-time costs)
PLAIN_WINDOW = 64  # the plain cost: the fastest of this many recent plain steps
VERIFY_WINDOW = 4  # the verify cost: the fastest of this many recent verify steps (probes are rare)
PLAIN_REFRESH_INTERVAL = 64
MIN_PROBE_INTERVAL = 16
MAX_PROBE_INTERVAL = 256
# Off, speculation turns on again only where it is expected to be this much faster: a busy spell of
# a shared machine during the plain steps must not make one quiet probe look profitable.
ON_MARGIN = 1.1
# Off, the share of the plain speed the probes may cost (their verify steps less what they emit).
PROBE_BUDGET = 0.02


@dataclass
class _Costs:
    """One batch size's measurements and decision."""

    plain: Deque[float] = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))  # seconds
    plain_n: int = 0  # plain samples seen (the first is discarded)
    verify: Deque[float] = field(default_factory=lambda: deque(maxlen=VERIFY_WINDOW))
    verify_n: int = 0
    on: bool = True
    since: int = 0  # decode steps since the last refresh (on) or probe (off)
    interval: int = MIN_PROBE_INTERVAL


class SpeculationSwitch:
    def __init__(self, enabled: bool, agree: Optional[Callable[[bool], bool]] = None) -> None:
        """enabled False (--disable-speculative-adaptive): every eligible decode step verifies.
        agree: the decision every rank takes, from each rank's own (tensor parallelism); None on one rank."""
        self.enabled = enabled
        self.agree = agree
        self.costs: Dict[int, _Costs] = {}
        self.accept_length = 0.0  # EMA of the tokens a request emits per verify step
        self.accept_n = 0
        self.switches = 0  # on/off transitions (tests, /get_server_info)

    def should_verify(self, batch_size: int) -> bool:
        """Whether the eligible decode step of this batch size verifies drafts (scheduling thread,
        once per step: it advances the refresh and probe counters)."""
        return self._decide(batch_size, commit=True)

    def would_verify(self, batch_size: int) -> bool:
        """What should_verify would answer now, changing nothing: the overlap loop asks before it
        builds the batch, to settle the forward in flight first (a verify step drafts from its tokens)."""
        return self._decide(batch_size, commit=False)

    def _decide(self, batch_size: int, commit: bool) -> bool:
        if not self.enabled:
            return True
        c = self.costs.setdefault(batch_size, _Costs()) if commit else self.costs.get(batch_size, _Costs())
        if c.verify_n < WARMUP:
            return True
        if c.plain_n < WARMUP:
            return False
        since = c.since + 1
        due = since >= (PLAIN_REFRESH_INTERVAL if c.on else c.interval)  # a refresh (on) or a probe (off)
        if commit:
            c.since = 0 if due else since
        return c.on != due

    def record(self, batch_size: int, verified: bool, seconds: float, tokens_per_request: float) -> None:
        """A decode step this switch chose is done: its wall time and, for a verify step, the mean
        tokens each request emitted. Decides again."""
        if not self.enabled:
            return
        c = self.costs.setdefault(batch_size, _Costs())
        probe = verified and c.verify_n >= WARMUP and not c.on
        if verified:
            c.verify_n += 1
            if c.verify_n >= 2:
                c.verify.append(seconds)
            self.accept_n += 1
            alpha = 1.0 if self.accept_n == 1 else PROBE_ALPHA if probe else EMA_ALPHA
            self.accept_length = (1 - alpha) * self.accept_length + alpha * tokens_per_request
        else:
            c.plain_n += 1
            if c.plain_n >= 2:
                c.plain.append(seconds)
        if c.verify_n < WARMUP or c.plain_n < WARMUP:
            return
        plain_s, verify_s = min(c.plain), min(c.verify)
        pays = self.accept_length * plain_s >= verify_s * (1.0 if c.on else ON_MARGIN)
        on = self.agree(pays) if self.agree is not None else pays
        if probe:  # its verdict
            c.interval = MIN_PROBE_INTERVAL if on else min(2 * c.interval, MAX_PROBE_INTERVAL)
        if not on:  # within the probing budget
            excess = (verify_s - self.accept_length * plain_s) / plain_s
            c.interval = max(c.interval, min(MAX_PROBE_INTERVAL, math.ceil(excess / PROBE_BUDGET)))
        if on != c.on:
            self.switches += 1
            c.since = 0
            logger.info("Speculative decoding %s at batch size %d: accept length %.2f, verify step %.2f ms, "
                        "plain step %.2f ms", "on" if on else "off", batch_size, self.accept_length,
                        verify_s * 1e3, plain_s * 1e3)
        c.on = on

    def state(self) -> Dict[str, object]:
        """What /get_server_info reports: per batch size, whether speculation is on."""
        return {"spec_adaptive_enabled": self.enabled, "spec_switches": self.switches,
                "spec_on_by_batch_size": {bs: c.on for bs, c in sorted(self.costs.items())}}
