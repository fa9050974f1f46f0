"""DeepSeek-V2/V3 (MLA) over 2 TP ranks (gloo, spawned in-process): the heads split (q, kv_b_proj, o_proj),
the latents replicated (every rank stores the whole latent of every token), the experts split by TP
(V2, --ep-size 1) or by expert (V3, --ep-size 2). Both give one rank's prefill logits (float tolerance),
transformers' greedy tokens, and get_weights_by_name reassembles the split kv_b_proj."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.multiprocessing as mp

from utils_models import BatchDriver, ExtendReq, build_tiny_model, hf_greedy, make_runner

from engine.utils.network_utils import get_free_port

TP = 2
DECODE_STEPS = 6
PROMPTS = [[3, 17, 250, 9, 44], [100, 7, 7, 7, 31, 480, 2, 65, 11], [401]]
CASES = {"deepseek_v2": 1, "deepseek_v3": 2}  # arch -> --ep-size
WEIGHTS = ("model.layers.1.self_attn.kv_b_proj.weight", "model.layers.1.self_attn.kv_a_proj_with_mqa.weight",
           "model.layers.1.self_attn.o_proj.weight")


def _run(path: str, tp_size: int, ep_size: int):
    """Prefill PROMPTS and greedy-decode: (prefill logits, tokens per prompt, weights by name, local heads)."""
    from engine.configs.model_config import ModelConfig
    from engine.distributed.parallel_state import get_tp_rank
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    if tp_size == 1:
        runner = make_runner(path)
    else:
        args = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=2048,
                          max_running_requests=16, tp_size=tp_size, ep_size=ep_size, page_size=16)
        config = ModelConfig.from_pretrained(path, dtype="float32", device="cpu")
        runner = ModelRunner(config, args, tp_rank=get_tp_rank(), tp_size=tp_size)
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
    by_name = {name: runner.weight_updater.full_weight(name, 1000)[0] for name in WEIGHTS}
    heads = runner.model.model.decoder_layers[0].self_attn.num_heads
    return logits, outputs, by_name, heads


def _rank_main(rank: int, port: int, paths: dict, queue) -> None:
    try:
        torch.set_num_threads(1)
        from engine.distributed import parallel_state as ps

        ps.init_distributed_environment(rank, TP, f"tcp://127.0.0.1:{port}", "cpu")
        results = {name: _run(path, TP, CASES[name]) for name, path in paths.items()}
        if rank == 0:
            queue.put(("ok", results))
        ps.destroy_distributed_environment()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths, expected = {}, {}
    for arch in CASES:
        path = str(tmp_path_factory.mktemp(arch))
        hf = build_tiny_model(path, arch, seed=4)
        paths[arch] = path
        expected[arch] = [hf_greedy(hf, p, DECODE_STEPS + 1) for p in PROMPTS]
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


@pytest.mark.slow  # two spawned ranks build two models each (about a minute on 2 cores)
@pytest.mark.parametrize("arch", list(CASES))
def test_tp2_matches_tp1_and_transformers(models, tp2_results, arch):
    from safetensors.torch import load_file

    paths, expected = models
    logits, outputs, by_name, heads = tp2_results[arch]
    ref_logits, ref_outputs, _, ref_heads = _run(paths[arch], 1, 1)
    assert heads * TP == ref_heads
    assert (logits - ref_logits).abs().max().item() < 1e-4, arch
    assert outputs == ref_outputs == expected[arch], arch
    checkpoint = load_file(f"{paths[arch]}/model.safetensors")
    for name in WEIGHTS:
        assert torch.equal(torch.tensor(by_name[name]), checkpoint[name]), name
