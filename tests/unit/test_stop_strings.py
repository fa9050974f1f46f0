"""Stop strings: which occurrence ends a request, and where the text is cut (scheduler + detokenizer).

The fake worker counts up (token i is followed by i + 1) and the fake tokenizer spells token i as
the letter chr(ord("a") + i % 26), so from prompt [0] the output text is "bcdefgh...zabcd...".
"""

from __future__ import annotations

import pytest

from sched_utils import FakeTokenizer, Harness

ALPHABET_FROM_B = "bcdefghijklmnopqrstuvwxyz" + "ab"  # output tokens 1..27


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_an_occurrence_before_min_new_tokens_is_ignored_and_kept_in_the_text(stream, overlap):
    # "cd" is produced by output tokens 2-3, before min_new_tokens=4, and again by tokens 28-29.
    # It is still in the stop-check window at token 4: that old occurrence must not end the
    # request, and the text is cut at the occurrence that did.
    h = Harness(detokenize=True, overlap=overlap)
    rid = h.submit([0], max_new_tokens=40, min_new_tokens=4, stop=["cd"], stream=stream)
    h.run_until_idle()
    out = h.outputs[rid]
    assert out.finished_reason == {"type": "stop", "matched": "cd"}
    assert len(out.output_ids) == 29
    assert out.text == ALPHABET_FROM_B


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
    rid = h.submit([0], max_new_tokens=40, min_new_tokens=3, stop=["cd"])
    h.run_until_idle()
    # Tokens 1..5 spell "b" "cd"(ignored: it ends before token 3) "e"... token 2 is "c", 3 "d".
    assert h.outputs[rid].text == "b"
    h = Harness(tokenizer=Doubling(), detokenize=True)
    rid = h.submit([0], max_new_tokens=40, min_new_tokens=4, stop=["cd"])
    h.run_until_idle()
    assert h.outputs[rid].output_ids[-1] == 5
    assert h.outputs[rid].text == "bcde"
