"""gpt-oss over 2 TP ranks (gloo, spawned in-process): heads and sinks split, the experts split as
--ep-size says (1: every expert's intermediate columns halved, gate/up pairs kept; 2: half the experts
each, whole). Past the sliding window, both give one rank's prefill logits (float tolerance) and
transformers' greedy tokens; so does the MXFP4 form of the checkpoint (dequantized, then split)."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.multiprocessing as mp

from test_gpt_oss_mxfp4 import _write_mxfp4
from utils_models import TINY_SWA, BatchDriver, ExtendReq, build_tiny_model, hf_greedy, make_runner

from engine.utils.network_utils import get_free_port

TP = 2
DECODE_STEPS = 6
GEN = torch.Generator().manual_seed(8)
PROMPTS = [torch.randint(0, 512, (n,), generator=GEN).tolist() for n in (37, 5, 22)]  # window 16


def _run(path: str, tp_size: int, ep_size: int):
    """Prefill PROMPTS and greedy-decode: (prefill logits, tokens per prompt, this rank's expert shapes)."""
    from engine.configs.model_config import ModelConfig
    from engine.distributed.parallel_state import get_tp_rank
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    if tp_size == 1:
        runner = make_runner(path)
    else:
        args = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=2048,
                          max_running_requests=8, tp_size=tp_size, ep_size=ep_size)
        runner = ModelRunner(ModelConfig.from_pretrained(path, dtype="float32", device="cpu"), args,
                             tp_rank=get_tp_rank(), tp_size=tp_size)
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    out, tokens = driver.run(driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, PROMPTS)]))
    logits = out.next_token_logits.clone()
    outputs = [[int(t)] for t in tokens]
    seq_lens = [len(p) for p in PROMPTS]
    for _ in range(DECODE_STEPS):
        _, tokens = driver.run(driver.decode_batch(rows, [o[-1] for o in outputs], seq_lens))
        seq_lens = [n + 1 for n in seq_lens]
        for o, t in zip(outputs, tokens):
            o.append(int(t))
    experts = runner.model.model.decoder_layers[0].mlp.experts
    return logits, outputs, (tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape))


def _rank_main(rank: int, port: int, paths: dict, queue) -> None:
    try:
        torch.set_num_threads(1)
        from engine.distributed import parallel_state as ps

        ps.init_distributed_environment(rank, TP, f"tcp://127.0.0.1:{port}", "cpu")
        runs = [("bf16", 1), ("bf16", 2), ("mxfp4", 1)]
        results = {(name, ep): _run(paths[name], TP, ep) for name, ep in runs}
        if rank == 0:
            queue.put(("ok", results))
        ps.destroy_distributed_environment()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths, expected = {}, {}
    for name in ("bf16", "mxfp4"):
        path = str(tmp_path_factory.mktemp(f"gpt_oss_tp_{name}"))
        build_tiny_model(path, "gpt_oss", seed=6, **TINY_SWA["gpt_oss"])
        if name == "mxfp4":
            _write_mxfp4(path)
        paths[name] = path
    from test_gpt_oss_mxfp4 import _transformers_model

    for name, path in paths.items():
        hf = _transformers_model(path) if name == "mxfp4" else None
        if hf is None:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        expected[name] = [hf_greedy(hf, p, DECODE_STEPS + 1) for p in PROMPTS]
    return paths, expected


@pytest.fixture(scope="module")
def tp2_results(models):
    paths, _ = models
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, paths, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        result = queue.get()  # rank 0's results, or the first error of any rank
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert result[0] == "ok", f"TP rank {result[1]} failed:\n{result[2]}"
    return result[1]


@pytest.mark.slow  # two spawned ranks build three models
@pytest.mark.parametrize("name,ep", [("bf16", 1), ("bf16", 2), ("mxfp4", 1)])
def test_tp2_matches_tp1_and_transformers(models, tp2_results, name, ep):
    paths, expected = models
    logits, tokens, (gate_up, down) = tp2_results[(name, ep)]
    ref_logits, ref_tokens, (full_gate_up, full_down) = _run(paths[name], 1, 1)
    experts, hidden, two_inter = full_gate_up
    # ep 1: every expert, half its intermediate columns; ep 2: half the experts, whole.
    assert gate_up == ((experts, hidden, two_inter // 2) if ep == 1 else (experts // 2, hidden, two_inter))
    assert down == ((experts, two_inter // 4, hidden) if ep == 1 else (experts // 2, two_inter // 2, hidden))
    assert (logits - ref_logits).abs().max().item() < 1e-4
    assert tokens == ref_tokens == expected[name]
