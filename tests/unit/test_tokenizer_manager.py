"""TokenizerManager against a fake scheduler thread on real ZMQ sockets.

The fake scheduler receives TokenizedGenerateReqInput / control messages like the real one,
produces a scripted token stream one token per iteration, runs the real DetokenizerManager
in-thread and pushes BatchStrOutput (and control replies) to the tokenizer socket.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from dataclasses import dataclass, field

import pytest
import zmq

import engine.tokenizer.tokenizer_manager as tm_module
from engine.detokenizer.detokenizer_manager import DetokenizerManager
from engine.errors import EngineRequestError
from engine.io_struct import (
    AbortReq,
    BatchTokenIDOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
    decode,
    encode,
)
from engine.tokenizer.tokenizer_manager import GenerateReqInput, TokenizerManager
from engine.port_args import PortArgs
from engine.server_args import ServerArgs
from engine.utils.zmq_utils import get_zmq_socket
from utils_process import wait_until


CONTEXT_LEN = 64
REPLY_TEXT = " quick brown fox 🎉 jumps"


def build_test_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["The quick brown fox jumps over the lazy dog. Hello world."] * 30, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    return hf


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


@dataclass
class FakeReq:
    req: TokenizedGenerateReqInput
    script: list[int]
    produced: int = 0
    sent_input_logprobs: bool = False
    abort_reason: dict | None = None


@dataclass
class FakeScheduler:
    port_args: PortArgs
    tokenizer: object
    paused: threading.Event = field(default_factory=threading.Event)
    received: list = field(default_factory=list)
    running: dict = field(default_factory=dict)
    admission_abort: dict | None = None  # when set, every new request is aborted with it

    def start(self) -> None:
        self._ctx = zmq.Context()
        self._recv = get_zmq_socket(self._ctx, zmq.PULL, self.port_args.scheduler_input_ipc_name, bind=False)
        self._send = get_zmq_socket(self._ctx, zmq.PUSH, self.port_args.tokenizer_ipc_name, bind=False)
        self._detok = DetokenizerManager(self.tokenizer)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._state_seq = 0
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._recv.close()
        self._send.close()
        self._ctx.term()

    def messages(self, kind):
        with self._lock:
            return [m for m in self.received if isinstance(m, kind)]

    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = self.running and not self.paused.is_set()
            if self._recv.poll(1 if busy else 20):
                while True:
                    try:
                        msg = decode(self._recv.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    with self._lock:
                        self.received.append(msg)
                    self._handle(msg)
            if self.running and not self.paused.is_set():
                self._step()

    def _handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            script = self.tokenizer.encode(REPLY_TEXT) + [self.tokenizer.eos_token_id]
            fake = FakeReq(msg, script)
            if self.admission_abort is not None:
                fake.abort_reason = dict(self.admission_abort)
            self.running[msg.rid] = fake
        elif isinstance(msg, AbortReq):
            for rid, fake in self.running.items():
                if msg.abort_all or rid.startswith(msg.rid):
                    fake.abort_reason = {"type": "abort", "message": "Aborted", "status_code": 400}
            if self.paused.is_set():
                self._step(only_aborts=True)
        elif isinstance(msg, FlushCacheReqInput):
            self._send.send(encode(FlushCacheReqOutput(success=not self.running)))
        elif isinstance(msg, GetInternalStateReq):
            state = {"num_running_reqs": len(self.running), "seq": self._state_seq}
            self._state_seq += 1
            self._send.send(encode(GetInternalStateReqOutput(internal_state=state)))

    def _step(self, only_aborts: bool = False) -> None:
        rows = []
        for rid, fake in list(self.running.items()):
            if only_aborts and fake.abort_reason is None:
                continue
            max_new = fake.req.sampling_params.get("max_new_tokens") or 8
            if fake.abort_reason is not None:
                new_ids, reason = [], fake.abort_reason
            else:
                token = fake.script[fake.produced % len(fake.script)]
                fake.produced += 1
                new_ids, reason = [token], None
                if token == self.tokenizer.eos_token_id:
                    reason = {"type": "stop", "matched": token}
                elif fake.produced >= max_new:
                    reason = {"type": "length", "length": max_new}
            rows.append((fake, new_ids, reason))
            if reason is not None:
                del self.running[rid]
        if rows:
            self._send.send(encode(self._detok.handle_batch_token_id_out(self._batch(rows))))

    def _batch(self, rows) -> BatchTokenIDOutput:
        out = BatchTokenIDOutput(rids=[], finished_reasons=[], output_ids=[], skip_special_tokens=[],
                                 spaces_between_special_tokens=[], no_stop_trim=[], prompt_tokens=[],
                                 completion_tokens=[], cached_tokens=[])
        for fake, new_ids, reason in rows:
            req = fake.req
            out.rids.append(req.rid)
            out.finished_reasons.append(reason)
            out.output_ids.append(new_ids)
            out.skip_special_tokens.append(req.sampling_params.get("skip_special_tokens", True))
            out.spaces_between_special_tokens.append(True)
            out.no_stop_trim.append(False)
            out.prompt_tokens.append(len(req.input_ids))
            out.completion_tokens.append(fake.produced)
            out.cached_tokens.append(0)
            k = req.options.top_logprobs_num
            want = req.options.return_logprob
            first = want and not fake.sent_input_logprobs
            if first:
                fake.sent_input_logprobs = True
                ids = req.input_ids[max(req.options.logprob_start_len, 0):]
                vals = [None] + [-1.0] * (len(ids) - 1)
                out.input_token_logprobs_val.append(vals)
                out.input_token_logprobs_idx.append(ids)
                out.input_top_logprobs_val.append([None] + [[-1.0] * k for _ in ids[1:]])
                out.input_top_logprobs_idx.append([None] + [[t] * k for t in ids[1:]])
            else:
                for lst in (out.input_token_logprobs_val, out.input_token_logprobs_idx,
                            out.input_top_logprobs_val, out.input_top_logprobs_idx):
                    lst.append(None)
            out.output_token_logprobs_val.append([-0.5] * len(new_ids) if want else None)
            out.output_token_logprobs_idx.append(list(new_ids) if want else None)
            out.output_top_logprobs_val.append([[-0.5] * k for _ in new_ids] if want else None)
            out.output_top_logprobs_idx.append([[t] * k for t in new_ids] if want else None)
        return out


@pytest.fixture
def runtime(tokenizer, monkeypatch):
    yield from run_manager_with_fake_scheduler(tokenizer, monkeypatch)


def run_manager_with_fake_scheduler(tokenizer, monkeypatch, **server_kwargs):
    """A TokenizerManager wired over real ZMQ sockets to a FakeScheduler thread (fixture body)."""
    monkeypatch.setattr(tm_module, "DISCONNECT_POLL_INTERVAL_S", 0.05)
    server_args = ServerArgs(model_path="unused", device="cpu", log_level="warning", **server_kwargs)
    port_args = PortArgs.init_new(server_args)
    info = {"context_len": CONTEXT_LEN, "max_req_input_len": CONTEXT_LEN - 6, "vocab_size": len(tokenizer),
            "max_total_num_tokens": 1000}
    manager = TokenizerManager(server_args, port_args, info, tokenizer=tokenizer)
    fake = FakeScheduler(port_args, tokenizer)
    fake.start()
    yield manager, fake
    manager.close()
    fake.stop()
    shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def collect(manager, obj, request=None):
    async def run():
        return [out async for out in manager.generate_request(obj, request)]

    return asyncio.run(asyncio.wait_for(run(), 30))


def expected_text(tokenizer, n_tokens):
    script = tokenizer.encode(REPLY_TEXT)
    return tokenizer.decode(script[:n_tokens])


# ------------------------------------------------------------------------------ normalize


def test_normalize_expands_n_request_major():
    obj = GenerateReqInput(text=["a", "b"], sampling_params={"n": 2, "max_new_tokens": 3}, rid=["x", "y"])
    obj.normalize()
    assert obj.rid == ["x_0", "x_1", "y_0", "y_1"]
    assert obj.text == ["a", "a", "b", "b"]
    assert all("n" not in sp and sp["max_new_tokens"] == 3 for sp in obj.sampling_params)
    assert not obj.is_single and obj.batch_size == 4


def test_one_rid_for_a_batch_is_a_prefix_like_sglang():
    obj = GenerateReqInput(text=["a", "b"], rid="job", sampling_params={"n": 2})
    obj.normalize()
    # SGLang numbers every sub-request of a string rid: "{rid}_{k}".
    assert obj.rid == ["job_0", "job_1", "job_2", "job_3"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "Exactly one of text or input_ids"),
    (dict(text="a", input_ids=[1]), "Exactly one of text or input_ids"),
    (dict(text=["a", "b"], sampling_params=[{}]), "sampling_params has 1 entries"),
    (dict(input_ids=[[1], []]), "input_ids must be"),
    (dict(text="a", sampling_params={"n": 0}), "n must be an integer in [1, 128], got 0"),
    (dict(text="a", sampling_params={"n": 129}), "n must be an integer in [1, 128], got 129"),
    (dict(text=["a", "b"], sampling_params=[{}, {"n": 129}]), "n must be an integer in [1, 128], got 129"),
    (dict(text="a", sampling_params={"n": 2.0}), "n must be an integer in [1, 128], got 2.0"),
    (dict(text=["a", "b"], rid=["same"]), "rid must be a list of 2"),
    (dict(text="a", return_logprob=[True, False]), "return_logprob has 2 entries"),
])
def test_normalize_rejects_bad_shapes(kwargs, message):
    with pytest.raises(EngineRequestError) as info:
        GenerateReqInput(**kwargs).normalize()
    assert message in info.value.message and info.value.status_code == 400


# ------------------------------------------------------------------------------ generate


def test_single_request_non_stream(runtime, tokenizer):
    manager, fake = runtime
    outs = collect(manager, GenerateReqInput(text="Hello world", sampling_params={"max_new_tokens": 5}, rid="r1"))
    assert len(outs) == 1
    out = outs[0]
    assert out["text"] == expected_text(tokenizer, 5)
    assert out["output_ids"] == tokenizer.encode(REPLY_TEXT)[:5]
    meta = out["meta_info"]
    assert meta["id"] == "r1"
    assert meta["prompt_tokens"] == len(tokenizer.encode("Hello world"))
    assert meta["completion_tokens"] == 5
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["e2e_latency"] > 0
    sent = fake.messages(TokenizedGenerateReqInput)[0]
    assert sent.input_ids == tokenizer.encode("Hello world") and sent.input_text == "Hello world"
    assert sent.sampling_params["max_new_tokens"] == 5 and "temperature" in sent.sampling_params
    assert manager.rid_to_state == {}


def test_stream_yields_cumulative_updates_and_trims_stop_token(runtime, tokenizer):
    manager, _ = runtime
    outs = collect(manager, GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 50},
                                             stream=True))
    # How many updates there are depends on how the outputs' arrival interleaves with the consumer
    # (updates that arrive together are merged into one): only their shape is asserted.
    assert outs
    for prev, cur in zip(outs, outs[1:]):
        assert cur["text"].startswith(prev["text"])
        assert prev["meta_info"]["finish_reason"] is None
    final = outs[-1]
    eos = tokenizer.eos_token_id
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert final["text"] == REPLY_TEXT  # the EOS text is trimmed by the detokenizer
    assert final["output_ids"][-1] == eos
    assert all("\ufffd" not in o["text"] for o in outs)


def test_incremental_stream_hands_out_each_piece_once(runtime, tokenizer):
    """--incremental-streaming-output: every update carries only the text and ids new since the
    previous one; joined, they are the cumulative stream's final output."""
    manager, _ = runtime

    async def run(incremental):
        obj = GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 50}, stream=True)
        return [out async for out in manager.generate_request(obj, incremental=incremental)]

    deltas = asyncio.run(asyncio.wait_for(run(True), 30))
    whole = asyncio.run(asyncio.wait_for(run(False), 30))[-1]
    assert "".join(o["text"] for o in deltas) == whole["text"] == REPLY_TEXT
    assert [i for o in deltas for i in o["output_ids"]] == whole["output_ids"]
    assert all(o["output_ids"] for o in deltas)  # no update repeats or carries nothing
    assert deltas[-1]["meta_info"]["finish_reason"] == whole["meta_info"]["finish_reason"]
    # Not streamed, the flag changes nothing: the one output is the whole one.
    obj = GenerateReqInput(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 50})
    plain = asyncio.run(asyncio.wait_for(_outputs(manager, obj, incremental=True), 30))
    assert len(plain) == 1 and plain[0]["text"] == REPLY_TEXT


async def _outputs(manager, obj, **kwargs):
    return [out async for out in manager.generate_request(obj, **kwargs)]


def test_max_new_tokens_none_is_sent_to_scheduler(runtime):
    manager, fake = runtime
    outs = collect(manager, GenerateReqInput(text="Hello", sampling_params={"max_new_tokens": None}))
    assert outs[-1]["meta_info"]["finish_reason"] is not None
    assert fake.messages(TokenizedGenerateReqInput)[0].sampling_params["max_new_tokens"] is None


def test_batch_non_stream_keeps_order(runtime, tokenizer):
    manager, _ = runtime
    obj = GenerateReqInput(text=["Hello", "world", "fox"], rid=["a", "b", "c"],
                           sampling_params=[{"max_new_tokens": 2}, {"max_new_tokens": 4}, {"max_new_tokens": 3}])
    outs = collect(manager, obj)
    assert len(outs) == 1
    results = outs[0]
    assert [r["meta_info"]["id"] for r in results] == ["a", "b", "c"]
    assert [r["meta_info"]["completion_tokens"] for r in results] == [2, 4, 3]
    assert results[1]["text"] == expected_text(tokenizer, 4)


def test_parallel_sampling_n_fans_out(runtime):
    manager, fake = runtime
    outs = collect(manager, GenerateReqInput(text="Hello", rid="p", sampling_params={"n": 3, "max_new_tokens": 2}))
    results = outs[0]
    assert isinstance(results, list) and [r["meta_info"]["id"] for r in results] == ["p_0", "p_1", "p_2"]
    sent = fake.messages(TokenizedGenerateReqInput)
    assert sorted(m.rid for m in sent) == ["p_0", "p_1", "p_2"]
    assert all(m.sampling_params["n"] == 1 for m in sent)


class CountingTokenizer:
    """Forwards to a real tokenizer and counts encode() calls."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.encoded: list[str] = []

    def encode(self, text, *args, **kwargs):
        self.encoded.append(text)
        return self.inner.encode(text, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_parallel_sampling_tokenizes_each_prompt_once(runtime, tokenizer):
    manager, fake = runtime
    counting = CountingTokenizer(tokenizer)
    manager.tokenizer = counting
    obj = GenerateReqInput(text=["Hello", "world fox"], rid=["p", "q"], sampling_params={"n": 3, "max_new_tokens": 2})
    results = collect(manager, obj)[0]
    assert [r["meta_info"]["id"] for r in results] == ["p_0", "p_1", "p_2", "q_0", "q_1", "q_2"]
    assert counting.encoded == ["Hello", "world fox"]
    sent = {m.rid: m.input_ids for m in fake.messages(TokenizedGenerateReqInput)}
    assert all(sent[f"p_{j}"] == tokenizer.encode("Hello") for j in range(3))
    assert all(sent[f"q_{j}"] == tokenizer.encode("world fox") for j in range(3))


def test_batch_stream_carries_index(runtime):
    manager, _ = runtime
    obj = GenerateReqInput(text=["Hello", "world"], stream=True, sampling_params={"max_new_tokens": 3})
    outs = collect(manager, obj)
    assert all(isinstance(o, dict) and o["index"] in (0, 1) for o in outs)
    finals = [o for o in outs if o["meta_info"]["finish_reason"] is not None]
    assert sorted(o["index"] for o in finals) == [0, 1]


def test_logprobs_with_text(runtime, tokenizer):
    manager, _ = runtime
    prompt_ids = tokenizer.encode("Hello world fox")
    obj = GenerateReqInput(input_ids=prompt_ids, sampling_params={"max_new_tokens": 3}, return_logprob=True,
                           logprob_start_len=0, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = collect(manager, obj)[-1]["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(prompt_ids)
    assert meta["input_token_logprobs"][0] == [None, prompt_ids[0], tokenizer.decode([prompt_ids[0]])]
    out_ids = tokenizer.encode(REPLY_TEXT)[:3]
    assert meta["output_token_logprobs"] == [[-0.5, t, tokenizer.decode([t])] for t in out_ids]
    assert meta["output_top_logprobs"][0] == [[-0.5, out_ids[0], tokenizer.decode([out_ids[0]])]] * 2
    assert meta["input_top_logprobs"][0] is None


@pytest.mark.parametrize("obj, message", [
    (GenerateReqInput(input_ids=list(range(1, CONTEXT_LEN + 5))),
     f"The input ({CONTEXT_LEN + 4} tokens) is longer than the model's context length ({CONTEXT_LEN} tokens)."),
    (GenerateReqInput(text="Hello", sampling_params={"temperature": -1}), "temperature"),
    (GenerateReqInput(text="Hello", sampling_params={"bogus": 1}), "bogus"),
    (GenerateReqInput(input_ids=[1, 100000]), "out of range"),
    (GenerateReqInput(input_ids=[1, 2], sampling_params={"max_new_tokens": CONTEXT_LEN}),
     "exceeds the model's maximum context length"),
    (GenerateReqInput(input_ids=[1, 2], return_logprob=True, logprob_start_len=5), "logprob_start_len"),
    (GenerateReqInput(input_ids=[1, 2], return_logprob=True, logprob_start_len=3), "logprob_start_len"),
])
def test_invalid_requests_raise_400_before_sending(runtime, obj, message):
    manager, fake = runtime
    with pytest.raises(EngineRequestError) as info:
        collect(manager, obj)
    assert message in info.value.message
    assert info.value.status_code == 400
    assert fake.messages(TokenizedGenerateReqInput) == []


def test_logprob_start_len_equal_to_the_prompt_length_is_accepted(runtime):
    # SGLang refuses only a start beyond the prompt (`>`): at the prompt length no input logprobs.
    manager, fake = runtime
    collect(manager, GenerateReqInput(input_ids=[1, 2, 3], return_logprob=True, logprob_start_len=3))
    [sent] = fake.messages(TokenizedGenerateReqInput)
    assert sent.options.logprob_start_len == 3


def test_bad_entry_in_batch_sends_nothing(runtime):
    manager, fake = runtime
    obj = GenerateReqInput(text=["ok", "ok"], sampling_params=[{}, {"top_p": 5}])
    with pytest.raises(EngineRequestError):
        collect(manager, obj)
    assert fake.messages(TokenizedGenerateReqInput) == []


def test_scheduler_abort_reaches_meta_info(runtime):
    manager, fake = runtime
    fake.admission_abort = {"type": "abort", "message": "The request queue is full.", "status_code": 503}
    out = collect(manager, GenerateReqInput(text="Hello"))[-1]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["finish_reason"]["status_code"] == 503
    assert out["meta_info"]["finish_reason"]["message"] == "The request queue is full."


class FakeRequest:
    def __init__(self):
        self.polls = 0

    async def is_disconnected(self):
        self.polls += 1
        return self.polls >= 2


def test_client_disconnect_aborts_request(runtime):
    manager, fake = runtime
    fake.paused.set()  # the request never progresses, so only the disconnect can end it
    with pytest.raises(EngineRequestError) as info:
        collect(manager, GenerateReqInput(text="Hello", rid="gone"), request=FakeRequest())
    assert "disconnected" in info.value.message and info.value.status_code == 499
    assert wait_until(lambda: [m.rid for m in fake.messages(AbortReq)] == ["gone"])
    assert manager.rid_to_state == {}


def test_closing_a_stream_early_aborts_request(runtime):
    manager, fake = runtime

    async def run():
        gen = manager.generate_request(GenerateReqInput(text="Hello", rid="early", stream=True,
                                                        sampling_params={"max_new_tokens": 60}))
        first = await gen.__anext__()
        fake.paused.set()
        await gen.aclose()
        return first

    first = asyncio.run(asyncio.wait_for(run(), 30))
    assert first["meta_info"]["finish_reason"] is None
    assert wait_until(lambda: [m.rid for m in fake.messages(AbortReq)] == ["early"])


def test_abort_request_by_rid(runtime):
    manager, fake = runtime
    fake.paused.set()

    async def run():
        gen = manager.generate_request(GenerateReqInput(text="Hello", rid="victim"))
        task = asyncio.ensure_future(_last(gen))
        while not fake.messages(TokenizedGenerateReqInput):
            await asyncio.sleep(0.01)
        manager.abort_request("victim")
        return await task

    out = asyncio.run(asyncio.wait_for(run(), 30))
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert fake.messages(AbortReq)[0].rid == "victim"
    manager.abort_request("")  # an empty rid is a no-op, never "abort everything"
    assert len(fake.messages(AbortReq)) == 1


def test_control_calls_are_answered_in_fifo_order(runtime):
    manager, _ = runtime

    async def run():
        states = await asyncio.gather(*(manager.get_internal_state() for _ in range(4)))
        flush = await manager.flush_cache()
        return states, flush

    states, flush = asyncio.run(asyncio.wait_for(run(), 30))
    assert [s[0]["seq"] for s in states] == [0, 1, 2, 3]
    assert all(s[0]["num_running_reqs"] == 0 for s in states)
    assert isinstance(flush, FlushCacheReqOutput) and flush.success


def test_health_generate(runtime, monkeypatch):
    manager, fake = runtime
    assert asyncio.run(manager.health_generate(timeout=10)) is True
    fake.paused.set()
    assert asyncio.run(manager.health_generate(timeout=0.3)) is False
    assert wait_until(lambda: any(m.rid.startswith("HEALTH_CHECK") for m in fake.messages(AbortReq)))


class DeadProcess:
    def is_alive(self):
        return False


def test_dead_child_makes_requests_fail_with_503(runtime):
    manager, fake = runtime
    assert manager.is_alive()
    manager.liveness.child_processes = [DeadProcess()]
    assert not manager.is_alive()
    with pytest.raises(EngineRequestError) as info:
        collect(manager, GenerateReqInput(text="Hello"))
    assert info.value.status_code == 503


def final_output_after(manager, fake, action) -> dict:
    """Send one request, hold it in the (paused) fake scheduler, run `action()`, return its final output."""
    fake.paused.set()

    async def run():
        task = asyncio.ensure_future(_last(manager.generate_request(GenerateReqInput(text="Hello"))))
        while not fake.messages(TokenizedGenerateReqInput):
            await asyncio.sleep(0.01)
        action()
        return await task

    return asyncio.run(asyncio.wait_for(run(), 30))


def test_mark_dead_fails_pending_requests(runtime):
    manager, fake = runtime
    out = final_output_after(manager, fake, lambda: manager.mark_dead("scheduler_TP0 died"))
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 503 and "scheduler_TP0 died" in reason["message"]
    assert not manager.is_alive()


def test_a_failure_on_one_output_of_a_batch_fails_that_request_and_serves_the_others(runtime, tokenizer):
    """Handling one request's output raises halfway through a BatchStrOutput: that request gets a
    terminal error (and is aborted in the scheduler), the others of the batch carry on."""
    manager, fake = runtime
    append_logprobs = manager.output_assembler._append_logprobs

    def flaky(state, batch, i):
        if state.rid == "bad":
            raise RuntimeError("boom")
        append_logprobs(state, batch, i)

    manager.output_assembler._append_logprobs = flaky
    obj = GenerateReqInput(text=["Hello", "world"], rid=["bad", "good"], sampling_params={"max_new_tokens": 4},
                           return_logprob=True)
    bad, good = collect(manager, obj)[0]
    reason = bad["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500 and "boom" in reason["message"]
    assert good["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    assert good["text"] == expected_text(tokenizer, 4)
    assert manager.rid_to_state == {}
    assert wait_until(lambda: any(m.rid == "bad" for m in fake.messages(AbortReq)), 10)


def test_an_undecodable_message_fails_the_requests_in_flight(runtime):
    """Whose output a garbled message carried is unknown: every waiter gets a terminal error
    rather than waiting forever for output that was lost."""
    manager, fake = runtime
    out = final_output_after(manager, fake, lambda: fake._send.send(b"\xc1 not msgpack"))
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 500
    assert manager.is_alive()  # later requests are served
    fake.paused.clear()
    assert collect(manager, GenerateReqInput(text="Hi", sampling_params={"max_new_tokens": 2}))[-1][
        "meta_info"]["finish_reason"] == {"type": "length", "length": 2}


class BrokenSocket:
    """The receive side of a socket whose context was torn down under the manager."""

    def __init__(self, real) -> None:
        self.real = real

    async def recv(self):
        raise zmq.ZMQError(zmq.ETERM, "Context was terminated")

    def close(self, linger=None):
        self.real.close(linger=linger)


def test_a_dead_receive_loop_fails_every_waiter_and_later_requests(runtime):
    manager, fake = runtime
    manager.recv_from_detokenizer = BrokenSocket(manager.recv_from_detokenizer)
    # The loop may die before the request is registered (then it is refused) or after (then it
    # is ended): either way with a 503 that names the receive loop, never a hang.
    try:
        reason = collect(manager, GenerateReqInput(text="Hello"))[-1]["meta_info"]["finish_reason"]
        assert reason["type"] == "abort"
        status, message = reason["status_code"], reason["message"]
    except EngineRequestError as e:
        status, message = e.status_code, e.message
    assert status == 503 and "receive loop" in message
    assert not manager.is_alive()
    with pytest.raises(EngineRequestError) as info:
        collect(manager, GenerateReqInput(text="Hello"))
    assert info.value.status_code == 503


def test_chat_template_and_override(runtime, tokenizer, tmp_path):
    manager, _ = runtime
    messages = [{"role": "user", "content": "hi"}]
    ids = manager.apply_chat_template(messages)
    assert tokenizer.decode(ids) == "user: hi\nassistant:"
    template_file = tmp_path / "t.jinja"
    template_file.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    manager.tokenization.chat_template = tm_module.load_chat_template(str(template_file))
    assert tokenizer.decode(manager.apply_chat_template(messages)) == "[hi]"
    manager.tokenization.chat_template = tm_module.load_chat_template("{{ messages[0]['content'] }}!")
    assert tokenizer.decode(manager.apply_chat_template(messages)) == "hi!"
    manager.tokenization.chat_template = "{% for %}"
    with pytest.raises(EngineRequestError):
        manager.apply_chat_template(messages)


def test_chat_template_kwargs_and_continue_final_message(runtime, tokenizer):
    manager, _ = runtime
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    closed = tokenizer.decode(manager.apply_chat_template(messages, add_generation_prompt=False))
    continued = tokenizer.decode(manager.apply_chat_template(messages, continue_final_message=True))
    # The final message stays open: the same text up to its content, nothing after it.
    assert continued.endswith("Hel") and closed.startswith(continued) and closed != continued
    manager.tokenization.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    ids = manager.apply_chat_template(messages[:1], template_kwargs={"greeting": "yo "})
    assert tokenizer.decode(ids) == "yo hi"


def test_log_requests(runtime, caplog):
    manager, _ = runtime
    manager.server_args.log_requests = True
    with caplog.at_level("INFO", logger="engine.tokenizer.tokenizer_manager"):
        collect(manager, GenerateReqInput(text="Hello", rid="logged", sampling_params={"max_new_tokens": 2}))
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("Receive: rid=logged") for line in lines)
    assert any(line.startswith("Finish: rid=logged") and "'length'" in line for line in lines)


def test_model_info(runtime):
    manager, _ = runtime
    info = manager.get_model_info()
    assert info["model_path"] == "unused" and info["is_generation"] is True
    assert info["context_len"] == CONTEXT_LEN


async def _last(gen):
    result = None
    async for out in gen:
        result = out
    return result
