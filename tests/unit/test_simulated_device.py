"""The simulated accelerator (--simulated-device-forward-ms): flag checks, deterministic tokens,
and the real scheduler (both loops, radix cache, chunked prefill, logprobs) on top of it."""

from __future__ import annotations

import random

import pytest
import torch

from engine.builtin_model import ensure_builtin_model
from engine.scheduler.tp_worker import TpModelWorker
from engine.model_executor.simulated_device import (
    LOGPROB_OTHERS,
    ordinary_token_ids,
    simulated_next_tokens,
    special_token_ids,
)
from engine.server_args import ServerArgs, ServerArgsError
from sched_utils import Harness


@pytest.fixture(scope="module")
def model_path():
    return ensure_builtin_model()


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def sim_args(model_path: str, **kwargs) -> ServerArgs:
    kwargs.setdefault("max_total_tokens", 4096)
    kwargs.setdefault("max_running_requests", 16)
    return ServerArgs(model_path=model_path, simulated_device_forward_ms="0", **kwargs)


def expected_output(worker: TpModelWorker, prompt: list[int], n: int) -> list[int]:
    """The simulated device's greedy continuation, one token at a time (the oracle)."""
    allowed = worker.model_runner.allowed_ids
    seq = list(prompt)
    for _ in range(n):
        pos = len(seq) - 1
        seq.append(int(simulated_next_tokens(torch.tensor([seq[-1]]), torch.tensor([pos]), allowed)[0]))
    return seq[len(prompt):]


# ---------------------------------------------------------------------------- flag
@pytest.mark.parametrize("value, cost", [("10", (10.0, 0.0)), ("10,0.002", (10.0, 0.002)), (" 0 , 1 ", (0.0, 1.0))])
def test_cost_is_parsed(value, cost):
    assert ServerArgs(simulated_device_forward_ms=value).simulated_device_cost() == cost


@pytest.mark.parametrize("value", ["", "a", "1,2,3", "-1", "1,-0.5", "nan", "inf,0"])
def test_malformed_cost_is_refused(value):
    with pytest.raises(ServerArgsError, match="--simulated-device-forward-ms must be 'A' or 'A,B'"):
        ServerArgs(simulated_device_forward_ms=value)


def test_off_by_default_and_forces_the_cpu():
    assert ServerArgs(device="cpu").simulated_device_cost() is None
    assert ServerArgs(simulated_device_forward_ms="1").device == "cpu"


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "cuda"}, "runs with --device cpu"),
    ({"tp_size": 2}, "use --tp-size 1"),
    ({"is_embedding": True}, "not with --is-embedding"),
    ({"disaggregation_mode": "decode"}, "not with --is-embedding or --disaggregation-mode"),
])
def test_refused_where_it_makes_no_sense(kwargs, message):
    with pytest.raises(ServerArgsError, match=message):
        ServerArgs(simulated_device_forward_ms="1", **kwargs)


# ---------------------------------------------------------------------------- tokens
def test_tokens_are_ordinary_and_never_eos(model_path):
    specials = special_token_ids(model_path)
    assert {0, 1, 2} <= specials  # the built-in model's BOS, EOS, EOT
    allowed = ordinary_token_ids(2560, specials | {1})
    last = torch.arange(0, 2560).repeat(4)
    pos = torch.arange(last.numel())
    out = simulated_next_tokens(last, pos, allowed)
    assert not set(out.tolist()) & specials
    assert torch.equal(out, simulated_next_tokens(last, pos, allowed))
    assert len(set(out.tolist())) > 1000  # spread over the vocabulary, not a constant


def test_worker_allocates_no_kv_and_honours_pool_sizes(model_path):
    worker = TpModelWorker(sim_args(model_path, max_total_tokens=100_000, max_running_requests=4096))
    info = worker.get_worker_info()
    assert info["max_total_num_tokens"] == 100_000 and info["max_running_requests"] == 4096
    assert worker.model_runner.token_to_kv_pool is None
    assert worker.token_to_kv_pool_allocator.available_size() == 100_000


# ---------------------------------------------------------------------------- the scheduler on top
@pytest.mark.parametrize("overlap", [False, True])
def test_scheduler_outputs_are_the_token_function(model_path, tokenizer, overlap):
    worker = TpModelWorker(sim_args(model_path))
    h = Harness(worker=worker, tokenizer=tokenizer, overlap=overlap, detokenize=True, max_total_tokens=4096,
                max_running_requests=16, chunked_prefill_size=32)
    rng = random.Random(0)
    prompts = {}
    shared = [rng.randrange(10, 2500) for _ in range(40)]
    for i in range(24):
        # Half share a prefix (radix cache hits), some are longer than a chunk.
        prompt = (shared if i % 2 else []) + [rng.randrange(10, 2500) for _ in range(rng.randint(1, 60))]
        rid = h.submit(prompt, max_new_tokens=rng.randint(1, 20), stream=i % 3 == 0,
                       temperature=1.0 if i % 4 == 0 else 0.0)
        prompts[rid] = prompt
        if i % 5 == 4:
            h.step()
    h.run_until_idle()
    for rid, prompt in prompts.items():
        out = h.outputs[rid]
        n = out.completion_tokens
        assert out.finished_reason["type"] == "length"
        assert out.output_ids == expected_output(worker, prompt, n)
        assert out.text == tokenizer.decode(out.output_ids)
    assert sum(o.cached_tokens for o in h.outputs.values()) > 0


def test_logprobs_have_the_real_shapes(model_path, tokenizer):
    worker = TpModelWorker(sim_args(model_path))
    h = Harness(worker=worker, tokenizer=tokenizer, max_total_tokens=4096, max_running_requests=16)
    prompt = [100, 200, 300, 400]
    rid = h.submit(prompt, max_new_tokens=3, return_logprob=True, logprob_start_len=1, top_logprobs_num=2)
    h.run_until_idle()
    out = h.outputs[rid]
    # 3 output logprobs, then input logprobs of positions 2..3 (position 1's is None).
    assert out.logprobs == [0.0] * 5
    assert worker.model_runner._top_entries(7, 2) == ([0.0, LOGPROB_OTHERS], [7, 0])


def test_forward_takes_the_simulated_time(model_path):
    import time

    from engine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch

    worker = TpModelWorker(ServerArgs(model_path=model_path, simulated_device_forward_ms="20,1",
                                      max_total_tokens=4096, max_running_requests=4))
    batch = ModelWorkerBatch(forward_mode=ForwardMode.DECODE, input_ids=torch.tensor([5, 6]),
                             req_pool_indices=torch.tensor([1, 2]), seq_lens=torch.tensor([3, 4]),
                             seq_lens_cpu=[3, 4], out_cache_loc=torch.tensor([7, 8]))
    runner = worker.model_runner
    start = time.perf_counter()
    out = runner.forward(ForwardBatch.init_new(batch, runner))
    assert time.perf_counter() - start >= 0.022  # 20 ms + 2 tokens x 1 ms: a lower bound, never flaky
    assert out.next_token_logits.tolist() == [[5, 2], [6, 3]]
