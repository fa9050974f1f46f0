"""Per-stage counters and histograms of one PD scheduler rank (SGLang's metric names).

The scheduler owns one DisaggMetrics; background transfer threads observe into it too (so it is
locked). Its snapshot travels in the scheduler's internal state, and the HTTP process renders it
as Prometheus metrics (tokenizer/metrics.py) with these names:

  sglang:num_bootstrap_failed_reqs_total   failed before KV started to move
  sglang:num_transfer_failed_reqs_total    failed while or after KV moved
  sglang:kv_transfer_failed_reqs_total{cause}  both, by cause (ours)
  sglang:kv_transfer_bootstrap_ms          request arrival -> the other side found
  sglang:kv_transfer_alloc_ms              (decode) other side found -> memory reserved
  sglang:kv_transfer_latency_ms            destination published -> all KV received (decode) /
                                           send time of one request (prefill)
  sglang:kv_transfer_total_mb              KV per request
  sglang:kv_transfer_speed_gb_s            per request
  sglang:num_transferred_prompt_tokens_total (decode, ours) prompt tokens whose KV came by transfer
"""

from __future__ import annotations

import bisect
import threading
from typing import Any, Dict, List, Sequence

from engine.disaggregation.base import FailureCause
from engine.disaggregation.conn_common import TransferTimes

MS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)
MB_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 50, 100, 500, 1000, 5000)
GBS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100)

HISTOGRAMS: Dict[str, Sequence[float]] = {
    "kv_transfer_bootstrap_ms": MS_BUCKETS,
    "kv_transfer_alloc_ms": MS_BUCKETS,
    "kv_transfer_latency_ms": MS_BUCKETS,
    "kv_transfer_total_mb": MB_BUCKETS,
    "kv_transfer_speed_gb_s": GBS_BUCKETS,
}


class _Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = list(buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> Dict[str, Any]:
        cumulative: List[int] = []
        total = 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return {"buckets": self.buckets, "cumulative_counts": cumulative, "sum": self.sum}


class DisaggMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bootstrap_failed = 0
        self.transfer_failed = 0
        self.failed_by_cause: Dict[str, int] = {}
        self.transferred_prompt_tokens = 0
        self.transferred_bytes = 0
        self.histograms = {name: _Histogram(b) for name, b in HISTOGRAMS.items()}

    def observe_failure(self, after_bootstrap: bool, cause: FailureCause) -> None:
        with self._lock:
            if after_bootstrap:
                self.transfer_failed += 1
            else:
                self.bootstrap_failed += 1
            self.failed_by_cause[cause.value] = self.failed_by_cause.get(cause.value, 0) + 1

    def observe_sent(self, num_bytes: int, seconds: float) -> None:
        """Prefill: one request's KV went out in `seconds`."""
        with self._lock:
            self.transferred_bytes += num_bytes
            self._observe_transfer(num_bytes, seconds)

    def observe_received(self, times: TransferTimes, num_bytes: int, num_tokens: int) -> None:
        """Decode: one request's KV was committed."""
        with self._lock:
            self.transferred_bytes += num_bytes
            self.transferred_prompt_tokens += num_tokens
            if times.bootstrapped is not None:
                self.histograms["kv_transfer_bootstrap_ms"].observe((times.bootstrapped - times.created) * 1e3)
                if times.dst_sent is not None:
                    self.histograms["kv_transfer_alloc_ms"].observe((times.dst_sent - times.bootstrapped) * 1e3)
            if times.dst_sent is not None and times.done is not None:
                self._observe_transfer(num_bytes, times.done - times.dst_sent)

    def observe_bootstrap(self, times: TransferTimes) -> None:
        """Prefill: the decode side's destination arrived for a request."""
        if times.bootstrapped is None:
            return
        with self._lock:
            self.histograms["kv_transfer_bootstrap_ms"].observe((times.bootstrapped - times.created) * 1e3)

    def _observe_transfer(self, num_bytes: int, seconds: float) -> None:
        self.histograms["kv_transfer_latency_ms"].observe(seconds * 1e3)
        self.histograms["kv_transfer_total_mb"].observe(num_bytes / 1e6)
        if seconds > 0 and num_bytes > 0:
            self.histograms["kv_transfer_speed_gb_s"].observe(num_bytes / seconds / 1e9)

    def snapshot(self) -> Dict[str, Any]:
        with self._lock:
            return {
                "num_bootstrap_failed_reqs": self.bootstrap_failed,
                "num_transfer_failed_reqs": self.transfer_failed,
                "kv_transfer_failed_reqs_by_cause": dict(self.failed_by_cause),
                "num_transferred_prompt_tokens": self.transferred_prompt_tokens,
                "kv_transferred_bytes": self.transferred_bytes,
                "histograms": {name: h.snapshot() for name, h in self.histograms.items()},
            }
