"""The target's KV pool is sized together with a speculative draft model's (speculative/memory.py):
with --mem-fraction-static f and M bytes free, the target's K/V pool plus the draft's (its K/V, an
EAGLE head's stored features) stay within f x M, the draft's weights loaded later included; both
are reported in the scheduler's state (/get_server_info)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from sched_utils import Harness
from test_speculative_ngram import VOCAB
from utils_models import LetterTokenizer, build_eagle_head, build_tiny_model

from engine.server_args import ServerArgs

FRACTION = 0.5
FREE = 48 << 20  # what psutil reports free after the target's weights


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("mem_target"))
    build_tiny_model(target, seed=2, vocab_size=VOCAB, max_position_embeddings=2048)
    small = str(tmp_path_factory.mktemp("mem_small_draft"))
    build_tiny_model(small, seed=3, vocab_size=VOCAB, max_position_embeddings=2048, num_hidden_layers=1,
                     num_key_value_heads=1)
    eagle = build_eagle_head(str(tmp_path_factory.mktemp("mem_eagle")), target, seed=1)
    return {"target": target, "self": target, "small": small, "eagle": eagle}


def _checkpoint_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if n.endswith(".safetensors"))


@pytest.mark.parametrize("algo,draft", [("STANDALONE", "self"), ("STANDALONE", "small"), ("EAGLE", "eagle")])
def test_target_and_draft_pools_share_one_budget(models, monkeypatch, algo, draft):
    import psutil

    from engine.scheduler.tp_worker import TpModelWorker

    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=FREE))
    spec = dict(speculative_algorithm=algo, speculative_draft_model_path=models[draft])
    # The server passes the same arguments to the worker and the scheduler.
    args = dict(model_path=models["target"], device="cpu", mem_fraction_static=FRACTION, max_running_requests=16)
    worker = TpModelWorker(ServerArgs(**args, **spec))
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), **spec, mem_fraction_static=FRACTION, max_running_requests=16)
    state = h.scheduler.internal_state()
    target, drafted = state["kv_pool_bytes"], state["draft_kv_pool_bytes"]
    budget = FRACTION * (FREE - _checkpoint_bytes(models[draft]))
    page = 2 * (target + drafted) / state["max_total_num_tokens"]  # the padding page (and rounding) of each pool
    assert target + drafted <= budget + page, (target, drafted, budget)
    assert target + drafted >= 0.95 * budget  # and the budget is used
    assert drafted > 0 and target > 0
    # Both pools hold the same slots: the draft's share is its bytes per token against the target's.
    per_token = worker.model_runner.kv_bytes_per_token()
    assert target == pytest.approx(per_token * state["max_total_num_tokens"], rel=0.01)
    # A request runs on it, exactly as without speculation's budget.
    rid = h.submit([5, 6, 7, 8], max_new_tokens=6, ignore_eos=True)
    h.run_until_idle()
    assert len(h.outputs[rid].output_ids) == 6
