"""The SWA radix cache through the real scheduler (issue 39): hybrid sliding-window models with the radix
cache on get the hybrid pool and SWARadixCache. Greedy tokens equal transformers' far past the window
(window 16, prompts of 100-200 tokens) when prefixes longer than the window are reused: a prompt sharing
most of an earlier one, a multi-turn continuation (prompt + answer + more) after the first finished, an
identical prompt; under chunked prefill, overlap, windowed-pool pressure (tombstones), a small full pool
(eviction and retraction), and an abort. The strict idle leak check covers both pools and the cache."""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from sched_utils import Harness
from utils_models import LetterTokenizer, TINY_SWA, build_tiny_model, hf_greedy

from engine.server_args import ServerArgs

N_NEW = 20
RADIX = dict(chunked_prefill_size=32, max_prefill_tokens=64, max_running_requests=4)


def _prompts() -> Dict[str, List[int]]:
    gen = torch.Generator().manual_seed(5)
    first = torch.randint(0, 512, (130,), generator=gen).tolist()
    return {
        "first": first,
        "shares_100": first[:100] + torch.randint(0, 512, (30,), generator=gen).tolist(),
        "other": torch.randint(0, 512, (110,), generator=gen).tolist(),
    }


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def model(request, tmp_path_factory):
    arch = request.param
    path = str(tmp_path_factory.mktemp(arch))
    hf = build_tiny_model(path, arch, seed=7, tie_word_embeddings=arch.startswith("gemma"), **TINY_SWA[arch])
    prompts = _prompts()
    expected = {name: hf_greedy(hf, p, N_NEW) for name, p in prompts.items()}
    # The second turn: the first prompt, its answer and a few more tokens.
    prompts["turn2"] = prompts["first"] + expected["first"] + [1, 2, 3, 4, 5]
    expected["turn2"] = hf_greedy(hf, prompts["turn2"], N_NEW)
    return arch, path, prompts, expected


def _harness(path: str, total: int, overlap: bool, **extra) -> Harness:
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator
    from engine.mem_cache.swa_radix_cache import SWARadixCache
    from engine.scheduler.tp_worker import TpModelWorker

    args = dict(RADIX, **extra)
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=total, **args))
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=total, overlap=overlap, **args)
    assert isinstance(worker.model_runner.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    assert isinstance(h.scheduler.kv.tree_cache, SWARadixCache)
    return h


def _tombstones(h: Harness) -> int:
    from engine.mem_cache.swa_radix_cache import SWATreeNode

    cache = h.scheduler.kv.tree_cache
    return sum(len(n.key) for n in cache._nodes() if isinstance(n, SWATreeNode) and n.swa_tombstone)


def _floor(n: int, page: int) -> int:
    return n - n % page


@pytest.mark.parametrize("overlap,page", [(False, 1), (True, 1), (False, 16), (True, 16)])
def test_prefixes_longer_than_the_window_are_reused_exactly(model, overlap, page):
    """Page 16: the tree holds whole pages, so reuse stops at the last whole page of each match."""
    arch, path, prompts, expected = model
    h = _harness(path, 4096, overlap, page_size=page)
    allocator = h.scheduler.kv.token_to_kv_pool_allocator
    first = h.submit(prompts["first"], max_new_tokens=N_NEW, ignore_eos=True)
    shares = h.submit(prompts["shares_100"], max_new_tokens=N_NEW, ignore_eos=True)
    h.run_until_idle()
    assert h.outputs[first].output_ids == expected["first"], arch
    assert h.outputs[shares].output_ids == expected["shares_100"], arch
    # The second waited for the first's prompt (same head, being computed) and reused 100 tokens of it.
    assert h.outputs[shares].cached_tokens == _floor(100, page)
    # After both finished: a second turn of the first, and the first's prompt again.
    turn2 = h.submit(prompts["turn2"], max_new_tokens=N_NEW, ignore_eos=True)
    again = h.submit(prompts["first"], max_new_tokens=N_NEW, ignore_eos=True)
    h.run_until_idle()
    assert h.outputs[turn2].output_ids == expected["turn2"], arch
    assert h.outputs[again].output_ids == expected["first"], arch
    # The whole first turn (its answer's windowed K/V is gone except the last window: tombstones).
    assert h.outputs[turn2].cached_tokens == _floor(len(prompts["first"]) + N_NEW - 1, page)
    assert h.outputs[again].cached_tokens == _floor(len(prompts["first"]) - 1, page)
    # Page 16: the answer's 20 tokens leave no whole page behind the window, so no tombstone here.
    assert _tombstones(h) > 0 if page == 1 else _tombstones(h) == 0
    assert allocator.swa.size < 4096  # the windowed layers' pool is the smaller one
    state = h.scheduler.kv.state()
    assert state["swa_available_tokens"] + state["swa_evictable_tokens"] == allocator.swa.size
    assert state["swa_protected_tokens"] == 0


@pytest.mark.parametrize("overlap,page", [(False, 1), (True, 1), (True, 16)])
@pytest.mark.slow  # seven requests through a pool that keeps evicting
def test_pool_pressure_evicts_both_pools_and_keeps_outputs(model, overlap, page, caplog, monkeypatch):
    """A full pool of 350 tokens and a windowed one of a few hundred: cached prompts lose their windowed
    K/V (tombstones) and their full K/V while new ones arrive, a request is retracted and prefilled
    again; every output still equals transformers'; both pools whole at idle (the strict check)."""
    from engine.mem_cache.swa_radix_cache import SWARadixCache

    arch, path, prompts, expected = model
    freed = {"full": 0, "windowed": 0}
    evict, evict_windowed = SWARadixCache.evict, SWARadixCache.evict_windowed

    def count_full(cache, n):
        got = evict(cache, n)
        freed["full"] += got
        return got

    def count_windowed(cache, n):
        got = evict_windowed(cache, n)
        freed["windowed"] += got
        return got

    monkeypatch.setattr(SWARadixCache, "evict", count_full)
    monkeypatch.setattr(SWARadixCache, "evict_windowed", count_windowed)
    # Page 16: two running requests and a larger full pool, or the windowed bound (two more pages per
    # request) would not be smaller than the full pool and there would be one pool.
    total = 350 if page == 1 else 384
    extra = {} if page == 1 else dict(max_running_requests=2)
    h = _harness(path, total, overlap, schedule_conservativeness=0.3, page_size=page, **extra)
    allocator = h.scheduler.kv.token_to_kv_pool_allocator
    names = ["first", "other", "shares_100", "turn2", "first", "other", "shares_100"]
    rids = []
    with caplog.at_level("WARNING"):
        for name in names:
            rids.append((name, h.submit(prompts[name], max_new_tokens=N_NEW, ignore_eos=True)))
            for _ in range(3):
                h.step()
        h.run_until_idle()
    for name, rid in rids:
        assert h.outputs[rid].output_ids == expected[name], (arch, name)
    # At page 16 two requests run and the windowed pool's bound has room for them: no retraction and no
    # windowed eviction here (test_swa_radix_cache.py tombstones whole pages by hand).
    assert ("Retract requests" in caplog.text) == (page == 1)
    assert freed["full"] > 0 and (freed["windowed"] > 0) == (page == 1)
    assert allocator.available_size() + h.scheduler.kv.tree_cache.evictable_size() == total


@pytest.mark.parametrize("page", [1, 16])
def test_abort_and_retract_release_both_pools(model, page):
    """An abort mid-prefill and a retraction of everything mid-decode: both pools and the cache balance
    (the strict idle check), and the retracted request still ends as transformers' does."""
    arch, path, prompts, expected = model
    h = _harness(path, 4096, False, page_size=page)
    aborted = h.submit(prompts["other"], max_new_tokens=N_NEW, ignore_eos=True)
    kept = h.submit(prompts["first"], max_new_tokens=N_NEW, ignore_eos=True)
    h.step()
    h.abort(aborted)
    for _ in range(8):
        h.step()
    h.scheduler.settle()
    h.scheduler.retract_all()
    h.run_until_idle()
    assert h.outputs[aborted].finished_reason["type"] == "abort"
    assert h.outputs[kept].output_ids == expected["first"], arch


@pytest.mark.parametrize("page", [1, 16])
def test_ngram_speculation_with_both_pools(model, page):
    """NGRAM speculative decoding on the hybrid pool: drafts take slots of both pools, rejected ones free
    both, and outputs equal transformers' (greedy verification is lossless); prompts that repeat their
    text make the drafter propose (and some drafts be accepted); the strict idle check covers both pools."""
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator
    from engine.scheduler.tp_worker import TpModelWorker

    arch, path, prompts, expected = model
    spec = dict(RADIX, speculative_algorithm="NGRAM", speculative_batch_size_threshold=1024,
                disable_speculative_adaptive=True, page_size=page)
    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=4096, **spec))
    assert isinstance(worker.model_runner.token_to_kv_pool_allocator, SWATokenToKVPoolAllocator)
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=4096, **spec)
    names = ["first", "shares_100", "turn2"]
    rids = [h.submit(prompts[name], max_new_tokens=N_NEW, ignore_eos=True) for name in names]
    h.run_until_idle()
    for name, rid in zip(names, rids):
        assert h.outputs[rid].output_ids == expected[name], (arch, name)
    state = h.scheduler.internal_state()
    # Drafts were proposed and some rejected: their slots of both pools went back (keep_verified).
    assert state["spec_verify_ct"] > 0 and state["spec_draft_tokens"] > state["spec_accepted_tokens"], state
