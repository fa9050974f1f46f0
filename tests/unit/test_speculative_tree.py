"""Tree drafts (--speculative-eagle-topk > 1, engine/speculative/tree.py): greedy outputs equal
those without speculation token for token for STANDALONE, EAGLE and EAGLE3 under every scheduling
mode; with the draft = the target every step accepts the whole depth; only the accepted path's KV
survives (the strict idle leak check runs after every workload); the tree-masked attention of each
backend equals a dense masked reference; the tree acceptance keeps the target distribution
(chi-square, p < 1e-6)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch

from sched_utils import Harness
from test_speculative_ngram import VOCAB, _chi2, _chi2_bound, _prompts, _sampling_info, _Tok
from utils_models import build_eagle_head, build_eagle3_head, build_tiny_model

from engine.server_args import ServerArgs, ServerArgsError
from engine.speculative.tree import DraftTree, TreeShape, accept_tree, grow_trees, path_moves

N_NEW = 24


@pytest.fixture(scope="module")
def tiny():
    from engine.builtin_model import ensure_builtin_model

    return ensure_builtin_model()


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A random 2-layer Llama with the built-in model's vocabulary: a poor draft."""
    path = str(tmp_path_factory.mktemp("tree_draft_small"))
    build_tiny_model(path, seed=3, vocab_size=VOCAB, max_position_embeddings=2048)
    return path


@pytest.fixture(scope="module")
def eagle_pair(tmp_path_factory):
    """A random 2-layer Llama target, a random EAGLE head and a random EAGLE3 head for it."""
    target = str(tmp_path_factory.mktemp("tree_eagle_target"))
    build_tiny_model(target, seed=2, vocab_size=VOCAB, max_position_embeddings=2048, num_hidden_layers=4)
    head = build_eagle_head(str(tmp_path_factory.mktemp("tree_eagle_head")), target, seed=1)
    head3 = build_eagle3_head(str(tmp_path_factory.mktemp("tree_eagle3_head")), target, seed=1)
    return target, head, head3


def _harness(target: str, draft: str = None, algo: str = "STANDALONE", steps: int = 3, topk: int = 2,
             tokens: int = 6, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    total = kwargs.pop("max_total_tokens", 4096)
    worker_args = ServerArgs(model_path=target, device="cpu", max_total_tokens=total,
                             page_size=kwargs.get("page_size", 1), max_running_requests=16)
    spec = dict(speculative_algorithm=algo, speculative_draft_model_path=draft, speculative_num_steps=steps,
                speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens,
                speculative_batch_size_threshold=1024) if draft is not None else {}
    return Harness(worker=TpModelWorker(worker_args), tokenizer=_Tok(), max_total_tokens=total, **spec, **kwargs)


def _run(target: str, draft: str, prompts: List[List[int]], sampling: Dict = None, **kwargs
         ) -> Tuple[Harness, List[List[int]], List[str]]:
    h = _harness(target, draft, **kwargs)
    params = dict(max_new_tokens=N_NEW, ignore_eos=True)
    params.update(sampling or {})
    rids = [h.submit(p, **params) for p in prompts]
    h.run_until_idle()  # ends with the strict idle leak check
    return h, [h.outputs[r].output_ids for r in rids], rids


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16),
    "chunked-mixed": dict(chunked_prefill_size=8),
    "retract": dict(max_total_tokens=192),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_standalone_small_draft_keeps_greedy_outputs(tiny, small_draft, name):
    prompts = _prompts()
    _, plain, _ = _run(tiny, None, prompts, **CONFIGS[name])
    h, spec, _ = _run(tiny, small_draft, prompts, **CONFIGS[name])
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    assert state["spec_accepted_tokens"] < state["spec_draft_tokens"]


def _waves(h: Harness, prompts: List[List[int]], sampling: Dict) -> List[List[int]]:
    """The prompts, then each prompt plus the first half of its output (radix-cached prefixes that
    include verified tokens)."""
    rids = [h.submit(p, **sampling) for p in prompts]
    h.run_until_idle()
    first = [h.outputs[r].output_ids for r in rids]
    rids2 = [h.submit(p + o[: len(o) // 2], **sampling) for p, o in zip(prompts, first)]
    h.run_until_idle()
    return first + [h.outputs[r].output_ids for r in rids2]


@pytest.mark.parametrize("topk", [2, 3, 4])
@pytest.mark.parametrize("name", ["default", "page16", "chunked-mixed"])
def test_draft_equal_to_target_accepts_the_whole_depth(tiny, topk, name):
    """The draft is the target, two steps, the full tree (every candidate verified, so the target's
    greedy path is always in it): every verify step accepts 2 drafts plus the bonus, which holds only
    if the draft's tree mask and positions, the target's, the move of the accepted path's K/V and
    the draft's catch-up over it are right."""
    prompts = _prompts()
    sampling = dict(max_new_tokens=N_NEW, ignore_eos=True)
    plain = _waves(_harness(tiny, **CONFIGS[name]), prompts, sampling)
    h = _harness(tiny, tiny, steps=2, topk=topk, tokens=1 + topk + topk * topk, **CONFIGS[name])
    assert _waves(h, prompts, sampling) == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0
    if name != "chunked-mixed":  # no mixed decode steps: 23 tokens = 7 steps of 3, then one cut to 2
        assert state["spec_verify_ct"] == 8 * 2 * len(prompts), state
        assert state["avg_spec_accept_length"] == pytest.approx(23 / 8)
    else:
        assert state["spec_accepted_tokens"] >= 2 * state["spec_verify_ct"] - 2 * 2 * len(prompts), state
