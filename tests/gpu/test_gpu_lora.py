"""LoRA on CUDA: the Triton segmented GEMM against the native path (float32, bfloat16), and a
scheduler on a CUDA worker (triton LoRA backend, overlap on) giving peft's greedy tokens for a batch
mixing adapters and the base model."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_lora_equals_native_on_cuda(dtype):
    from engine.lora.backend import NativeShape, build_batch_info, lora_native, lora_triton, native_b

    torch.manual_seed(0)
    device = torch.device("cuda")
    slots, rank, k, sections = 9, 16, 512, [(0, 512), (512, 128), (640, 128)]
    n = sum(s for _, s in sections)
    a = torch.randn(slots, len(sections) * rank, k, device=device, dtype=dtype) * 0.05
    b = torch.randn(slots, n, rank, device=device, dtype=dtype) * 0.05
    a[0].zero_()
    b[0].zero_()
    scalings = torch.rand(slots, device=device) * 2
    scalings[0] = 0
    row_slots = [(i // 7) % slots for i in range(301)]  # segments of 7 rows, slot 0 among them
    info = build_batch_info(row_slots, scalings, device, NativeShape(n, len(sections) * rank, dtype))
    x = torch.randn(len(row_slots), k, device=device, dtype=dtype)
    base = torch.randn(len(row_slots), n, device=device, dtype=dtype)
    want, got = base.clone(), base.clone()
    assert info.native is not None
    lora_native(x, want, a, native_b(b, sections, rank, scalings), sections, rank, info.native)
    lora_triton(x, got, a, b, sections, rank, info)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_cuda_scheduler_with_adapters_equals_peft(tmp_path):
    pytest.importorskip("peft", reason="peft is the oracle of the LoRA tests")
    from lora_utils import ALL_MODULES, build_adapters, peft_greedy
    from utils_models import build_tiny_model, hf_greedy

    from engine.io_struct import BatchTokenIDOutput, TokenizedGenerateReqInput
    from engine.request_options import RequestOptions
    from engine.scheduler.scheduler import Scheduler
    from engine.server_args import ServerArgs

    base = str(tmp_path / "base")
    hf = build_tiny_model(base)
    paths = build_adapters(hf, str(tmp_path / "adapters"), {"x": dict(rank=8, targets=ALL_MODULES, seed=1),
                                                            "y": dict(rank=4, targets=["q_proj", "v_proj"], seed=2)})
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    expected = {name: peft_greedy(hf, p, prompts, 8) for name, p in paths.items()}
    expected[None] = [hf_greedy(hf, p, 8) for p in prompts]
    scheduler = Scheduler(ServerArgs(model_path=base, device="cuda", dtype="float32", max_total_tokens=4096,
                                     max_running_requests=16, log_level="warning",
                                     lora_paths=[f"{n}={p}" for n, p in paths.items()]))
    outputs = {}
    for name in (None, "x", "y"):
        for i, p in enumerate(prompts):
            rid = f"{name}-{i}"
            outputs[rid] = []
            scheduler.add_request(TokenizedGenerateReqInput(
                rid=rid, input_ids=p, options=RequestOptions(lora_path=name),
                sampling_params={"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}))
    while scheduler.has_work():
        scheduler.step_overlap()
        for msg in scheduler.outbox:
            if isinstance(msg, BatchTokenIDOutput):
                for rid, ids in zip(msg.rids, msg.output_ids):
                    outputs[rid].extend(ids)
        scheduler.outbox.clear()
    scheduler.shutdown()
    for name in (None, "x", "y"):
        for i in range(len(prompts)):
            assert outputs[f"{name}-{i}"] == expected[name][i], (name, i)
