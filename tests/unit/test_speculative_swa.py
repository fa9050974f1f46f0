"""Draft-model speculation (STANDALONE, EAGLE) on a sliding-window target with the hybrid KV pool
(mem_cache/swa_pool.py): the draft keeps its own one-pool K/V under the target's full slots, the target's
windowed layers get windowed pages for the drafts too, and rejected drafts give back the pages of both
pools (keep_verified through the one free path). Greedy outputs equal transformers' (what speculation off
gives, tests/unit/test_swa_models.py) far past the window (window 16, prompts of 100-260 tokens) with the
radix cache on and off, at page sizes 1 and 16; the strict idle leak check covers both pools after every
workload."""

from __future__ import annotations

from typing import List

import pytest
import torch

from sched_utils import Harness
from utils_models import LetterTokenizer, TINY_SWA, build_eagle_head, build_tiny_model, hf_greedy

from engine.server_args import ServerArgs

N_NEW = 24
VOCAB = 512


def _prompts() -> List[List[int]]:
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (100, 173, 260)]
    # Text that repeats: a draft as the target, or a random one, proposes some accepted tokens.
    prompts.append((prompts[0][:40] * 4)[:150])
    return prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A Mistral-shaped target (every layer windowed), its transformers greedy outputs, a poor random draft
    with its vocabulary and a random EAGLE head for it."""
    path = str(tmp_path_factory.mktemp("swa_target"))
    hf = build_tiny_model(path, "mistral", seed=11, vocab_size=VOCAB, **TINY_SWA["mistral"])
    expected = [hf_greedy(hf, p, N_NEW) for p in _prompts()]
    draft = str(tmp_path_factory.mktemp("swa_draft"))
    build_tiny_model(draft, seed=3, vocab_size=VOCAB, max_position_embeddings=1024)
    head = build_eagle_head(str(tmp_path_factory.mktemp("swa_eagle_head")), path, seed=1)
    return path, expected, draft, head


def _run(target: str, draft: str, algo: str, page: int, radix: bool, overlap: bool = False, topk: int = 1,
         tree_tokens: int = 7) -> Harness:
    from engine.mem_cache.swa_pool import SWATokenToKVPoolAllocator
    from engine.scheduler.tp_worker import TpModelWorker

    # As one server's arguments: the worker's pool sees the speculation too.
    spec = dict(speculative_algorithm=algo, speculative_draft_model_path=draft, speculative_num_steps=3,
                speculative_batch_size_threshold=1024, disable_speculative_adaptive=True)
    if topk > 1:  # a tree: the accepted path's K/V are moved in both pools
        spec.update(speculative_eagle_topk=topk, speculative_num_draft_tokens=tree_tokens)
    common = dict(page_size=page, disable_radix_cache=not radix, chunked_prefill_size=64, max_running_requests=4)
    worker = TpModelWorker(ServerArgs(model_path=target, device="cpu", max_total_tokens=4096, **common, **spec))
    allocator = worker.model_runner.token_to_kv_pool_allocator
    assert isinstance(allocator, SWATokenToKVPoolAllocator) and allocator.swa.size < 4096
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=4096, overlap=overlap, **common, **spec)
    return h


def _check(h: Harness, expected: List[List[int]], label) -> None:
    prompts = _prompts()
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
    h.run_until_idle()  # ends with the strict idle leak check (both pools, and the SWA radix cache)
    assert [h.outputs[r].output_ids for r in rids] == expected, label
    state = h.scheduler.internal_state()
    # Drafts were verified and some rejected: their pages of both pools went back (keep_verified).
    assert state["spec_verify_ct"] > 0 and state["spec_draft_tokens"] > state["spec_accepted_tokens"], state
    allocator = h.scheduler.kv.token_to_kv_pool_allocator
    cache = h.scheduler.kv.state()
    assert cache["swa_available_tokens"] + cache["swa_evictable_tokens"] == allocator.swa.size
    assert cache["available_tokens"] + cache["evictable_tokens"] == 4096


@pytest.mark.parametrize("page,radix", [(1, True), (1, False), (16, True), (16, False)])
@pytest.mark.parametrize("algo", ["STANDALONE", "EAGLE"])
@pytest.mark.slow  # several engines, each run past the window with drafts
def test_draft_model_speculation_on_the_hybrid_pool_keeps_greedy_outputs(target, algo, page, radix):
    path, expected, draft, head = target
    h = _run(path, draft if algo == "STANDALONE" else head, algo, page, radix)
    _check(h, expected, (algo, page, radix))


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.slow
def test_target_as_its_own_draft_accepts_drafts_past_the_window(target, page):
    """The windowed target as its own STANDALONE draft (its one-pool K/V under the target's slots, its
    windowed layers reading every slot): the drafts equal the target's tokens, so most are accepted,
    which holds only if the draft's K/V follow the target's past the window; under overlap."""
    path, expected, _, _ = target
    h = _run(path, path, "STANDALONE", page, radix=True, overlap=True)
    prompts = _prompts()
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected, page
    state = h.scheduler.internal_state()
    assert state["spec_accepted_tokens"] * 10 >= state["spec_draft_tokens"] * 9, state


@pytest.mark.parametrize("page,radix", [(1, True), (16, False)])
@pytest.mark.slow
def test_tree_drafts_on_the_hybrid_pool_keep_greedy_outputs(target, page, radix):
    """Tree drafts (topk 2) on the windowed target with the hybrid pool: each draft's kernel row sees its
    own window, and the accepted path's K/V move in the windowed pool as in the full one."""
    path, expected, draft, _ = target
    _check(_run(path, draft, "STANDALONE", page, radix, topk=2), expected, ("tree", page, radix))
    # The target as its own draft, the whole tree verified (2 + 2 * 4 drafts): its greedy path is always
    # in it, so nearly every step accepts the full depth of 3 (a request's last step may be cut).
    h = _run(path, path, "STANDALONE", page, radix, topk=2, overlap=True, tree_tokens=11)
    rids = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in _prompts()]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in rids] == expected, page
    state = h.scheduler.internal_state()
    assert state["spec_accepted_tokens"] * 10 >= 3 * state["spec_verify_ct"] * 9, state
