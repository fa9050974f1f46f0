"""EAGLE3 speculative decoding (--speculative-algorithm EAGLE3: engine/speculative/eagle.py with the
head of models/llama_eagle3.py, checkpoints in EAGLE3's format from utils_models.build_eagle3_head):
the target captures the auxiliary hidden states the head reads (transformers' oracle); greedy outputs
equal those without speculation under every scheduling mode with a random head over a draft
vocabulary mapped by d2t; sampled outputs keep the target's distribution (chi-square); refusals."""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import pytest
import torch

from sched_utils import Harness
from test_speculative_ngram import VOCAB, _chi2, _chi2_bound, _prompts
from utils_models import LetterTokenizer, build_eagle3_head, build_tiny_model, repeat_target

from engine.server_args import ServerArgs

N_NEW = 24


@pytest.fixture(scope="module")
def random_pair(tmp_path_factory):
    """A random 4-layer Llama target and a random EAGLE3 head for it over half its vocabulary,
    default auxiliary layers (the inputs of layers 2, 2 and 1)."""
    target = str(tmp_path_factory.mktemp("eagle3_target"))
    hf = build_tiny_model(target, seed=2, vocab_size=VOCAB, max_position_embeddings=2048, num_hidden_layers=4)
    head = build_eagle3_head(str(tmp_path_factory.mktemp("eagle3_head")), target, seed=1,
                             draft_vocab_size=VOCAB // 2)
    return target, head, hf


def _harness(target: str, head: str = None, **kwargs) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    total = kwargs.pop("max_total_tokens", 4096)
    worker_args = ServerArgs(model_path=target, device="cpu", max_total_tokens=total,
                             page_size=kwargs.get("page_size", 1), max_running_requests=kwargs.get(
                                 "max_running_requests", 16))
    # Every batch verifies (the CPU default stops speculating past 4 requests, the switch where drafts do not pay).
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
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


@pytest.fixture(scope="module")
def repeat_pair(tmp_path_factory):
    """A 1-layer target that repeats its last token, and a head over its whole vocabulary in a random
    order (d2t a permutation) that predicts what the target predicts: the layer input the target
    captures (outputs of layer -1: the embeddings) is embed(last token) at every position."""
    target = repeat_target(str(tmp_path_factory.mktemp("eagle3_repeat_target")), seed=4, vocab_size=VOCAB)
    head = build_eagle3_head(str(tmp_path_factory.mktemp("eagle3_repeat_head")), target, seed=6,
                             draft_vocab_size=VOCAB, aux_layer_ids=[-1, -1, -1], repeat=True)
    return target, head


@pytest.mark.parametrize("name", ["default", "page16", "chunked-mixed"])
def test_repeat_head_has_every_draft_accepted(repeat_pair, name):
    target, head = repeat_pair
    prompts = _prompts()
    _, plain = _run(target, None, prompts, **CONFIGS[name])
    assert all(out == [p[-1]] * N_NEW for p, out in zip(prompts, plain))  # the target repeats
    h, spec = _run(target, head, prompts, **CONFIGS[name])
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.slow  # in the full suite; the fast lane keeps the cheaper cases
def test_random_head_keeps_greedy_outputs(random_pair, name):
    target, head, _ = random_pair
    prompts = _prompts()
    _, plain = _run(target, None, prompts, **CONFIGS[name])
    h, spec = _run(target, head, prompts, **CONFIGS[name])
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_verify_ct"] > 0 and state["spec_draft_tokens"] > 0, state


def test_stops_keep_outputs(random_pair):
    target, head, _ = random_pair
    prompts = _prompts()
    _, base = _run(target, None, prompts)
    stop_id = base[3][10]
    _, plain = _run(target, None, prompts, dict(stop_token_ids=[stop_id], ignore_eos=False))
    _, spec = _run(target, head, prompts, dict(stop_token_ids=[stop_id], ignore_eos=False))
    assert spec == plain and len(spec[3]) < N_NEW


def test_features_are_the_targets_aux_hidden_states(random_pair):
    """The feature kept for each committed slot is the concatenation of the target's residual
    streams entering layers 1, 2, 2 (transformers' hidden_states[i] is the input of layer i), and
    drafts are target ids of the head's draft vocabulary (d2t)."""
    target, head, hf = random_pair
    h = _harness(target, head)
    prompts = _prompts()[:3]
    for p in prompts:
        h.submit(p, max_new_tokens=N_NEW, ignore_eos=True)
    for _ in range(5):
        h.step()
    drafter = h.scheduler.spec.drafter
    table = h.scheduler.req_to_token_pool.req_to_token
    for req in h.scheduler.running_batch.reqs:
        tokens = req.origin_input_ids + req.output_ids
        committed = req.kv_allocated_len  # the newest token has no K/V yet
        with torch.inference_mode():
            states = hf(torch.tensor([tokens[:committed]]), output_hidden_states=True).hidden_states
        expected = torch.cat([states[1][0], states[2][0], states[2][0]], dim=-1)
        slots = table[req.req_pool_idx, :committed].to(torch.int64)
        torch.testing.assert_close(drafter.features[slots].float(), expected, atol=2e-4, rtol=2e-4)
    h.run_until_idle()
    with open(os.path.join(head, "config.json")) as f:
        assert json.load(f)["draft_vocab_size"] == VOCAB // 2
    model = drafter.runner.model
    from safetensors.torch import load_file

    d2t = load_file(os.path.join(head, "model.safetensors"))["d2t"]
    assert torch.equal(model.hot_token_ids.cpu(), d2t + torch.arange(VOCAB // 2))
    logits = model._to_target_vocab(torch.randn(2, VOCAB // 2))
    assert set(logits.argmax(-1).tolist()) <= set(model.hot_token_ids.tolist())
    assert torch.isinf(logits).sum() == 2 * (VOCAB - VOCAB // 2)


def test_bad_checkpoints_are_refused(random_pair, tmp_path):
    target, _, _ = random_pair
    head = build_eagle3_head(str(tmp_path / "ids"), target, draft_vocab_size=8, aux_layer_ids=[0, 1, 7])
    with pytest.raises(ValueError, match="auxiliary layers"):
        _harness(target, head)
    with pytest.raises(ValueError, match="is not an EAGLE3 head"):
        _harness(target, target)
    from safetensors.torch import load_file, save_file

    head = build_eagle3_head(str(tmp_path / "d2t"), target, draft_vocab_size=8)
    file = os.path.join(head, "model.safetensors")
    weights = load_file(file)
    weights["d2t"] = torch.zeros(8, dtype=torch.int64) + VOCAB  # out of the target's vocabulary
    save_file(weights, file)
    with pytest.raises(ValueError, match="distinct target ids"):
        _harness(target, head)


@pytest.mark.slow
def test_sampled_outputs_keep_the_target_distribution_end_to_end(tmp_path):
    """2000 sampled requests on a 12-token vocabulary with a random EAGLE3 head over 8 of its tokens
    (aux layers: outputs of layers -1, 0, 1 of a 2-layer target): tokens 2 and 3 of each output come
    from verify steps and follow transformers' distribution given the tokens before them."""
    from engine.scheduler.tp_worker import TpModelWorker

    path = str(tmp_path / "target")
    hf = build_tiny_model(path, seed=5, vocab_size=12)
    head = build_eagle3_head(str(tmp_path / "head"), path, seed=3, draft_vocab_size=8, aux_layer_ids=[-1, 0, 1])
    vocab, n, temperature = 12, 2000, 0.9
    prompt = [3, 1, 4, 0, 5, 9, 2, 6, 11, 8, 7, 10]
    worker_args = ServerArgs(model_path=path, device="cpu", max_total_tokens=16384, max_running_requests=256)
    h = Harness(worker=TpModelWorker(worker_args), tokenizer=LetterTokenizer(), max_total_tokens=16384,
                max_running_requests=256, speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                speculative_num_steps=2, speculative_batch_size_threshold=1024,
                disable_speculative_adaptive=True)
    rids = [h.submit(prompt, max_new_tokens=3, ignore_eos=True, temperature=temperature) for _ in range(n)]
    h.run_until_idle()
    outs = [tuple(h.outputs[r].output_ids) for r in rids]
    assert all(len(o) == 3 for o in outs)
    state = h.scheduler.internal_state()
    assert state["spec_accepted_tokens"] > 0.1 * state["spec_draft_tokens"] > 0, state

    def dist(prefixes: List[Tuple[int, ...]]) -> Dict[Tuple[int, ...], torch.Tensor]:
        with torch.inference_mode():
            ids = torch.tensor([prompt + list(p) for p in prefixes])
            logits = hf(ids).logits[:, -1, :].float()
        return dict(zip(prefixes, torch.softmax(logits / temperature, dim=-1)))

    for depth in (1, 2):
        counts: Dict[Tuple[int, ...], int] = {}
        observed: Dict[Tuple[int, ...], int] = {}
        for o in outs:
            counts[o[:depth]] = counts.get(o[:depth], 0) + 1
            observed[o[:depth + 1]] = observed.get(o[:depth + 1], 0) + 1
        p = dist(sorted(counts))
        total_stat, total_df = 0.0, 0
        for pre, c in counts.items():
            if c < 100:
                continue
            expected = {pre + (t,): c * float(p[pre][t]) for t in range(vocab)}
            stat, df = _chi2({k: v for k, v in observed.items() if k[:depth] == pre}, expected)
            total_stat += stat
            total_df += df
        assert total_df >= 10, (depth, total_df)
        assert total_stat < _chi2_bound(total_df), (depth, total_stat, total_df)
