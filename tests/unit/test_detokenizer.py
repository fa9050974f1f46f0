"""DetokenizerManager: incremental detokenization, stop trimming, special tokens, batching."""

from __future__ import annotations

import multiprocessing
import random
import shutil

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer.detokenizer_manager import DetokenizerManager, run_detokenizer_process
from engine.io_struct import BatchStrOutput, BatchTokenIDOutput, decode, encode
from engine.port_args import PortArgs
from engine.server_args import ServerArgs
from engine.utils.zmq_utils import get_zmq_socket

REPLACEMENT = "\ufffd"


def build_test_tokenizer():
    """A tiny byte-level BPE: characters outside its small corpus split into byte tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|eot|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = ["Hello world, this is a small corpus for the test tokenizer."] * 20
    corpus += ["The quick brown fox jumps over the lazy dog. STOP here."] * 20
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def tokenizer():
    return build_test_tokenizer()


def batch(rids, new_ids, finished=None, skip_special=True, no_stop_trim=False):
    n = len(rids)
    return BatchTokenIDOutput(
        rids=list(rids),
        finished_reasons=list(finished) if finished is not None else [None] * n,
        output_ids=[list(x) for x in new_ids],
        skip_special_tokens=[skip_special] * n,
        spaces_between_special_tokens=[True] * n,
        no_stop_trim=[no_stop_trim] * n,
        prompt_tokens=[3] * n,
        completion_tokens=[len(x) for x in new_ids],
        cached_tokens=[0] * n,
    )


def stream_ids(manager, rid, chunks, finished_reason, **kw):
    """Feed `chunks` of ids as successive iterations; return the list of text deltas."""
    deltas = []
    for k, chunk in enumerate(chunks):
        last = k == len(chunks) - 1
        out = manager.handle_batch_token_id_out(batch([rid], [chunk], [finished_reason if last else None], **kw))
        deltas.append(out.output_strs[0])
    return deltas


LENGTH = {"type": "length", "length": 100}


def test_multibyte_characters_split_over_tokens_never_emit_replacement(tokenizer):
    text = "héllo 世界 🎉 ok"
    ids = tokenizer.encode(text)
    # The tokenizer really splits characters into byte tokens (else the test proves nothing).
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids)
    manager = DetokenizerManager(tokenizer)
    deltas = stream_ids(manager, "r", [[i] for i in ids], LENGTH)
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text
    # Text is not only flushed at the end: complete characters stream out as they complete.
    assert sum(1 for d in deltas if d) > 3


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.sampled_from(list("abc XYZ.,") + ["é", "世", "界", "🎉", "ж", "\n"]), max_size=40),
    seed=st.integers(0, 2**16),
)
def test_deltas_concatenate_to_decoded_text(tokenizer, text, seed):
    ids = tokenizer.encode(text) + [tokenizer.encode("x")[0]]
    rng = random.Random(seed)
    chunks, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4)
        chunks.append(ids[i:i + step])
        i += step
    manager = DetokenizerManager(tokenizer)
    deltas = stream_ids(manager, "r", chunks, LENGTH)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all(REPLACEMENT not in d for d in deltas)
    assert manager.decode_status == {}


def test_invalid_byte_sequences_still_concatenate_to_final_text(tokenizer):
    # Lone continuation bytes never form a character: the final flush must still be exact.
    byte_tokens = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == REPLACEMENT]
    rng = random.Random(0)
    ids = [rng.choice(byte_tokens) for _ in range(30)] + tokenizer.encode(" ok")
    manager = DetokenizerManager(tokenizer)
    deltas = stream_ids(manager, "r", [[i] for i in ids], LENGTH)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_is_trimmed_at_finish(tokenizer):
    ids = tokenizer.encode("Hello world STOP here")
    manager = DetokenizerManager(tokenizer)
    reason = {"type": "stop", "matched": "STOP"}
    deltas = stream_ids(manager, "r", [ids[:2], ids[2:]], reason)
    assert "".join(deltas) == "Hello world "


@pytest.mark.parametrize("chunks", [[[316, 322, 330, 322]], [[316, 322], [330], [322]], [[316], [322], [330, 322]]])
def test_stop_string_is_cut_where_it_ended_the_request_not_at_an_earlier_ignored_one(tokenizer, chunks):
    # With min_new_tokens a stop string may occur before the one that ends the request; that
    # earlier one was ignored and stays in the text, streamed or not.
    ids = [i for chunk in chunks for i in chunk]
    assert tokenizer.decode(ids) == "Hello STOP world STOP"
    manager = DetokenizerManager(tokenizer)
    deltas = stream_ids(manager, "r", chunks, {"type": "stop", "matched": "STOP"})
    assert "".join(deltas) == "Hello STOP world "


def test_stop_string_kept_with_no_stop_trim(tokenizer):
    ids = tokenizer.encode("Hello world STOP here")
    manager = DetokenizerManager(tokenizer)
    reason = {"type": "stop", "matched": "STOP"}
    deltas = stream_ids(manager, "r", [ids[:2], ids[2:]], reason, no_stop_trim=True)
    assert "".join(deltas) == "Hello world STOP here"


def test_matched_stop_token_is_trimmed_unless_no_stop_trim(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hello world") + [eos]
    reason = {"type": "stop", "matched": eos}
    trimmed = stream_ids(DetokenizerManager(tokenizer), "a", [[i] for i in ids], reason, skip_special=False)
    assert "".join(trimmed) == "Hello world"
    kept = stream_ids(DetokenizerManager(tokenizer), "b", [[i] for i in ids], reason, skip_special=False,
                      no_stop_trim=True)
    assert "".join(kept) == "Hello world</s>"


def test_skip_special_tokens(tokenizer):
    ids = tokenizer.encode("Hello") + [tokenizer.convert_tokens_to_ids("<|eot|>")] + tokenizer.encode(" world")
    skipped = stream_ids(DetokenizerManager(tokenizer), "a", [ids[:2], ids[2:]], LENGTH, skip_special=True)
    assert "".join(skipped) == "Hello world"
    kept = stream_ids(DetokenizerManager(tokenizer), "b", [ids[:2], ids[2:]], LENGTH, skip_special=False)
    assert "".join(kept) == "Hello<|eot|> world"


def test_interleaved_requests_one_batch_decode_per_iteration(tokenizer):
    calls = []
    original = tokenizer.batch_decode

    class CountingTokenizer:
        def batch_decode(self, *args, **kwargs):
            calls.append(len(args[0]))
            return original(*args, **kwargs)

    manager = DetokenizerManager(CountingTokenizer())
    texts = {"a": "Hello 世界", "b": "quick brown fox 🎉", "c": "lazy dog"}
    ids = {rid: tokenizer.encode(t) for rid, t in texts.items()}
    got = {rid: "" for rid in texts}
    step = 0
    while any(step < len(v) for v in ids.values()):
        rids = [r for r in texts if step < len(ids[r])]
        finished = [LENGTH if step == len(ids[r]) - 1 else None for r in rids]
        out = manager.handle_batch_token_id_out(batch(rids, [[ids[r][step]] for r in rids], finished))
        assert isinstance(out, BatchStrOutput) and out.rids == rids
        for r, delta in zip(out.rids, out.output_strs):
            assert REPLACEMENT not in delta
            got[r] += delta
        step += 1
    assert got == texts
    assert len(calls) == step  # one batch_decode per iteration, whatever the number of requests
    assert manager.decode_status == {}


def test_abort_of_unknown_request_passes_through(tokenizer):
    manager = DetokenizerManager(tokenizer)
    reason = {"type": "abort", "message": "The request queue is full.", "status_code": 503}
    out = manager.handle_batch_token_id_out(batch(["x"], [[]], [reason]))
    assert out.output_strs == [""] and out.finished_reasons == [reason]
    assert manager.decode_status == {}


@pytest.mark.slow  # a spawned detokenizer process
def test_detokenizer_process_over_zmq(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    server_args = ServerArgs(model_path=str(tmp_path), device="cpu", log_level="warning")
    port_args = PortArgs.init_new(server_args)
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=run_detokenizer_process, args=(server_args, port_args, None, writer))
    zctx = zmq.Context()
    recv = get_zmq_socket(zctx, zmq.PULL, port_args.tokenizer_ipc_name, bind=True)
    send = get_zmq_socket(zctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
    proc.start()
    try:
        assert reader.poll(60), "detokenizer did not report"
        assert reader.recv()["status"] == "ready"
        ids = tokenizer.encode("Hello 世界")
        send.send(encode(batch(["r"], [ids[:3]])))
        send.send(encode(batch(["r"], [ids[3:]], [LENGTH])))
        texts = []
        for _ in range(2):
            assert recv.poll(30_000)
            msg = decode(recv.recv())
            assert isinstance(msg, BatchStrOutput)
            texts.append(msg.output_strs[0])
        assert "".join(texts) == "Hello 世界"
    finally:
        proc.kill()
        proc.join(10)
        recv.close()
        send.close()
        zctx.term()
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def test_first_output_tokens_keep_their_leading_space_with_prompt_context():
    """SentencePiece-style tokenizers drop the leading space of the first token decoded alone; the
    scheduler sends the prompt's last ids as left context with the first emission."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert hf.decode([2]) == "world"  # the problem: decoded alone, the space is gone

    from engine.detokenizer.detokenizer_manager import DetokenizerManager
    from engine.io_struct import BatchTokenIDOutput

    def msg(ids, tail, finished=None):
        return BatchTokenIDOutput(rids=["a"], finished_reasons=[finished], output_ids=[ids],
                                  skip_special_tokens=[True], spaces_between_special_tokens=[True],
                                  no_stop_trim=[False], prompt_tokens=[1], completion_tokens=[len(ids)],
                                  cached_tokens=[0], prompt_tail_ids=[tail])

    detok = DetokenizerManager(hf)
    first = detok.handle_batch_token_id_out(msg([2], [1])).output_strs[0]
    second = detok.handle_batch_token_id_out(msg([3], None, {"type": "length", "length": 2})).output_strs[0]
    assert first + second == " world again"


# ---------------------------------------------------------------------------- the batch decoder
@pytest.mark.parametrize("which", ["test", "builtin"])
def test_direct_batch_decoder_equals_batch_decode(tokenizer, which):
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model
    from engine.utils.tokenizer_utils import make_batch_decoder

    tok = tokenizer if which == "test" else AutoTokenizer.from_pretrained(ensure_builtin_model())
    decode = make_batch_decoder(tok)
    assert decode.__name__ == "fast"  # the direct path is taken for a plain fast tokenizer
    rng = random.Random(7)
    vocab = len(tok)
    sequences = [[rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(300)]
    for skip in (True, False):
        assert decode(sequences, skip, True) == tok.batch_decode(sequences, skip_special_tokens=skip)


def test_batch_decoder_keeps_an_overridden_decode(tokenizer):
    from engine.utils.tokenizer_utils import make_batch_decoder

    class Custom(type(tokenizer)):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return "<" + super()._decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs) + ">"

    custom = Custom(tokenizer_object=tokenizer.backend_tokenizer)
    assert make_batch_decoder(custom)([[5, 6], [7]], True, True) == custom.batch_decode([[5, 6], [7]],
                                                                                       skip_special_tokens=True)


def test_the_launchers_tokenizer_travels_to_the_detokenizer_without_torch(tmp_path):
    """launch_children hands the detokenizer its loaded tokenizer as bytes: the copy encodes and
    decodes as the one loaded from disk does, and loading it imports neither torch nor
    AutoTokenizer's config path (the seconds it saves at every start)."""
    import subprocess
    import sys

    from engine.builtin_model import ensure_builtin_model
    from engine.utils.tokenizer_utils import load_tokenizer, tokenizer_to_bytes

    path = ensure_builtin_model()
    original = load_tokenizer(path)
    data = tokenizer_to_bytes(original)
    assert data is not None
    (tmp_path / "tok.bin").write_bytes(data)
    text = "Hello <|eot|> wörld"
    ids = original(text).input_ids
    script = (
        "import sys, json\n"
        "from engine.utils.tokenizer_utils import tokenizer_from_bytes\n"
        f"t = tokenizer_from_bytes(open({str(tmp_path / 'tok.bin')!r}, 'rb').read(), '/nonexistent')\n"
        f"print(json.dumps([t({text!r}).input_ids, t.decode({ids!r}), t.decode({ids!r}, skip_special_tokens=True),"
        " 'torch' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    import json

    got_ids, text_all, text_skip, torch_imported = json.loads(out.stdout.strip().splitlines()[-1])
    assert got_ids == ids
    assert text_all == original.decode(ids)
    assert text_skip == original.decode(ids, skip_special_tokens=True)
    assert torch_imported is False


def test_a_tokenizer_that_cannot_travel_is_loaded_from_disk(tokenizer, tmp_path):
    """Bytes that do not unpickle (or none) mean: load from the directory; a class of remote code
    (outside transformers) is never pickled, the child loads it itself."""
    from engine.utils.tokenizer_utils import tokenizer_from_bytes, tokenizer_to_bytes

    tokenizer.save_pretrained(tmp_path)
    for data in (None, b"not a pickle"):
        loaded = tokenizer_from_bytes(data, str(tmp_path))
        assert loaded.encode("Hello world") == tokenizer.encode("Hello world")

    class RemoteCodeTokenizer:
        pass

    RemoteCodeTokenizer.__module__ = "transformers_modules.some_model.tokenization"
    assert tokenizer_to_bytes(RemoteCodeTokenizer()) is None
