"""What the scheduler reports about itself: the prefill and decode log lines, the figures of
/get_server_info's internal state (and so of /metrics and the router's load), and the idle
self-check that every KV slot and request row is accounted for.

One collaborator of the Scheduler (as SchedulerControl), not a mixin.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class MemoryLeakError(RuntimeError):
    pass


class SchedulerStats:
    def __init__(self, scheduler: "Scheduler") -> None:
        self.s = scheduler
        self.num_generated_tokens = 0  # since the last decode log line
        self.decode_batch_ct = 0
        self.last_decode_log_time = time.monotonic()
        self.total_prompt_tokens = 0
        self.total_cached_tokens = 0
        self.last_gen_throughput = 0.0
        self._reported_leak: Optional[tuple] = None  # the last leak logged by check_memory

    def token_usage(self) -> float:
        s = self.s
        free = s.token_to_kv_pool_allocator.available_size() + s.tree_cache.evictable_size()
        return 1.0 - free / s.max_total_num_tokens

    def cache_hit_rate(self) -> float:
        return self.total_cached_tokens / max(self.total_prompt_tokens, 1)

    def _disagg_suffix(self) -> str:
        return f", {self.s.disagg.queue_summary()}" if self.s.disagg is not None else ""

    def on_prefill_batch(self, batch: "ScheduleBatch") -> None:
        """A prefill batch was built: count its prompt tokens and log it."""
        s = self.s
        self.total_prompt_tokens += batch.log_input_tokens + batch.log_hit_tokens
        self.total_cached_tokens += batch.log_hit_tokens
        if s.tp_rank != 0:
            return
        logger.info(
            "Prefill batch, #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d%s",
            batch.batch_size(), batch.log_input_tokens, batch.log_hit_tokens, self.token_usage(),
            s.running_batch.batch_size(), len(s.waiting_queue), self._disagg_suffix())

    def on_tokens(self, batch: "ScheduleBatch", emitted: int) -> None:
        """A generation batch's result gave `emitted` tokens; every --decode-log-interval decode
        batches, the decode line with the throughput since the last one."""
        self.num_generated_tokens += emitted
        assert batch.forward_mode is not None
        if not batch.forward_mode.is_decode():
            return
        self.decode_batch_ct += 1
        if self.decode_batch_ct % self.s.server_args.decode_log_interval != 0:
            return
        now = time.monotonic()
        throughput = self.num_generated_tokens / max(now - self.last_decode_log_time, 1e-6)
        self.last_gen_throughput = throughput
        self.last_decode_log_time, self.num_generated_tokens = now, 0
        if self.s.tp_rank != 0:
            return
        logger.info(
            "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
            "#queue-req: %d%s", batch.batch_size(), sum(batch.seq_lens_cpu), self.token_usage(), throughput,
            len(self.s.waiting_queue), self._disagg_suffix())

    def internal_state(self) -> Dict[str, Any]:
        s = self.s
        return {
            "max_total_num_tokens": s.max_total_num_tokens,
            "available_tokens": s.token_to_kv_pool_allocator.available_size(),
            "evictable_tokens": s.tree_cache.evictable_size(),
            "protected_tokens": s.tree_cache.protected_size(),
            "num_running_reqs": s.running_batch.batch_size() + (1 if s.chunked_req is not None else 0),
            "num_waiting_reqs": len(s.waiting_queue),
            # Prompt tokens queued but not yet admitted: the load SGLang's router balances on.
            "waiting_tokens": sum(len(req.origin_input_ids) for req in s.waiting_queue),
            "num_grammar_queue_reqs": len(s.grammar_manager),
            "max_running_requests": s.max_running_requests,
            "max_req_input_len": s.max_req_input_len,
            "context_len": s.context_len,
            "new_token_ratio": s.new_token_ratio,
            "page_size": s.page_size,
            "token_usage": self.token_usage(),
            "cache_hit_rate": self.cache_hit_rate(),
            "gen_throughput": self.last_gen_throughput,
            "forward_ct": s.forward_ct,
            "num_extend_tokens_computed": s.num_extend_tokens_computed,
            **({"disaggregation": s.disagg.internal_state()} if s.disagg is not None else {}),
        }

    def check_memory(self) -> None:
        """At idle every KV slot is free, evictable or protected and every request row is free;
        a leak raises with --strict-memory-check, else it is logged once per distinct leak."""
        s = self.s
        available = s.token_to_kv_pool_allocator.available_size()
        evictable = s.tree_cache.evictable_size()
        protected = s.tree_cache.protected_size()
        free_rows = s.req_to_token_pool.available_size()
        ok_tokens = available + evictable + protected == s.max_total_num_tokens
        ok_rows = free_rows == s.req_to_token_pool.size
        disagg_error = s.disagg.check_memory() if s.disagg is not None else None
        if ok_tokens and ok_rows and disagg_error is None:
            self._reported_leak = None
            return
        msg = (f"Scheduler memory leak detected! available={available}, evictable={evictable}, "
               f"protected={protected}, total={s.max_total_num_tokens}, free req slots="
               f"{free_rows}/{s.req_to_token_pool.size}" + (f", PD: {disagg_error}" if disagg_error else ""))
        if s.server_args.strict_memory_check:
            raise MemoryLeakError(msg)
        # The check runs every idle second: report each distinct leak once, not forever.
        leak = (available, evictable, protected, free_rows, disagg_error)
        if leak != self._reported_leak:
            self._reported_leak = leak
            logger.error("%s. The server keeps serving; --strict-memory-check makes this fatal.", msg)
