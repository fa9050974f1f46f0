"""What the scheduler reports about itself: the prefill and decode log lines and the counters
behind /get_server_info's internal state (and so /metrics and the router's load).

The stats own their counters only; the figures of the queues and the pool are passed in by the
scheduler, which reads them from their owners.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, NamedTuple

if TYPE_CHECKING:
    from engine.scheduler.schedule_batch import ScheduleBatch


class Load(NamedTuple):
    """The figures of a log line, read from their owners when a line is written."""

    token_usage: float
    num_running: int
    num_waiting: int
    suffix: str  # the PD role's queues, or ""

logger = logging.getLogger(__name__)


class SchedulerStats:
    def __init__(self, tp_rank: int, decode_log_interval: int, load: Callable[[], Load]) -> None:
        self.tp_rank = tp_rank
        self.load = load
        self.decode_log_interval = decode_log_interval
        self.num_generated_tokens = 0  # since the last decode log line
        self.decode_batch_ct = 0
        self.last_decode_log_time = time.monotonic()
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.last_gen_throughput = 0.0

    def cache_hit_rate(self) -> float:
        return self.total_cached_tokens / max(self.total_prompt_tokens, 1)

    def on_idle(self) -> None:
        self.last_gen_throughput = 0.0

    def on_prefill_batch(self, batch: "ScheduleBatch") -> None:
        """A prefill batch was built: count its prompt tokens and log it."""
        self.total_prompt_tokens += batch.log_input_tokens + batch.log_hit_tokens
        self.total_cached_tokens += batch.log_hit_tokens
        if self.tp_rank != 0:
            return
        load = self.load()
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d%s",
            batch.batch_size(), batch.log_input_tokens, batch.log_hit_tokens, load.token_usage,
            load.num_running, load.num_waiting, load.suffix)

    def on_tokens(self, batch: "ScheduleBatch", emitted: int) -> None:
        """A generation batch's result gave `emitted` tokens; every --decode-log-interval decode
        batches, the decode line with the throughput since the last one."""
        self.num_generated_tokens += emitted
        assert batch.forward_mode is not None
        if not batch.forward_mode.is_decode():
            return
        self.decode_batch_ct += 1
        if self.decode_batch_ct % self.decode_log_interval != 0:
            return
        now = time.monotonic()
        throughput = self.num_generated_tokens / max(now - self.last_decode_log_time, 1e-6)
        self.last_gen_throughput = throughput
        self.last_decode_log_time, self.num_generated_tokens = now, 0
        if self.tp_rank != 0:
            return
        load = self.load()
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d%s", batch.batch_size(), sum(batch.seq_lens_cpu), load.token_usage, throughput,
            load.num_waiting, load.suffix)
