"""The offline Engine (no HTTP) with the built-in model on the CPU."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import psutil
import pytest

from engine import Engine
from engine.errors import EngineRequestError
from engine.io_struct import GetInternalStateReqOutput

from utils_process import wait_until

pytestmark = pytest.mark.slow  # starts a server (processes): the full suite runs it, the fast lane does not

ENGINE_ARGS = dict(device="cpu", max_total_tokens=8192, log_level="warning", strict_memory_check=True)
GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine():
    with Engine(**ENGINE_ARGS) as eng:
        yield eng


def test_generate_single(engine):
    out = engine.generate("The capital of France is", GREEDY)
    assert isinstance(out, dict)
    assert isinstance(out["text"], str)
    assert len(out["output_ids"]) == 6
    meta = out["meta_info"]
    assert meta["completion_tokens"] == 6 and meta["prompt_tokens"] > 0
    assert meta["finish_reason"]["type"] == "length"
    # Greedy is deterministic.
    assert engine.generate("The capital of France is", GREEDY)["output_ids"] == out["output_ids"]


def test_generate_batch_in_order(engine):
    prompts = ["Hello", "A much longer prompt about something else entirely"]
    outs = engine.generate(prompts, GREEDY)
    assert isinstance(outs, list) and len(outs) == 2
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == engine.generate(prompt, GREEDY)["output_ids"]


def test_stream_matches_non_stream(engine):
    full = engine.generate("Once upon a time", GREEDY)
    chunks = list(engine.generate("Once upon a time", GREEDY, stream=True))
    assert len(chunks) >= 2
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]


def test_input_ids_and_logprobs(engine):
    out = engine.generate(input_ids=[1, 2, 3, 4], sampling_params=GREEDY, return_logprob=True,
                          top_logprobs_num=2, return_text_in_logprobs=True)
    meta = out["meta_info"]
    assert len(meta["output_token_logprobs"]) == 6
    for (logprob, token_id, text), expected_id in zip(meta["output_token_logprobs"], out["output_ids"]):
        assert logprob <= 0.0 and token_id == expected_id and isinstance(text, str)
    assert all(len(top) == 2 for top in meta["output_top_logprobs"])


def test_async_generate_and_async_stream(engine):
    async def run():
        single = await engine.async_generate("Once upon a time", GREEDY)
        chunks = [c async for c in engine.async_generate("Once upon a time", GREEDY, stream=True)]
        awaited_stream = await engine.async_generate("Once upon a time", GREEDY, stream=True)
        chunks2 = [c async for c in awaited_stream]
        both = await asyncio.gather(engine.async_generate("Hello", GREEDY), engine.async_generate("World", GREEDY))
        return single, chunks, chunks2, both

    single, chunks, chunks2, both = asyncio.run(run())
    assert chunks[-1]["output_ids"] == single["output_ids"] == chunks2[-1]["output_ids"]
    assert [b["output_ids"] for b in both] == [engine.generate(p, GREEDY)["output_ids"] for p in ("Hello", "World")]


def test_abort_request_returns_the_partial_output(engine):
    # As SGLang's Engine: an aborted running request ends with its output so far and an abort reason.
    params = {"temperature": 0.0, "max_new_tokens": 500, "ignore_eos": True}
    chunks = []
    for chunk in engine.generate("Abort me offline", params, stream=True, rid="engine-abort"):
        chunks.append(chunk)
        if len(chunks) == 3:
            engine.abort_request("engine-abort")
    last = chunks[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 3 <= len(last["output_ids"]) < 500
    ref = engine.generate("Abort me offline", {**params, "max_new_tokens": len(last["output_ids"])})
    assert ref["output_ids"] == last["output_ids"] and ref["text"] == last["text"]


def test_invalid_request_raises(engine):
    with pytest.raises(EngineRequestError) as info:
        engine.generate("Hello", {"temperature": -1.0})
    assert info.value.status_code == 400
    with pytest.raises(EngineRequestError):
        engine.generate(input_ids=list(range(5000)))


def test_encode_on_a_generation_engine_raises(engine):
    with pytest.raises(EngineRequestError, match="--is-embedding"):
        engine.encode("hello")


def test_n_is_bounded_in_the_offline_engine_too(engine):
    """The fan-out limit is the engine's, not only the HTTP layer's: the offline Engine refuses
    n over 128 before building a single sub-request."""
    with pytest.raises(EngineRequestError) as info:
        engine.generate("Hello", {"n": 129, "max_new_tokens": 1})
    assert info.value.status_code == 400
    assert "n must be an integer in [1, 128], got 129" in info.value.message
    outs = engine.generate("Hello", {"n": 2, **GREEDY})
    assert len(outs) == 2 and outs[0]["output_ids"] == outs[1]["output_ids"]


def test_control_calls(engine):
    states = engine.get_internal_state()
    assert len(states) == 1 and states[0]["max_total_num_tokens"] == 8192
    assert engine.flush_cache() is True
    assert engine.get_model_info()["is_generation"] is True


class _DeadProcess:
    pid = -1

    def is_alive(self) -> bool:
        return False


def _call_in_thread(fn):
    """Run fn() in a thread; the returned dict gets "result" or "error" when it returns."""
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_engine_calls_fail_instead_of_hanging_when_nothing_can_answer_them():
    """A call waiting on the server side ends with a clear error when that side is gone without
    the call being told (a child found dead, the engine's event loop stopped)."""
    with Engine(**ENGINE_ARGS) as eng:
        scheduler_pid = eng._runtime.children.processes()[0].pid
        manager = eng.tokenizer_manager
        assert eng.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1  # connected
        os.kill(scheduler_pid, signal.SIGSTOP)  # nothing is answered from now on
        try:
            # 1. The children are found dead, but nothing failed the waiting request.
            thread, outcome = _call_in_thread(lambda: eng.generate("Hi", {"max_new_tokens": 2}))
            assert wait_until(lambda: bool(manager.rid_to_state), 30)
            children = manager.liveness.child_processes
            manager.liveness.child_processes = [_DeadProcess()]
            thread.join(60)
            assert not thread.is_alive(), "the call hangs although the engine is dead"
            assert isinstance(outcome.get("error"), EngineRequestError), outcome
            assert outcome["error"].status_code == 503
            manager.liveness.child_processes = children

            # 2. The engine's event loop stops while a call waits on it.
            thread, outcome = _call_in_thread(eng.get_internal_state)
            assert wait_until(lambda: manager.control.waiting_for(GetInternalStateReqOutput) > 0, 30)
            eng._runtime.loop.call_soon_threadsafe(eng._runtime.loop.stop)
            thread.join(60)
            assert not thread.is_alive(), "the call hangs although the event loop stopped"
            assert isinstance(outcome.get("error"), RuntimeError), outcome
            assert "event loop" in str(outcome["error"])
        finally:
            os.kill(scheduler_pid, signal.SIGCONT)


def test_dead_child_and_shutdown_leave_no_process():
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with Engine(**ENGINE_ARGS) as eng:
        pids = [p.pid for p in eng._runtime.children.processes()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] <= 2
        os.kill(pids[0], signal.SIGKILL)  # the scheduler
        deadline = time.monotonic() + 10
        while eng.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not eng.is_alive()
        with pytest.raises(EngineRequestError) as info:
            eng.generate("Hi", {"max_new_tokens": 2})
        assert info.value.status_code == 503
    new = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    assert not {c.pid for c in new} & set(pids)
    # Only multiprocessing's shared resource tracker may remain; it is not ours to stop.
    assert all("resource_tracker" in " ".join(c.cmdline()) for c in new), [c.cmdline() for c in new]


def test_incremental_streaming_output_pieces_join_into_the_whole_output():
    """--incremental-streaming-output (SGLang's flag): each streamed chunk carries the text, ids and
    output logprobs new since the previous one; joined, they equal the non-streamed result."""
    with Engine(**ENGINE_ARGS, incremental_streaming_output=True) as eng:
        params = {**GREEDY, "max_new_tokens": 12}
        whole = eng.generate("The sky is", params, return_logprob=True)
        chunks = list(eng.generate("The sky is", params, return_logprob=True, stream=True))
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert [i for c in chunks for i in c["output_ids"]] == whole["output_ids"]
    streamed = [lp for c in chunks for lp in c["meta_info"]["output_token_logprobs"]]
    assert [lp[1] for lp in streamed] == [lp[1] for lp in whole["meta_info"]["output_token_logprobs"]]
    assert all(c["output_ids"] for c in chunks)  # no chunk repeats what an earlier one carried
