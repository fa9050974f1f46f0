"""Stop strings: which occurrence ends a request, and where the text is cut (scheduler + detokenizer).

The fake worker counts up (token i is followed by i + 1) and the fake tokenizer spells token i as
the letter chr(ord("a") + i % 26), so from prompt [0] the output text is "bcdefgh...zabcd...".
"""

from __future__ import annotations

import pytest
import torch

from engine.scheduler.overlap_utils import write_relay
from engine.scheduler.tp_worker import GenerationBatchResult
from sched_utils import FakeTokenizer, FakeWorker, Harness

ALPHABET_FROM_B = "bcdefghijklmnopqrstuvwxyz" + "ab"  # output tokens 1..27


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_before_min_new_tokens_ends_the_request(stream, overlap):
    # SGLang: min_new_tokens masks stop *tokens* only; "cd" (output tokens 2-3) ends the request
    # although min_new_tokens=6, and the text ends where the ids do.
    h = Harness(detokenize=True, overlap=overlap)
    rid = h.submit([0], max_new_tokens=40, min_new_tokens=6, stop=["cd"], stream=stream)
    h.run_until_idle()
    out = h.outputs[rid]
    assert out.finished_reason == {"type": "stop", "matched": "cd"}
    assert out.output_ids == [1, 2, 3]
    assert out.text == "b"


def test_a_stop_regex_before_min_new_tokens_ends_the_request():
    h = Harness(detokenize=True)
    rid = h.submit([0], max_new_tokens=40, min_new_tokens=6, stop_regex=["c+d"])
    h.run_until_idle()
    out = h.outputs[rid]
    assert out.finished_reason == {"type": "stop", "matched": "c+d"}
    assert out.output_ids == [1, 2, 3]
    assert out.text == "bcd"  # a stop_regex match is not trimmed (SGLang)


def test_min_new_tokens_still_holds_back_stop_tokens():
    # Token 3 is a stop token: the sampler masks it before min_new_tokens; the fake worker does not
    # sample, so the finish check must not end the request on it either.
    h = Harness(detokenize=True)
    rid = h.submit([0], max_new_tokens=40, min_new_tokens=6, stop_token_ids=[3, 7])
    h.run_until_idle()
    assert h.outputs[rid].output_ids == [1, 2, 3, 4, 5, 6, 7]
    assert h.outputs[rid].finished_reason == {"type": "stop", "matched": 7}


def test_an_occurrence_completed_by_the_min_new_tokens_th_token_ends_the_request():
    h = Harness(detokenize=True)
    rid = h.submit([0], max_new_tokens=40, min_new_tokens=3, stop=["cd"])
    h.run_until_idle()
    assert len(h.outputs[rid].output_ids) == 3
    assert h.outputs[rid].text == "b"


def test_without_min_new_tokens_the_first_occurrence_ends_the_request():
    h = Harness(detokenize=True)
    rid = h.submit([0], max_new_tokens=40, stop=["xyz", "cd"], stream=True)
    h.run_until_idle()
    assert h.outputs[rid].finished_reason == {"type": "stop", "matched": "cd"}
    assert h.outputs[rid].text == "b"


def test_two_occurrences_completed_by_the_last_token_cut_at_the_first():
    # A token that spells "cdcd" completes two occurrences at once: the text ends before the first.
    class Doubling(FakeTokenizer):
        def decode(self, ids, **kwargs):
            return "".join("cdcd" if i == 5 else super(Doubling, self).decode([i]) for i in ids)

    h = Harness(tokenizer=Doubling(), detokenize=True)
    rid = h.submit([3], max_new_tokens=40, stop=["cd"])
    h.run_until_idle()
    # Tokens 4, 5 spell "e" "cdcd".
    assert h.outputs[rid].output_ids == [4, 5]
    assert h.outputs[rid].text == "e"


# ---------------------------------------------------------------------------------------------
# The built-in model's byte-level tokenizer: text and ids agree (SGLang's rule as the oracle)
# ---------------------------------------------------------------------------------------------
class ScriptedWorker(FakeWorker):
    """Every request (a one-token prompt) gets `script` as its output, token by token."""

    def __init__(self, script, vocab_size):
        super().__init__()
        self.script = list(script)
        self.vocab_size = vocab_size

    def get_worker_info(self):
        return {**super().get_worker_info(), "vocab_size": self.vocab_size}

    def forward_batch_generation(self, batch):
        nxt = torch.tensor([self.script[min(n - 1, len(self.script) - 1)] for n in batch.seq_lens_cpu],
                           dtype=torch.int64)
        write_relay(self.output_tokens_buf, batch.req_pool_indices, nxt)
        return GenerationBatchResult(logits_output=None, next_token_ids=nxt)


@pytest.fixture(scope="module")
def byte_tokenizer():
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    return AutoTokenizer.from_pretrained(ensure_builtin_model())


def single_byte_token(tokenizer, byte):
    """The id of the byte-level token that stands for `byte` alone."""
    from engine.utils.tokenizer_utils import byte_level_alphabet

    char = next(c for c, b in byte_level_alphabet().items() if b == byte)
    return tokenizer.convert_tokens_to_ids(char)


def sglang_stop(tokenizer, script, stop):
    """SGLang's outcome: the ids end with the first token after which the text holds the stop
    string, and the text is cut where that first occurrence starts."""
    for n in range(1, len(script) + 1):
        text = tokenizer.decode(script[:n])
        if stop in text:
            return script[:n], text[:text.find(stop)]
    return script, tokenizer.decode(script)


def run_script(tokenizer, script, stream=False, overlap=False, **sampling):
    h = Harness(worker=ScriptedWorker(script, len(tokenizer)), tokenizer=tokenizer, detokenize=True, overlap=overlap)
    rid = h.submit([0], max_new_tokens=len(script), stream=stream, **sampling)
    h.run_until_idle()
    return h.outputs[rid]


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_spelled_in_byte_tokens_ends_at_its_first_occurrence(byte_tokenizer, stream):
    # "😀" is two tokens here, each half of its UTF-8; before the fix a stop string ending in a
    # character completed by the newest token was never matched (the partial character decoded
    # as U+FFFD made the earlier text look as long as the whole).
    tok = byte_tokenizer
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) == 2 and "\ufffd" in tok.decode(emoji[:1])
    # ... and spelled byte by byte: more tokens than the stop string encodes to.
    byte_by_byte = [single_byte_token(tok, b) for b in "😀".encode()]
    assert tok.decode(byte_by_byte) == "😀"
    script = (tok.encode("ab", add_special_tokens=False) + emoji * 3 + byte_by_byte * 2
              + tok.encode("cd", add_special_tokens=False))
    for stop in ("😀", "b😀", "😀😀", "😀c"):
        out = run_script(tok, script, stream=stream, stop=[stop], min_new_tokens=len(script) - 1)
        ids, text = sglang_stop(tok, script, stop)
        assert out.finished_reason == {"type": "stop", "matched": stop}
        assert (out.output_ids, out.text) == (ids, text), stop


def test_text_and_ids_agree_on_random_outputs(byte_tokenizer):
    """Random outputs of whole and partial characters, stop strings cut from their text (often
    repeated in it): the ids end at the first occurrence and the text is cut there, as SGLang's."""
    import random

    tok = byte_tokenizer
    rng = random.Random(0)
    pieces = ["a", "b", "ab", " ", "é", "札", "😀", "ж", "nt", "\n"]
    pool = sorted({t for p in pieces for t in tok.encode(p, add_special_tokens=False)}
                  | {single_byte_token(tok, b) for b in "😀札".encode()})
    checked = 0
    for _ in range(120):
        script = [rng.choice(pool) for _ in range(rng.randint(4, 14))]
        text = tok.decode(script)
        start = rng.randrange(len(text))
        stop = text[start:start + rng.randint(1, 4)]
        if "\ufffd" in stop:
            continue
        out = run_script(tok, script, stream=rng.random() < 0.5, overlap=rng.random() < 0.5, stop=[stop])
        ids, expected_text = sglang_stop(tok, script, stop)
        assert out.output_ids == ids, (script, stop)
        assert out.text == expected_text, (script, stop)
        checked += 1
    assert checked >= 40
