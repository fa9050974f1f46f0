"""The control plane on CUDA, with CUDA graphs: what the CPU suite cannot show.

- release/resume_memory_occupation really frees device memory, drops the graphs and captures them
  again, and the outputs are identical afterwards (served by graphs again);
- update_weights_from_disk writes the parameters in place, so the graphs captured before still
  give transformers' tokens of the new checkpoint;
- return_hidden_states bypasses the graphs and equals transformers' hidden states.
"""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import (
    ReplayCounter,
    SchedulerDriver,
    build_gpu_tiny_model,
    hf_greedy_cuda,
    make_prompts,
)

from engine.io_struct import (
    BatchTokenIDOutput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightFromDiskReqInput,
)
from engine.request_options import RequestOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT_LENS = [9, 40, 3, 77]
N_NEW = 12


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    paths, expected = [], []
    for seed in (0, 1):
        path = str(tmp_path_factory.mktemp(f"control_{seed}"))
        hf = build_gpu_tiny_model(path, "llama", seed=seed)
        prompts = make_prompts(PROMPT_LENS, hf.config.vocab_size, seed=3)
        expected.append([hf_greedy_cuda(hf, p, N_NEW) for p in prompts])
        paths.append(path)
        del hf
    torch.cuda.empty_cache()
    return paths, prompts, expected


def control(drv: SchedulerDriver, msg):
    """Send one control request through the scheduler's loop; its reply."""
    drv.scheduler.add_request(msg)
    drv.scheduler.step_overlap() if drv.overlap else drv.scheduler.step()
    replies = [m for m in drv.scheduler.outbox if not isinstance(m, BatchTokenIDOutput)]
    drv._collect()
    assert len(replies) == 1, replies
    return replies[0]


def greedy(drv: SchedulerDriver, prompts):
    return [o.output_ids for o in drv.generate(prompts, [N_NEW] * len(prompts))]


def test_release_resume_frees_memory_recaptures_graphs_and_changes_nothing(checkpoints):
    paths, prompts, expected = checkpoints
    drv = SchedulerDriver(paths[0], dtype="float32", attention_backend="triton", cuda_graph_max_bs=8)
    try:
        assert greedy(drv, prompts) == expected[0]
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        assert control(drv, ReleaseMemoryOccupationReqInput()).success
        assert drv.model_runner.cuda_graph_runner is None
        freed = before - torch.cuda.memory_allocated()
        kv_bytes = drv.model_runner.max_total_num_tokens * drv.model_runner.kv_bytes_per_token()
        assert freed >= kv_bytes  # the KV pool (and the weights) left the device
        assert control(drv, ResumeMemoryOccupationReqInput()).success
        assert drv.model_runner.cuda_graph_runner is not None
        counter = ReplayCounter(drv.model_runner)
        assert greedy(drv, prompts) == expected[0]
        assert counter.count > 0  # decoded through the recaptured graphs
    finally:
        drv.close()


def test_weight_update_in_place_keeps_the_graphs_valid(checkpoints):
    paths, prompts, expected = checkpoints
    drv = SchedulerDriver(paths[0], dtype="float32", attention_backend="triton", cuda_graph_max_bs=8)
    try:
        counter = ReplayCounter(drv.model_runner)
        assert greedy(drv, prompts) == expected[0]
        reply = control(drv, UpdateWeightFromDiskReqInput(model_path=paths[1]))
        assert reply.success, reply.message
        replays = counter.count
        assert greedy(drv, prompts) == expected[1]
        assert counter.count > replays  # the graphs captured with the old weights serve the new ones
    finally:
        drv.close()


def test_hidden_states_on_cuda(checkpoints):
    from transformers import AutoModelForCausalLM

    paths, prompts, _ = checkpoints
    drv = SchedulerDriver(paths[0], dtype="float32", attention_backend="triton", cuda_graph_max_bs=8)
    try:
        drv.scheduler.add_request(TokenizedGenerateReqInput(
            rid="hidden", input_ids=list(prompts[1]), options=RequestOptions(return_hidden_states=True),
            sampling_params={"max_new_tokens": N_NEW, "temperature": 0.0, "ignore_eos": True}))
        output_ids, states = [], []
        while drv.scheduler.has_work():
            drv.scheduler.step_overlap() if drv.overlap else drv.scheduler.step()
            for msg in drv.scheduler.outbox:
                if not isinstance(msg, BatchTokenIDOutput):
                    continue
                i = msg.rids.index("hidden")
                output_ids.extend(msg.output_ids[i])
                if msg.output_hidden_states and msg.output_hidden_states[i]:
                    states.extend(msg.output_hidden_states[i])
            drv.scheduler.outbox.clear()
        assert len(output_ids) == N_NEW and len(states) == N_NEW  # the prompt's block, then one per step
        hf = AutoModelForCausalLM.from_pretrained(paths[0], dtype=torch.float32).to("cuda").eval()
        with torch.no_grad():
            ref = hf(torch.tensor([list(prompts[1]) + output_ids[:-1]], device="cuda"),
                     output_hidden_states=True).hidden_states[-1][0].cpu()
        mine = torch.cat([torch.tensor(states[0]), torch.tensor(states[1:])])
        torch.testing.assert_close(mine, ref, rtol=1e-3, atol=1e-3)
    finally:
        drv.close()
