"""Expert layout and routed-token counts through the real scheduler on a tiny Mixtral: the internal
state's "moe" entry, SGLang's start/stop/dump expert distribution requests, the /metrics counter; a
dense model refuses the requests and reports nothing."""

from __future__ import annotations

import pytest

from sched_utils import Harness
from utils_models import LetterTokenizer, build_tiny_model

from engine.io_struct import ExpertDistributionReq
from engine.server_args import ServerArgs

LAYERS, EXPERTS, TOP_K = 2, 4, 2


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("mixtral_stats"))
    build_tiny_model(path, "mixtral", seed=2)
    return path


def _harness(path: str) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker

    worker = TpModelWorker(ServerArgs(model_path=path, device="cpu", max_total_tokens=1024, max_running_requests=8))
    return Harness(worker=worker, tokenizer=LetterTokenizer(), max_total_tokens=1024, disable_radix_cache=True)


def test_layout_and_routed_tokens_in_internal_state(mixtral):
    h = _harness(mixtral)
    moe = h.scheduler.internal_state()["moe"]
    assert {k: moe[k] for k in ("num_experts", "num_experts_per_tok", "ep_size", "num_local_experts",
                                "num_moe_layers")} == {"num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
                                                       "ep_size": 1, "num_local_experts": EXPERTS,
                                                       "num_moe_layers": LAYERS}
    assert moe["routed_tokens"] == [0] * EXPERTS and moe["recording"] is False
    h.submit(list(range(10)), max_new_tokens=5, ignore_eos=True)
    h.run_until_idle()
    # Every token run through a layer's experts counts top_k times: in layer 0 the 10 prompt tokens and 4
    # decode inputs; the last layer of a prefill runs its last row only (the logits need no other).
    routed = h.scheduler.internal_state()["moe"]["routed_tokens"]
    assert sum(routed) == (10 + 4) * TOP_K + (1 + 4) * TOP_K


def test_record_start_stop_dump(mixtral):
    h = _harness(mixtral)
    h.submit(list(range(6)), max_new_tokens=2, ignore_eos=True)  # before the recording: not in the dump
    h.run_until_idle()
    assert h.control(ExpertDistributionReq(action="start_record")).success
    assert h.scheduler.internal_state()["moe"]["recording"] is True
    h.submit(list(range(20, 27)), max_new_tokens=3, ignore_eos=True)
    h.run_until_idle()
    assert h.control(ExpertDistributionReq(action="stop_record")).success
    h.submit(list(range(5)), max_new_tokens=2, ignore_eos=True)  # after it: not in the dump either
    h.run_until_idle()
    dump = h.control(ExpertDistributionReq(action="dump_record"))
    assert dump.success
    assert len(dump.logical_count) == LAYERS and all(len(row) == EXPERTS for row in dump.logical_count)
    assert [sum(row) for row in dump.logical_count] == [(7 + 2) * TOP_K, (1 + 2) * TOP_K]
    bad = h.control(ExpertDistributionReq(action="explode"))
    assert not bad.success and "explode" in bad.message


def test_dense_model_refuses_and_reports_no_moe():
    h = Harness()  # the fake worker: a dense model
    assert "moe" not in h.scheduler.internal_state()
    reply = h.control(ExpertDistributionReq(action="start_record"))
    assert not reply.success and "no mixture-of-experts" in reply.message


def test_metrics_counter_per_expert_summed_over_replicas():
    from engine.tokenizer.metrics import TokenizerMetricsCollector

    metrics = TokenizerMetricsCollector("m")
    metrics.set_scheduler_states([{"moe": {"routed_tokens": [3, 0, 5]}}, {"moe": {"routed_tokens": [1, 2, 0]}}])
    text = metrics.render().decode()
    assert 'sglang:moe_routed_tokens_total{expert_id="0",model_name="m"} 4.0' in text
    assert 'sglang:moe_routed_tokens_total{expert_id="1",model_name="m"} 2.0' in text
    assert 'sglang:moe_routed_tokens_total{expert_id="2",model_name="m"} 5.0' in text
    metrics.set_scheduler_states([{"num_running_reqs": 0}])
    assert "moe_routed_tokens" not in metrics.render().decode()
