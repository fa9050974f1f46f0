"""What a PD role gets from the scheduler it serves: the owners it calls and the loop's callbacks.

The role (prefill.py, decode_scheduler.py) never sees the Scheduler: it frees and builds KV through
the KV manager, merges transferred requests through the running set, and hands requests back to
the loop through these callbacks. So the roles and the scheduler do not import each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

if TYPE_CHECKING:
    import torch

    from engine.disaggregation.kv_io import FeatureStore
    from engine.constrained.grammar_manager import GrammarManager
    from engine.scheduler.kv_manager import KVManager
    from engine.scheduler.overlap_utils import ForwardStream
    from engine.scheduler.priority import PriorityPolicy
    from engine.scheduler.req import Req
    from engine.scheduler.running_set import RunningSet
    from engine.scheduler.schedule_batch import ScheduleBatch
    from engine.server_args import ServerArgs


@dataclass(frozen=True)
class RoleHost:
    server_args: ServerArgs
    tp_rank: int
    page_size: int
    vocab_size: int
    total_kv_heads: int
    max_total_num_tokens: int
    max_running_requests: int
    kv: KVManager
    running: RunningSet
    priority: PriorityPolicy
    grammar_manager: GrammarManager
    forward_stream: ForwardStream
    # A finished (or failed) request's output goes out at the end of the iteration.
    stream: Callable[[List[Req]], None]
    # PD prefill: a request whose destination is ready joins the waiting queue.
    enqueue_waiting: Callable[[Req], None]
    # PD decode: the running batch's next step (retraction included), None when nothing runs.
    update_running_batch: Callable[[], Optional[ScheduleBatch]]
    # Send this iteration's outputs now (before a slow step).
    flush_outputs: Callable[[], None]
    # Seed the overlap relay with rows' last tokens, after the forwards in flight.
    write_relay: Callable[[torch.Tensor, torch.Tensor], None]
    # Whether a forward's result is still unprocessed (overlap loop).
    has_results_in_flight: Callable[[], bool]
    # pause_generation(mode="retract") is under way: the weights may change before continue.
    paused_by_retract: Callable[[], bool]
    # The per-slot features that travel with the KV (an EAGLE head's target features), or None.
    features: Optional[FeatureStore] = None
