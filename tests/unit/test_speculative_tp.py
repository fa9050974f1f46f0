"""Speculative decoding under tensor parallelism: 2 spawned ranks over gloo, each driving its own
Scheduler (the in-process Harness) over a TP-sharded target and draft with the same requests, as
the scheduler processes of a TP group do.

Greedy outputs at TP 2 equal TP 1 without speculation for NGRAM, STANDALONE (a random draft, and the
target as its own draft, which must have every draft accepted: the sharded draft's K/V are right)
and EAGLE (a random head sharing the sharded embedding and lm_head). Sampled requests (no seed)
keep the ranks in agreement: the debug check CHECK_TP_SAMPLING asserts at every step that both
ranks sampled and verified the same tokens, and both ranks return the same outputs. The speculation
switch runs enabled in two configurations (its decisions agree across ranks by an all-reduce), and two
run in the overlap loop.
"""

from __future__ import annotations

import traceback
from typing import Dict, List, Optional

import pytest
import torch
import torch.multiprocessing as mp

from utils_models import LetterTokenizer, build_eagle_head, build_tiny_model

from engine.utils.network_utils import get_free_port

TP = 2
VOCAB = 512
N_NEW = 20
PROMPTS = [[3, 17, 250, 9, 44, 3, 17, 250], [100, 7, 7, 7, 31, 480, 2, 65, 11, 100, 7], [401, 5]]
SAMPLED = dict(temperature=1.0, top_p=0.9)


def _configs(paths: Dict[str, str]) -> Dict[str, Optional[Dict]]:
    always = dict(speculative_batch_size_threshold=1024, disable_speculative_adaptive=True)
    return {
        "off": None,
        "ngram": dict(speculative_algorithm="NGRAM", **always),
        "standalone_self": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=paths["target"],
                                speculative_num_steps=3, **always),
        # The switch enabled: its decisions are agreed by the ranks.
        "standalone_random": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=paths["draft"],
                                  speculative_num_steps=3, speculative_batch_size_threshold=1024),
        "eagle": dict(speculative_algorithm="EAGLE", speculative_draft_model_path=paths["eagle"],
                      speculative_num_steps=3, **always),
        # The overlap loop (each rank guesses the switch's next decision before building a batch).
        "standalone_random_overlap": dict(speculative_algorithm="STANDALONE", speculative_draft_model_path=paths["draft"],
                                          speculative_num_steps=3, speculative_batch_size_threshold=1024, overlap=True),
        "eagle_overlap": dict(speculative_algorithm="EAGLE", speculative_draft_model_path=paths["eagle"],
                              speculative_num_steps=3, overlap=True, **always),
    }


def _generate(target: str, spec: Optional[Dict], tp_size: int, tp_rank: int) -> Dict:
    from sched_utils import Harness

    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    worker = TpModelWorker(ServerArgs(model_path=target, device="cpu", max_total_tokens=2048,
                                      max_running_requests=16, tp_size=tp_size), tp_rank=tp_rank)
    spec = dict(spec or {})
    overlap = bool(spec.pop("overlap", False))
    h = Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=2048, tp_size=tp_size, overlap=overlap, **spec)
    greedy = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True) for p in PROMPTS]
    sampled = [h.submit(p, max_new_tokens=N_NEW, ignore_eos=True, **SAMPLED) for p in PROMPTS]
    h.run_until_idle()  # ends with the strict idle leak check
    state = h.scheduler.internal_state()
    return {"greedy": [h.outputs[r].output_ids for r in greedy], "sampled": [h.outputs[r].output_ids for r in sampled],
            "verify_ct": state.get("spec_verify_ct", 0), "accepted": state.get("spec_accepted_tokens", 0),
            "drafted": state.get("spec_draft_tokens", 0)}


def _rank_main(rank: int, port: int, paths: Dict[str, str], queue) -> None:
    try:
        torch.set_num_threads(1)
        from engine.distributed import parallel_state as ps
        from engine.model_executor import model_runner

        model_runner.CHECK_TP_SAMPLING = True  # every sampled and verified token equal on both ranks
        ps.init_distributed_environment(rank, TP, f"tcp://127.0.0.1:{port}", "cpu")
        results = {name: _generate(paths["target"], spec, TP, rank) for name, spec in _configs(paths).items()}
        queue.put(("ok", rank, results))
        ps.destroy_distributed_environment()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = str(tmp_path_factory.mktemp("tp_spec_target"))
    build_tiny_model(target, seed=2, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2048)
    draft = str(tmp_path_factory.mktemp("tp_spec_draft"))
    build_tiny_model(draft, seed=3, vocab_size=VOCAB, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2048)
    eagle = build_eagle_head(str(tmp_path_factory.mktemp("tp_spec_eagle")), target, seed=1)
    return {"target": target, "draft": draft, "eagle": eagle}


@pytest.fixture(scope="module")
def tp2_results(paths):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, paths, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    results: List = []
    try:
        for _ in range(TP):
            results.append(queue.get())
            if results[-1][0] == "error":
                break
        for p in procs:
            p.join(timeout=120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    for result in results:
        assert result[0] == "ok", f"TP rank {result[1]} failed:\n{result[2]}"
    return {rank: res for _, rank, res in results}


@pytest.mark.slow
def test_tp2_speculation_equals_tp1_without_it(paths, tp2_results):
    tp1 = _generate(paths["target"], None, 1, 0)
    ranks = tp2_results
    for name in _configs(paths):
        assert ranks[0][name]["greedy"] == tp1["greedy"], name
        # Both ranks produced the same outputs, the sampled ones included.
        assert ranks[0][name] == ranks[1][name], name
        assert all(len(o) == N_NEW for o in ranks[0][name]["sampled"])
        if name != "off":
            assert ranks[0][name]["verify_ct"] > 0, name
    self_draft = ranks[0]["standalone_self"]
    assert self_draft["accepted"] > 0.9 * self_draft["drafted"] > 0, self_draft  # sampled rows may reject


def test_tp2_speculation_flags_are_accepted():
    from engine.server_args import ServerArgs

    args = ServerArgs(device="cpu", tp_size=2, speculative_algorithm="NGRAM")
    assert args.speculative_algorithm == "NGRAM"
