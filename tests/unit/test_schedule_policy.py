"""The order every schedule policy gives the waiting queue (SchedulePolicy.calc_priority).

Each test fills a scheduler's waiting queue without running it, sorts it with the policy and
compares with the order SGLang's `schedule_policy.py` defines for that policy.
"""

from __future__ import annotations

from typing import List

import pytest

from engine.scheduler.schedule_policy import LPM_MAX_QUEUE_LEN
from sched_utils import Harness


def prompt(n: int, start: int = 0) -> List[int]:
    return [(start + i) % 900 for i in range(n)]


def sorted_rids(h: Harness) -> List[str]:
    """Move the submitted requests into the waiting queue and sort it with the policy."""
    s = h.scheduler
    s.process_input_requests(s.recv_requests())
    s.prefill.policy.calc_priority(s.waiting_queue)
    return [r.rid for r in s.waiting_queue]


def cache(h: Harness, *prompts: List[int]) -> None:
    """Run `prompts` to completion so that they sit in the radix tree."""
    for p in prompts:
        h.submit(p, max_new_tokens=1)
    h.run_until_idle()


def test_fcfs_keeps_arrival_order_even_with_cached_prefixes():
    h = Harness(schedule_policy="fcfs")
    shared = prompt(64, 300)
    cache(h, shared + [1])
    rids = [h.submit(prompt(10, 10)), h.submit(shared + [2]), h.submit(prompt(20, 50))]
    assert sorted_rids(h) == rids


def test_lpm_orders_by_cached_prefix_length():
    h = Harness(schedule_policy="lpm")
    long_stem, short_stem = prompt(96, 100), prompt(40, 500)
    cache(h, long_stem + [1], short_stem + [1])
    none = h.submit(prompt(30, 700))
    short = h.submit(short_stem + [2, 3])
    long = h.submit(long_stem + [2, 3])
    assert sorted_rids(h) == [long, short, none]


def test_lpm_in_batch_prefix_dedup_defers_the_second_sharer():
    # Neither is cached, both share 64 tokens: the second goes behind everything else so that it
    # can reuse the first one's prefix once that is cached.
    h = Harness(schedule_policy="lpm")
    common = prompt(64, 300)
    first = h.submit(common + [7] * 10)
    other = h.submit(prompt(20, 700))
    second = h.submit(common + [8] * 10)
    assert sorted_rids(h) == [first, other, second]


def test_lpm_in_batch_dedup_ignores_requests_with_a_long_cached_match():
    # Above the check threshold (32 cached tokens) a request is never deferred.
    h = Harness(schedule_policy="lpm")
    common = prompt(64, 300)
    cache(h, common + [1])
    a = h.submit(common + [7] * 10)
    b = h.submit(common + [8] * 10)
    assert sorted_rids(h) == [a, b]


def test_lpm_falls_back_to_fcfs_on_long_queues():
    h = Harness(schedule_policy="lpm", max_running_requests=1)
    shared = prompt(64, 300)
    cache(h, shared + [1])
    rids = [h.submit(prompt(5, i)) for i in range(LPM_MAX_QUEUE_LEN)] + [h.submit(shared + [2])]
    assert sorted_rids(h) == rids


def build_dfs_tree(h: Harness):
    """A tree root -> S -> {A, B}, root -> T, and six waiting requests that end their match in it."""
    stem, a_branch, b_branch, t_prompt = prompt(40, 100), prompt(20, 300), prompt(20, 500), prompt(30, 700)
    cache(h, stem + a_branch, stem + b_branch, t_prompt)
    rids = {
        "root": h.submit(prompt(10, 850)),  # matches nothing
        "A": h.submit(stem + a_branch[:10] + [1, 2]),  # match ends inside A
        "B1": h.submit(stem + b_branch[:12] + [3, 4]),
        "B2": h.submit(stem + b_branch[:12] + [5, 6]),
        "T": h.submit(t_prompt[:15] + [7]),
        "S": h.submit(stem + [8, 9]),  # match ends at S
    }
    return rids


def test_dfs_weight_visits_heavier_subtrees_first_and_children_before_their_parent():
    # SGLang's _get_dfs_priority: children by descending weight (requests in their subtree), each
    # child's subtree before the node's own requests. Weights: S 4 (B 2, A 1, S 1), T 1, root 1.
    h = Harness(schedule_policy="dfs-weight")
    rids = build_dfs_tree(h)
    assert sorted_rids(h) == [rids[k] for k in ("B1", "B2", "A", "S", "T", "root")]


def test_dfs_weight_does_not_fall_back_to_fcfs_on_long_queues():
    # SGLang only turns LPM into FCFS for long queues; dfs-weight always sorts.
    h = Harness(schedule_policy="dfs-weight", max_running_requests=1)
    shared = prompt(64, 300)
    cache(h, shared + [1])
    fresh = [h.submit(prompt(5, i)) for i in range(LPM_MAX_QUEUE_LEN)]
    hit = h.submit(shared + [2])
    assert sorted_rids(h) == [hit] + fresh


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_cache_aware_policies_are_fcfs_without_the_radix_cache(policy):
    h = Harness(schedule_policy=policy, disable_radix_cache=True)
    rids = [h.submit(prompt(10 + i, 40 * i)) for i in range(4)]
    assert h.scheduler.prefill.policy.policy == "fcfs"
    assert sorted_rids(h) == rids


def test_lof_longest_output_first_stable_on_ties():
    h = Harness(schedule_policy="lof")
    a = h.submit(prompt(5, 0), max_new_tokens=4)
    b = h.submit(prompt(5, 10), max_new_tokens=40)
    c = h.submit(prompt(5, 20), max_new_tokens=4)
    d = h.submit(prompt(5, 30), max_new_tokens=100)
    assert sorted_rids(h) == [d, b, a, c]


def test_random_is_a_permutation_that_varies_with_the_seed():
    orders = set()
    for seed in range(8):
        h = Harness(schedule_policy="random", random_seed=seed)
        rids = [h.submit(prompt(5, 10 * i)) for i in range(8)]
        order = sorted_rids(h)
        assert sorted(order) == sorted(rids)
        orders.add(tuple(order))
    assert len(orders) > 1


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random"])
def test_every_policy_serves_every_request_with_the_same_greedy_outputs(policy):
    def run(p: str):
        h = Harness(schedule_policy=p, max_prefill_tokens=64)
        rids = build_dfs_tree(h)
        h.run_until_idle()
        return {k: h.outputs[r].output_ids for k, r in rids.items()}

    assert run(policy) == run("fcfs")


def test_routing_key_runs_the_keys_most_frequent_among_the_running_requests_first():
    # SGLang's routing-key policy: keys counted over the running batch, the most frequent first;
    # keys not running (and no key) after them, grouped by key; arrival order while nothing runs.
    h = Harness(schedule_policy="routing-key")
    waiting = [h.submit(prompt(8, 10 * i), routing_key=key, max_new_tokens=50)
               for i, key in enumerate(["c", "b", None, "a", "b", "d"])]
    assert sorted_rids(h) == waiting  # nothing runs: the queue keeps its order
    h = Harness(schedule_policy="routing-key")
    for i, key in enumerate(["a", "a", "b"]):
        h.submit(prompt(8, 200 + 10 * i), routing_key=key, max_new_tokens=50)
    h.step()
    h.step()
    running = h.scheduler.running_batch.reqs
    assert sorted(r.routing_key for r in running) == ["a", "a", "b"]
    c, b1, none, a, b2, d = [h.submit(prompt(8, 10 * i), routing_key=key)
                             for i, key in enumerate(["c", "b", None, "a", "b", "d"])]
    s = h.scheduler
    s.process_input_requests(s.recv_requests())
    s.prefill.policy.calc_priority(s.waiting_queue, running)
    assert [r.rid for r in s.waiting_queue] == [a, b1, b2, none, c, d]
