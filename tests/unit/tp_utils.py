"""What the tensor-parallel model tests share: spawned gloo ranks, a runner at any TP size, and a
prefill-then-greedy run of a batch of prompts through it."""

from __future__ import annotations

import traceback
from typing import Any, Callable, List, Sequence, Tuple

import torch
import torch.multiprocessing as mp

from utils_models import BatchDriver, ExtendReq, make_runner

from engine.utils.network_utils import get_free_port

TP = 2


def tp_runner(path: str, tp_size: int, ep_size: int = 1, **server_args: Any):
    """A float32 ModelRunner of `path` on this rank (make_runner's at TP 1)."""
    from engine.configs.model_config import ModelConfig
    from engine.distributed.parallel_state import get_tp_rank
    from engine.model_executor.model_runner import ModelRunner
    from engine.server_args import ServerArgs

    settings = {"max_total_tokens": 2048, "max_running_requests": 16, **server_args}
    if tp_size == 1:
        return make_runner(path, **settings)
    args = ServerArgs(model_path=path, dtype="float32", device="cpu", tp_size=tp_size, ep_size=ep_size, **settings)
    return ModelRunner(ModelConfig.from_pretrained(path, dtype="float32", device="cpu"), args,
                       tp_rank=get_tp_rank(), tp_size=tp_size)


def prefill_and_decode(runner, prompts: Sequence[Sequence[int]], steps: int) -> Tuple[torch.Tensor, List[List[int]]]:
    """One extend of every prompt, then `steps` greedy decode steps: (the prefill's next-token logits, each
    prompt's 1 + steps tokens)."""
    driver = BatchDriver(runner)
    rows = [driver.new_row() for _ in prompts]
    out, tokens = driver.run(driver.extend_batch([ExtendReq(r, list(p)) for r, p in zip(rows, prompts)]))
    logits = out.next_token_logits.clone()
    outputs = [[int(t)] for t in tokens]
    seq_lens = [len(p) for p in prompts]
    for _ in range(steps):
        _, tokens = driver.run(driver.decode_batch(rows, [o[-1] for o in outputs], seq_lens))
        seq_lens = [n + 1 for n in seq_lens]
        for o, t in zip(outputs, tokens):
            o.append(int(t))
    return logits, outputs


def _rank_main(rank: int, tp: int, port: int, work: Callable[[Any], Any], payload: Any, queue) -> None:
    try:
        torch.set_num_threads(1)
        from engine.distributed import parallel_state as ps

        ps.init_distributed_environment(rank, tp, f"tcp://127.0.0.1:{port}", "cpu")
        result = work(payload)
        if rank == 0:
            queue.put(("ok", result))
        ps.destroy_distributed_environment()
    except BaseException:
        queue.put(("error", rank, traceback.format_exc()))


def run_tp_ranks(work: Callable[[Any], Any], payload: Any, tp: int = TP, check_exit: bool = False) -> Any:
    """`work(payload)` on each of `tp` spawned ranks (a module-level function: spawn pickles it by name);
    rank 0's result, or the assertion error of the first rank that failed. `check_exit`: every rank must
    also have left the group and exited 0."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = get_free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, port, work, payload, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        result = queue.get()  # rank 0's result, or the first error of any rank
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert result[0] == "ok", f"TP rank {result[1]} failed:\n{result[2]}"
    if check_exit:
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return result[1]
