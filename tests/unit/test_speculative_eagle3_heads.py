"""EAGLE3 heads without an lm_head of their own, loaded as SGLang loads them (models/llama_eagle3.py):
tie_word_embeddings makes the head's lm_head its embedding, which is the target's; a head with a
draft vocabulary but no lm_head.weight, or a tied one over a draft vocabulary, is refused clearly."""

from __future__ import annotations

import json
import os

import pytest

from test_speculative_eagle3 import _prompts, _run
from test_speculative_ngram import VOCAB
from utils_models import build_eagle3_head, repeat_target


def _rewrite(head: str, drop: tuple, **config) -> str:
    from safetensors.torch import load_file, save_file

    file = os.path.join(head, "model.safetensors")
    weights = {k: v for k, v in load_file(file).items() if k not in drop}
    save_file(weights, file, metadata={"format": "pt"})
    with open(os.path.join(head, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(config)
    with open(os.path.join(head, "config.json"), "w") as f:
        json.dump(cfg, f)
    return head


@pytest.fixture(scope="module")
def repeat_model(tmp_path_factory):
    return repeat_target(str(tmp_path_factory.mktemp("eagle3_tied_target")), seed=4, vocab_size=VOCAB)


def test_tied_head_predicts_with_the_targets_embedding(repeat_model, tmp_path):
    """A head that repeats its input token through its lm_head, the lm_head being the (tied) embedding:
    it predicts what the repeating target predicts only if that lm_head really is the target's
    embedding over the whole vocabulary in target order, so every draft is accepted."""
    head = build_eagle3_head(str(tmp_path / "tied"), repeat_model, seed=6, draft_vocab_size=VOCAB,
                             aux_layer_ids=[-1, -1, -1], repeat=True)
    _rewrite(head, ("lm_head.weight", "d2t", "t2d"), tie_word_embeddings=True)
    prompts = _prompts()
    _, plain = _run(repeat_model, None, prompts)
    h, spec = _run(repeat_model, head, prompts)
    assert spec == plain
    state = h.scheduler.internal_state()
    assert state["spec_accepted_tokens"] == state["spec_draft_tokens"] > 0, state
    model = h.scheduler.spec.drafter.runner.model
    target = h.worker.model_runner.model
    assert model.lm_head.weight is target.model.embed_tokens.weight


def test_heads_without_their_lm_head_are_refused_clearly(repeat_model, tmp_path):
    head = build_eagle3_head(str(tmp_path / "no_head"), repeat_model, seed=6, draft_vocab_size=VOCAB // 2)
    _rewrite(head, ("lm_head.weight",))
    with pytest.raises(ValueError, match="sets draft_vocab_size 1280 but the checkpoint has no lm_head.weight"):
        _run(repeat_model, head, _prompts()[:1])
    head = build_eagle3_head(str(tmp_path / "tied_small"), repeat_model, seed=6, draft_vocab_size=VOCAB // 2)
    _rewrite(head, ("lm_head.weight",), tie_word_embeddings=True)
    with pytest.raises(ValueError, match="tie_word_embeddings with draft_vocab_size 1280"):
        _run(repeat_model, head, _prompts()[:1])
