"""One workload, every CUDA configuration: the same greedy outputs.

triton with CUDA graphs on and off, overlap scheduling on and off, page size 16, torch_native, and
flashinfer when it is installed. Float32, so that equal math gives equal tokens; the workload's
requests finish at different steps, so decode batches shrink through sizes that are captured
(8, 4, 2, 1), padded (7, 6, 5, 3) and above the largest graph (12 .. 9, plain forward).
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from gpu_helpers import (
    ReplayCounter,
    SchedulerDriver,
    build_gpu_tiny_model,
    flashinfer_available,
    hf_greedy_cuda,
    make_prompts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT_LENS = [7, 90, 33, 1, 260, 64, 15, 129, 48, 3, 200, 77]
# Staggered lengths: the batch shrinks by one request every few steps.
MAX_NEW = [4 + 3 * i for i in range(len(PROMPT_LENS))]
GRAPH_MAX_BS = 8

CONFIGS: Dict[str, dict] = {
    "triton-graph-overlap": dict(attention_backend="triton"),
    "triton-graph-normal": dict(attention_backend="triton", disable_overlap_schedule=True),
    "triton-nograph-overlap": dict(attention_backend="triton", disable_cuda_graph=True),
    "triton-nograph-normal": dict(attention_backend="triton", disable_cuda_graph=True, disable_overlap_schedule=True),
    "triton-graph-page16": dict(attention_backend="triton", page_size=16),
    "torch_native": dict(attention_backend="torch_native", disable_overlap_schedule=True),
    "flashinfer": dict(attention_backend="flashinfer"),
}


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> Tuple[str, List[List[int]], Dict[str, List[List[int]]]]:
    path = tmp_path_factory.mktemp("gpu_configs")
    hf = build_gpu_tiny_model(str(path), "llama", seed=5)
    prompts = make_prompts(PROMPT_LENS, hf.config.vocab_size, seed=4)
    expected = [hf_greedy_cuda(hf, p, n) for p, n in zip(prompts, MAX_NEW)]
    del hf
    torch.cuda.empty_cache()
    return str(path), prompts, {"transformers": expected}


def run_config(path: str, prompts, name: str) -> Tuple[List[List[int]], ReplayCounter, bool]:
    drv = SchedulerDriver(path, dtype="float32", cuda_graph_max_bs=GRAPH_MAX_BS, **CONFIGS[name])
    try:
        has_graphs = drv.model_runner.cuda_graph_runner is not None
        replays = ReplayCounter(drv.model_runner)
        outputs = drv.generate(prompts, MAX_NEW)
    finally:
        drv.close()
    return [o.output_ids for o in outputs], replays, has_graphs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_gives_the_reference_outputs(workload, name):
    if name == "flashinfer" and not flashinfer_available():
        pytest.skip("flashinfer-python is not installed")
    path, prompts, results = workload
    outputs, replays, has_graphs = run_config(path, prompts, name)
    assert [len(o) for o in outputs] == MAX_NEW
    expects_graphs = CONFIGS[name].get("attention_backend") == "triton" and not CONFIGS[name].get("disable_cuda_graph")
    assert has_graphs == expects_graphs, name
    if expects_graphs:
        # Served by graphs: every decode batch of <= GRAPH_MAX_BS rows, padded ones included.
        assert replays.count > 0 and max(replays.batch_sizes) <= GRAPH_MAX_BS
        assert any(bs not in (1, 2, 4, 8) for bs in replays.batch_sizes), replays.batch_sizes
    mismatched = [i for i, (a, b) in enumerate(zip(outputs, results["transformers"])) if a != b]
    assert not mismatched, f"{name}: requests {mismatched} differ from transformers' greedy output"
