"""LoRA under tensor parallelism: 2 spawned ranks over gloo, each a ModelRunner serving its shards of
the adapters (column-parallel projections cut B, row-parallel ones cut A, KV heads replicated as the
base layer replicates them); a batch mixing two adapters and the base gives peft's greedy tokens."""

from __future__ import annotations

import traceback

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("peft", reason="peft is the oracle of the LoRA tests (pip install peft)")

from lora_utils import ALL_MODULES, build_adapters, peft_greedy  # noqa: E402
from utils_models import BatchDriver, ExtendReq, build_tiny_model, hf_greedy  # noqa: E402

from engine.utils.network_utils import get_free_port  # noqa: E402

pytestmark = pytest.mark.slow  # spawns two TP ranks

TP = 2
STEPS = 6
PROMPTS = [[3, 17, 250, 9, 44], [100, 7, 7, 7, 31, 480, 2, 65, 11], [401, 5]]
LORAS = ["all", None, "attn"]  # one adapter per prompt
ADAPTERS = {"all": dict(rank=8, targets=ALL_MODULES, seed=5), "attn": dict(rank=4, targets=["k_proj", "o_proj", "up_proj"], seed=6)}


def _generate(path: str, lora_paths: list) -> list:
    from engine.configs.model_config import ModelConfig
    from engine.distributed.parallel_state import get_tp_rank
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    args = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=2048, max_running_requests=8,
                      tp_size=TP, lora_paths=lora_paths)
    runner = ModelRunner(ModelConfig.from_pretrained(path, dtype="float32", device="cpu"), args,
                         tp_rank=get_tp_rank(), tp_size=TP)
    assert runner.lora_manager is not None
    uids = [None if n is None else runner.lora_manager.uid_of(n) for n in LORAS]
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in PROMPTS]
    batch = driver.extend_batch([ExtendReq(r, p) for r, p in zip(rows, PROMPTS)])
    batch.lora_ids = uids  # what ScheduleBatch.get_model_worker_batch carries
    _, tokens = driver.run(batch)
    outputs = [[int(t)] for t in tokens]
    seq_lens = [len(p) for p in PROMPTS]
    for _ in range(STEPS - 1):
        batch = driver.decode_batch(rows, [o[-1] for o in outputs], seq_lens)
        batch.lora_ids = uids
        _, tokens = driver.run(batch)
        seq_lens = [n + 1 for n in seq_lens]
        for o, t in zip(outputs, tokens):
            o.append(int(t))
    return outputs


def _rank_main(rank: int, port: int, path: str, lora_paths: list, queue) -> None:
    try:
        torch.set_num_threads(1)
        from engine.distributed import parallel_state as ps

        ps.init_distributed_environment(rank, TP, f"tcp://127.0.0.1:{port}", "cpu")
        outputs = _generate(path, lora_paths)
        if rank == 0:
            queue.put(("ok", outputs))
        ps.destroy_distributed_environment()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


@pytest.mark.parametrize("kv_heads", [1, 2])  # 1: the KV head is replicated on both ranks
def test_tp2_lora_equals_peft(tmp_path, kv_heads):
    base = str(tmp_path / "base")
    hf = build_tiny_model(base, num_attention_heads=4, num_key_value_heads=kv_heads)
    paths = build_adapters(hf, str(tmp_path / "adapters"), ADAPTERS)
    expected = {name: peft_greedy(hf, p, PROMPTS, STEPS) for name, p in paths.items()}
    expected[None] = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert all(expected[name] != expected[None] for name in paths)  # the adapters change the output
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = get_free_port()
    lora_paths = [f"{n}={p}" for n, p in paths.items()]
    procs = [ctx.Process(target=_rank_main, args=(r, port, base, lora_paths, queue)) for r in range(TP)]
    for p in procs:
        p.start()
    try:
        result = queue.get()
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert result[0] == "ok", f"TP rank {result[1]} failed:\n{result[2]}"
    for i, name in enumerate(LORAS):
        assert result[1][i] == expected[name][i], (name, i)
