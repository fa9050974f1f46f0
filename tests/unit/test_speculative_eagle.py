"""EAGLE speculative decoding (--speculative-algorithm EAGLE, engine/speculative/eagle.py, the head
in models/llama_eagle.py, checkpoints in EAGLE's format from utils_models.build_eagle_head):
greedy outputs equal those without speculation under every scheduling mode with a random head; a
head built to predict exactly what its target predicts has every draft accepted; the target's
features the head reads are the target's final hidden states at their positions (transformers'
oracle); refusals at start-up."""

from __future__ import annotations

import os
from typing import Dict, List, Tuple

import pytest
import torch

from sched_utils import Harness, fast_lane
from test_speculative_ngram import VOCAB, _prompts
from utils_models import LetterTokenizer, build_eagle_head, build_tiny_model

from engine.server_args import ServerArgs, ServerArgsError

N_NEW = 24


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """A random 2-layer Llama target and a random EAGLE head for it (exactness only)."""
    target = str(tmp_path_factory.mktemp("eagle_target"))
    hf = build_tiny_model(target, seed=2, vocab_size=VOCAB, max_position_embeddings=2048)
    head = build_eagle_head(str(tmp_path_factory.mktemp("eagle_head")), target, seed=1)
    return target, head, hf


@pytest.fixture(scope="module")
def exact_pair(tmp_path_factory):
    """A target whose one layer adds nothing (o_proj, down_proj zero) and whose final norm is all
    ones, so its next token is argmax(lm_head(embed(t))) (the norm only scales); the identity head
    outputs embed(t) for the token it reads, so it predicts exactly the target's tokens."""
    from safetensors.torch import load_file, save_file

    target = str(tmp_path_factory.mktemp("eagle_exact_target"))
    build_tiny_model(target, seed=2, vocab_size=VOCAB, max_position_embeddings=2048, num_hidden_layers=1)
    file = os.path.join(target, "model.safetensors")
    weights = load_file(file)
    for name in weights:
        if "o_proj" in name or "down_proj" in name:
            weights[name] = torch.zeros_like(weights[name])
    weights["model.norm.weight"] = torch.ones_like(weights["model.norm.weight"])
    save_file(weights, file, metadata={"format": "pt"})
    head = build_eagle_head(str(tmp_path_factory.mktemp("eagle_exact_head")), target, identity=True)
    return target, head


def _harness(target: str, head: str = None, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    total = kwargs.pop("max_total_tokens", 4096)
    worker_args = ServerArgs(model_path=target, device="cpu", max_total_tokens=total,
                             page_size=kwargs.get("page_size", 1), max_running_requests=16)
    # Every batch verifies (the CPU default stops speculating past 4 requests, the switch where drafts do not pay).
    spec = dict(speculative_algorithm=kwargs.pop("speculative_algorithm", "EAGLE"), speculative_draft_model_path=head,
                speculative_batch_size_threshold=1024,
                disable_speculative_adaptive=True) if head is not None else {}
    return Harness(worker=TpModelWorker(worker_args), tokenizer=LetterTokenizer(), max_total_tokens=total, **spec, **kwargs)


def _run(target: str, head: str, prompts: List[List[int]], sampling: Dict = None, **kwargs
         ) -> Tuple[Harness, List[List[int]]]:
    h = _harness(target, head, **kwargs)
    params = dict(max_new_tokens=N_NEW, ignore_eos=True)
    params.update(sampling or {})
    rids = [h.submit(p, **params) for p in prompts]
    h.run_until_idle()  # ends with the strict idle leak check
    return h, [h.outputs[r].output_ids for r in rids]


CONFIGS = {
    "default": {},
    "no-radix": dict(disable_radix_cache=True),
    "page16": dict(page_size=16),
    "chunked-mixed": dict(chunked_prefill_size=8),
    "page16-chunked": dict(page_size=16, chunked_prefill_size=16),
    "retract": dict(max_total_tokens=160),
}


# Every mode in both loops: with overlap, plain steps are pipelined and a verify step settles first.
MODES = [(name, overlap) for name in CONFIGS for overlap in (False, True)]


@pytest.mark.parametrize("name,overlap", fast_lane(MODES, {("default", False), ("default", True)}))
def test_random_head_keeps_greedy_outputs(random_pair, name, overlap):
    target, head, _ = random_pair
    prompts = _prompts()
    _, plain = _run(target, None, prompts, overlap=overlap, **CONFIGS[name])
    h, spec = _run(target, head, prompts, overlap=overlap, **CONFIGS[name])
    assert spec == plain
    assert h.scheduler.internal_state()["spec_verify_ct"] > 0


@pytest.mark.parametrize("name,overlap", fast_lane([(n, o) for n in ("default", "page16", "chunked-mixed")
                                                   for o in (False, True)],
                                                  {("default", False), ("page16", False), ("chunked-mixed", False),
                                                   ("chunked-mixed", True)}))
def test_exact_head_has_every_draft_accepted(exact_pair, name, overlap):
    target, head = exact_pair
    prompts = _prompts()
    _, plain = _run(target, None, prompts, overlap=overlap, **CONFIGS[name])
    h, spec = _run(target, head, prompts, overlap=overlap, **CONFIGS[name])
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state


def test_head_reads_the_targets_features_at_every_committed_position(random_pair):
    """Mid-run and after radix-cached reuse: the feature kept for each committed slot is the
    target's final hidden state at that position (transformers, float32), so the head extends read
    the right features."""
    target, head, hf = random_pair
    h = _harness(target, head)
    prompts = _prompts()[:3]
    for p in prompts:
        h.submit(p, max_new_tokens=N_NEW, ignore_eos=True)
    for _ in range(5):
        h.step()
    drafter = h.scheduler.spec.drafter
    table = h.scheduler.req_to_token_pool.req_to_token
    checked = 0
    for req in h.scheduler.running_batch.reqs:
        tokens = req.origin_input_ids + req.output_ids
        committed = req.kv_allocated_len  # the newest token has no K/V yet
        with torch.inference_mode():
            expected = hf(torch.tensor([tokens[:committed]]), output_hidden_states=True).hidden_states[-1][0]
        slots = table[req.req_pool_idx, :committed].to(torch.int64)
        torch.testing.assert_close(drafter.features[slots].float(), expected, atol=2e-4, rtol=2e-4)
        checked += 1
    assert checked == len(prompts)
    h.run_until_idle()


def test_abort_and_stops_keep_outputs(random_pair):
    target, head, _ = random_pair
    prompts = _prompts()
    _, base = _run(target, None, prompts)
    stop_id = base[3][10]
    _, plain = _run(target, None, prompts, dict(stop_token_ids=[stop_id], ignore_eos=False))
    _, spec = _run(target, head, prompts, dict(stop_token_ids=[stop_id], ignore_eos=False))
    assert spec == plain and len(spec[3]) < N_NEW
    h = _harness(target, head)
    keep = h.submit(prompts[3], max_new_tokens=N_NEW, ignore_eos=True)
    victim = h.submit(prompts[3], max_new_tokens=200, ignore_eos=True, stream=True)
    for _ in range(4):
        h.step()
    h.abort(victim)
    h.run_until_idle()  # the strict leak check
    assert h.outputs[victim].finished_reason["type"] == "abort"
    assert h.outputs[keep].output_ids == base[3]


def test_sampled_requests_run_beside_greedy_ones(exact_pair):
    target, head = exact_pair
    prompts = _prompts()
    _, plain = _run(target, None, prompts)
    h = _harness(target, head)
    greedy = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in prompts]
    sampled = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True, temperature=1.0) for p in prompts]
    h.run_until_idle()
    assert [h.outputs[r].output_ids for r in greedy] == plain
    assert all(len(h.outputs[r].output_ids) == N_NEW for r in sampled)


def test_refusals(random_pair, tmp_path):
    target, head, _ = random_pair
    args = ServerArgs(device="cpu", speculative_algorithm="EAGLE", speculative_draft_model_path=head)
    assert (args.speculative_num_steps, args.speculative_eagle_topk, args.speculative_num_draft_tokens) == (3, 1, 4)
    with pytest.raises(ServerArgsError, match="needs --speculative-draft-model-path"):
        ServerArgs(device="cpu", speculative_algorithm="EAGLE")
    # An EAGLE-1 head given to EAGLE3: refused when the scheduler builds the drafter.
    with pytest.raises(ValueError, match="is not an EAGLE3 head"):
        _harness(target, head, speculative_algorithm="EAGLE3")
    # A plain model given as the head: refused when the scheduler builds the drafter.
    with pytest.raises(ValueError, match="is not an EAGLE head"):
        _harness(target, target)
