"""Which waiting requests go first (SchedulePolicy) and how many fit (PrefillAdder)."""

from __future__ import annotations

import bisect
import random
from collections import Counter, defaultdict
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

from engine.scheduler.priority import PriorityPolicy
from engine.scheduler.req import CLIP_MAX_NEW_TOKENS_ESTIMATION, Req
from engine.mem_cache.base_prefix_cache import BasePrefixCache
from engine.mem_cache.radix_cache import RadixCache, TreeNode


class Preemptible(Protocol):
    """The running requests priority preemption may take from (the scheduler's RunningSet)."""

    @property
    def reqs(self) -> Sequence[Req]: ...

    def preempt(self, victims: List[Req]) -> None: ...

# LPM with in-batch prefix de-duplication: a request whose cached prefix is this short is compared
# with the other waiting requests, and deprioritised when it shares this many tokens with one of them.
IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD = 32
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32
# The ignore_eos admission path keeps this many free slots per running request in its simulation.
IGNORE_EOS_RESERVE_TOKENS = 1
# LPM: prefix matching every waiting request is too costly for long queues; fall back to FCFS
# (as SGLang, which does not cap dfs-weight).
LPM_MAX_QUEUE_LEN = 128


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: BasePrefixCache, radix_enabled: bool, seed: int = 0,
                 priority: Optional[PriorityPolicy] = None) -> None:
        if policy not in ("fcfs", "lpm", "dfs-weight", "lof", "random", "routing-key"):
            raise ValueError(f"unknown schedule policy {policy!r}")
        # Cache-aware policies are meaningless without a radix tree.
        self.radix: Optional[RadixCache] = (
            tree_cache if radix_enabled and isinstance(tree_cache, RadixCache) else None)
        if policy in ("lpm", "dfs-weight") and self.radix is None:
            policy = "fcfs"
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)
        # With priority scheduling on, fcfs and lof order by priority first (as SGLang; the
        # cache-aware policies and random ignore it).
        self.priority = priority if priority is not None and priority.enabled else None

    def calc_priority(self, waiting_queue: List[Req], running: Sequence[Req] = ()) -> None:
        """Sort the waiting queue in place (`running`: the running batch's requests)."""
        policy = self.policy
        if policy == "lpm" and len(waiting_queue) > LPM_MAX_QUEUE_LEN:
            policy = "fcfs"
        prio = self.priority
        if policy == "fcfs":
            if prio is not None:
                waiting_queue.sort(key=prio.queue_order_key)
            return
        if policy == "lof":
            if prio is not None:
                waiting_queue.sort(key=lambda r: (prio.urgency(r), -r.max_new_tokens))
            else:
                waiting_queue.sort(key=lambda r: -r.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(waiting_queue)
        elif policy == "routing-key":
            self._sort_by_routing_key(waiting_queue, running)
        elif policy == "lpm":
            self._compute_prefix_matches(waiting_queue)
            deprioritized = self._in_batch_duplicates(waiting_queue)
            waiting_queue.sort(key=lambda r: float("inf") if id(r) in deprioritized else -len(r.prefix_indices))
        else:
            self._compute_prefix_matches(waiting_queue)
            waiting_queue[:] = self._dfs_weight_order(waiting_queue)

    @staticmethod
    def _sort_by_routing_key(waiting_queue: List[Req], running: Sequence[Req]) -> None:
        """SGLang's routing-key policy: the requests whose routing_key is the most frequent among
        the running requests first (their KV and adapters are likely warm), the others after them,
        grouped by key; the order is left alone while no running request has a key."""
        counts = Counter(r.routing_key for r in running if r.routing_key)
        if not counts:
            return

        def order(req: Req) -> Tuple[int, int, str]:
            key = req.routing_key
            if key and key in counts:
                return 0, -counts[key], key
            return 1, 0, key or ""

        waiting_queue.sort(key=order)

    def _compute_prefix_matches(self, waiting_queue: List[Req]) -> None:
        for req in waiting_queue:
            req.init_next_round_input(self.tree_cache)

    @staticmethod
    def _in_batch_duplicates(waiting_queue: List[Req]) -> set:
        """Requests that share a long uncached prefix with an earlier waiting request.

        Sharing >= THRESHOLD tokens from the start is the same as having equal first THRESHOLD tokens.
        """
        seen = set()
        dup = set()
        n = IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
        for req in waiting_queue:
            if len(req.prefix_indices) > IN_BATCH_PREFIX_CACHING_CHECK_THRESHOLD:
                continue
            ids = req.fill_ids
            if len(ids) < n:
                continue
            head = tuple(ids[:n])
            if head in seen:
                dup.add(id(req))
            else:
                seen.add(head)
        return dup

    def _dfs_weight_order(self, waiting_queue: List[Req]) -> List[Req]:
        """SGLang's `_sort_by_dfs_weight`: group requests by the tree node where their match ends,
        weigh every node by the requests in its subtree, and emit a depth-first walk that visits
        heavier children first and a node's own requests after all of its children's."""
        assert self.radix is not None, "dfs-weight needs the radix cache"
        root = self.radix.root
        reqs_at: Dict[int, List[Req]] = defaultdict(list)
        weight: Dict[int, int] = defaultdict(int)
        for req in waiting_queue:
            node = req.last_node if req.last_node is not None else root
            reqs_at[id(node)].append(req)
            while node is not None:
                weight[id(node)] += 1
                node = node.parent
        order: List[Req] = []
        # Iterative post-order (a deep tree must not hit the recursion limit): a node is expanded
        # once, pushing itself back as "done" below its children.
        stack: List[Tuple[TreeNode, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.extend(reqs_at.get(id(node), ()))
                continue
            stack.append((node, True))
            children = [c for c in node.children.values() if weight.get(id(c), 0) > 0]
            # Heaviest first (stable on ties, as SGLang's sort): pushed in reverse.
            children.sort(key=lambda c: -weight[id(c)])
            stack.extend((c, False) for c in reversed(children))
        return order


class UncachedPrefixDedup:
    """Keeps two requests that would compute the same uncached tokens out of one prefill.

    Two requests that matched the radix tree at the same node and whose next
    IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD tokens are equal would both compute that shared
    stretch (a group's system prompt) in the same forward: the second one waits instead, and one
    iteration later finds the first one's KV in the tree. The keys of the previous prefill batch are
    carried over, because with overlap scheduling its KV reaches the tree only after the next batch
    has been scheduled.
    """

    def __init__(self, carried_keys: Optional[set] = None) -> None:
        self.keys: set = set(carried_keys or ())
        self.admitted_keys: set = set()

    @staticmethod
    def key(req: Req) -> Optional[tuple]:
        start = len(req.prefix_indices)
        n = IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
        if req.extend_input_len < n:
            return None
        return (id(req.last_node), start, tuple(req.fill_ids[start:start + n]))

    def is_duplicate(self, req: Req) -> bool:
        key = self.key(req)
        return key is not None and key in self.keys

    def admit(self, req: Req) -> None:
        key = self.key(req)
        if key is not None:
            self.keys.add(key)
            self.admitted_keys.add(key)


class AddReqResult(Enum):
    CONTINUE = auto()  # more requests may fit
    NO_TOKEN = auto()  # the KV budget is exhausted
    OTHER = auto()  # the input or chunk budget is exhausted


def max_new_tokens_charge(req: Req) -> int:
    """What admitting `req` reserves for its decoding: all of max_new_tokens, clipped (SGLang),
    even for a retracted request that generated part of it already, so it is not re-admitted
    more eagerly than a fresh one."""
    return min(req.max_new_tokens, CLIP_MAX_NEW_TOKENS_ESTIMATION)


class PrefillAdder:
    """Admits waiting requests into one prefill batch under the token budgets (SGLang's rules).

    Running requests reserve what they may still generate (clipped) times new_token_ratio; an
    admitted request is charged its page-rounded extend plus `max_new_tokens_charge`.
    """

    def __init__(
        self,
        page_size: int,
        tree_cache: Optional[BasePrefixCache],
        token_to_kv_pool_allocator: Any,
        running_reqs: List[Req],
        new_token_ratio: float,
        rem_input_tokens: int,
        rem_chunk_tokens: Optional[int],
        mixed_with_decode_tokens: int = 0,
    ) -> None:
        self.page_size = page_size
        self.tree_cache = tree_cache
        self.allocator = token_to_kv_pool_allocator
        self.running_reqs = running_reqs
        self.new_token_ratio = new_token_ratio
        self.rem_input_tokens = rem_input_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = None if rem_chunk_tokens is None else rem_chunk_tokens - mixed_with_decode_tokens
        self.rem_total_token_offset: float = mixed_with_decode_tokens
        self.cur_rem_token_offset = mixed_with_decode_tokens
        self.rem_total_token_offset += sum(r.remaining_new_tokens_estimate() for r in running_reqs) * new_token_ratio
        # Without prefix sharing, ignore_eos requests go through the stricter simulation.
        self.no_prefix_sharing = tree_cache is None or tree_cache.disable
        self._decode_states: Optional[List[Tuple[float, int]]] = None

        self.can_run_list: List[Req] = []
        self.preempt_list: List[Req] = []  # running requests preempted for this batch
        self._preempted: set = set()
        self.new_chunked_req: Optional[Req] = None
        self.log_input_tokens = 0
        self.log_hit_tokens = 0

    def _pool_tokens(self) -> int:
        evictable = self.tree_cache.evictable_size() if self.tree_cache is not None else 0
        return self.allocator.available_size() + evictable

    @property
    def rem_total_tokens(self) -> float:
        return self._pool_tokens() - self.rem_total_token_offset

    @property
    def cur_rem_tokens(self) -> float:
        return self._pool_tokens() - self.cur_rem_token_offset

    def _ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _floor_page(self, n: int) -> int:
        return n // self.page_size * self.page_size

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _charge(self, prefix_len: int, extend_input_len: int, max_new_tokens: int) -> None:
        extend_input_len = self._ceil_page(extend_input_len)
        self.rem_total_token_offset += extend_input_len + max_new_tokens
        self.cur_rem_token_offset += extend_input_len
        self.rem_input_tokens -= extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_input_len
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_input_len

    def _truncate(self, req: Req, extend_len: int) -> None:
        req.extend_input_len = extend_len
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + extend_len]

    def add_chunked_req(self, req: Req) -> Optional[Req]:
        """Admit the next chunk of the chunked request; return it again if more chunks remain."""
        assert self.rem_chunk_tokens is not None  # a request is chunked only under a chunk budget
        limit = min(self.rem_chunk_tokens, int(self.rem_total_tokens))
        truncated = req.extend_input_len > limit
        if truncated:
            # The budget can be negative (reserved decode room exceeds the pool): never cut
            # below the part already computed.
            self._truncate(req, max(self._floor_page(limit), 0))
            if req.extend_input_len <= 0:
                return req  # nothing fits this round; it stays the chunked request
        self.can_run_list.append(req)
        self._charge(0, req.extend_input_len, 0 if truncated else max_new_tokens_charge(req))
        return req if truncated else None

    @contextmanager
    def _lock_node(self, node: Any):
        # Locking moves the prefix from evictable to protected, which changes the budget.
        if self.tree_cache is None or node is None:
            yield
            return
        self.tree_cache.inc_lock_ref(node)
        try:
            yield
        finally:
            self.tree_cache.dec_lock_ref(node)

    def add_one_req(self, req: Req) -> AddReqResult:
        if req.sampling_params.ignore_eos and self.no_prefix_sharing:
            return self._add_one_req_ignore_eos(req)
        # The fit test is on what the request may still generate; the charge is max_new_tokens.
        total_tokens = req.extend_input_len + req.remaining_new_tokens_estimate()
        input_tokens = self._ceil_page(req.extend_input_len)
        prefix_len = len(req.prefix_indices)
        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if input_tokens >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER

        with self._lock_node(req.last_node):
            if total_tokens >= self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            result = self._admit(req, prefix_len, input_tokens)
            if result is not None:
                return result
            # The admitted request holds its prefix for its whole life.
            if self.tree_cache is not None and req.last_node is not None:
                self.tree_cache.inc_lock_ref(req.last_node)
                req.cache_protected_len = prefix_len
        return self.budget_state()

    def _admit(self, req: Req, prefix_len: int, input_tokens: int) -> Optional[AddReqResult]:
        """Admit whole, or its first chunk; OTHER when not even one page of chunk budget is left.

        A request that cannot be chunked (`can_reuse_kv` false: an encoder's input) is admitted
        whole: past the chunk budget it runs alone, so it waits for the next batch if this one
        already has requests."""
        fits = self.rem_chunk_tokens is None or input_tokens <= self.rem_chunk_tokens
        if not fits and not req.can_reuse_kv and self.can_run_list:
            return AddReqResult.OTHER
        if fits or not req.can_reuse_kv:
            self.can_run_list.append(req)
            self._charge(prefix_len, input_tokens, max_new_tokens_charge(req))
            return None
        assert self.rem_chunk_tokens is not None  # it did not fit: there is a chunk budget
        chunk = self._floor_page(self.rem_chunk_tokens)
        if chunk <= 0:
            return AddReqResult.OTHER
        self._truncate(req, chunk)
        self.can_run_list.append(req)
        self.new_chunked_req = req
        self._charge(prefix_len, chunk, 0)
        return None

    def preempt_to_schedule(self, req: Req, priority: PriorityPolicy, running_set: Preemptible) -> bool:
        """SGLang's preempt_to_schedule: make room for `req` by preempting running requests it
        beats by more than the threshold, least urgent (then newest) first, until what they free
        covers what `req` needs. Nothing is preempted unless it is enough; True when done."""
        candidates = [r for r in running_set.reqs if not r.finished() and id(r) not in self._preempted]
        candidates.sort(key=lambda r: (-priority.urgency(r), -r.queue_time))
        needed = req.extend_input_len + max_new_tokens_charge(req) - self.rem_total_tokens
        victims: List[Req] = []
        for running in candidates:
            if not priority.can_preempt(req, running):
                break  # sorted: no later one can be preempted either
            victims.append(running)
            # Its reservation goes, and the KV it owns (its cached prefix may stay in the tree).
            needed -= self._reservation(running) + running.kv_allocated_len - running.cache_protected_len
            if needed <= 0:
                break
        if not victims or needed > 0:
            return False
        for victim in victims:
            self.rem_total_token_offset -= self._reservation(victim)
            self._preempted.add(id(victim))
        running_set.preempt(victims)
        self.preempt_list.extend(victims)
        self.running_reqs = [r for r in self.running_reqs if id(r) not in self._preempted]
        self._decode_states = None  # the ignore_eos simulation must forget them too
        return True

    def _reservation(self, running: Req) -> float:
        return running.remaining_new_tokens_estimate() * self.new_token_ratio

    def _decode_state(self, req: Req) -> Optional[Tuple[float, int]]:
        """(tokens it may still generate, tokens it holds) in the ignore_eos simulation."""
        ratio = 1.0 if req.sampling_params.ignore_eos else self.new_token_ratio
        left = req.max_new_tokens * ratio - len(req.output_ids)
        if left <= 0:
            return None
        return left, len(req.origin_input_ids) + len(req.output_ids)

    def _add_one_req_ignore_eos(self, req: Req) -> AddReqResult:
        """SGLang's add_one_req_ignore_eos (no radix cache): an ignore_eos request generates all of
        its max_new_tokens, so the ratio estimate would under-reserve. Play the running and the
        admitted requests to their end, shortest first, each freeing what it holds when it
        finishes; admit only if the pool never runs dry meanwhile."""
        input_tokens = self._ceil_page(req.extend_input_len)
        if input_tokens > min(self.cur_rem_tokens, self.rem_total_tokens):
            return AddReqResult.NO_TOKEN
        if input_tokens >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        if self._decode_states is None:
            candidates = [req, *self.running_reqs, *self.can_run_list]
            self._decode_states = sorted(s for s in map(self._decode_state, candidates) if s is not None)
        else:
            state = self._decode_state(req)
            if state is not None:
                bisect.insort(self._decode_states, state)
        free = self.cur_rem_tokens - input_tokens
        freed = 0
        for i, (left, held) in enumerate(self._decode_states):
            live = len(self._decode_states) - i
            if free + freed - left * live <= IGNORE_EOS_RESERVE_TOKENS * live:
                return AddReqResult.NO_TOKEN
            freed += held
        result = self._admit(req, len(req.prefix_indices), input_tokens)
        return result if result is not None else self.budget_state()
