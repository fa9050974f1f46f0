"""Issue 34, items 1 and 3: what stop strings, stop token ids and stop regexes may cost one request.

Each test is an attack in miniature: a pattern that compiles to hundreds of megabytes, a stop list of
thousands of long strings, a stop check that decodes the whole output at every token. The bounds are
in docs/security.md.
"""

from __future__ import annotations

import gc
import weakref

import pytest

import engine.sampling.stop_regex as stop_regex_module
from engine.scheduler.req import FINISH_MATCHED_REGEX, Req
from engine.sampling.sampling_params import (
    MAX_STOP_STR_LEN,
    MAX_STOP_STRINGS,
    MAX_STOP_STRS_TOTAL_LEN,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from engine.sampling.stop_regex import (
    MAX_STOP_REGEX_SIZE,
    STOP_REGEX_MAX_WINDOW,
    StopRegexCompiler,
    compile_stop_regex,
)
from sched_utils import FakeTokenizer, Harness

NESTED_REPEATS = "(((a{100}){100}){100})"  # 22 bytes; the `regex` module unrolls it to 10^6 nodes


def _verify(**params) -> None:
    SamplingParams(**params).verify(vocab_size=1000)


# ------------------------------------------------------------------------------ item 1: compile cost


def test_nested_counted_repeats_are_refused_before_they_are_compiled():
    # Compiled, the first takes ~280 MB and most of a second; one nesting level more exhausts memory.
    with pytest.raises(ValueError, match="too complex"):
        _verify(stop_regex=NESTED_REPEATS)
    with pytest.raises(ValueError, match="too complex"):
        _verify(stop_regex=["x", "(" + NESTED_REPEATS + ")+"])


@pytest.mark.parametrize("patterns", [
    [f"a{{{MAX_STOP_REGEX_SIZE + 1}}}"],
    ["(ab|cd){600}", "(ef|gh){600}"],  # each fits, together they do not
    ["[a-z0-9_]{1000}"],  # a set costs one node per range
    ["(?:x{50}){1,100}"],  # a range is counted at its upper bound
])
def test_the_bound_counts_the_unrolled_size_of_all_patterns_of_a_request(patterns):
    with pytest.raises(ValueError, match=f"more than {MAX_STOP_REGEX_SIZE} nodes"):
        compile_stop_regex(patterns)


@pytest.mark.parametrize("pattern", [r"\d{1,3}(,\d{3})*\.", r"(foo|bar)+!", "x{2048}", "(?>ab)+c", "a++b",
                                     r"(a)\1", r"(a)?(?(1)b|c)", r"(?<=ab)c", "(?i)END"])
def test_ordinary_patterns_pass(pattern):
    compiled = compile_stop_regex([pattern])
    assert [p.pattern for p in compiled] == [pattern]


@pytest.mark.parametrize("pattern, message", [
    (r"\p{L}", "not a valid regular expression"),  # `regex` syntax Python's parser does not know
    ("(" * 450 + "a" + ")" * 450, "stop_regex"),  # nesting deeper than the walk allows
    ("a{3,2}", "not a valid regular expression"),
])
def test_what_the_check_cannot_parse_is_refused(pattern, message):
    with pytest.raises(ValueError, match=message):
        compile_stop_regex([pattern])


def test_compiled_patterns_stay_out_of_process_wide_caches():
    # Once the request is gone, nothing holds its pattern: no module cache keeps it alive.
    compiled = compile_stop_regex([r"only-this-request-\d{3}"])
    ref = weakref.ref(compiled[0])
    del compiled
    gc.collect()
    assert ref() is None

    sp = SamplingParams(stop_regex=[r"another-request-\d+"])
    sp.verify()
    sp.normalize()
    ref = weakref.ref(sp.stop_regex_compiled[0])
    del sp
    gc.collect()
    assert ref() is None


def test_the_n_samples_of_a_request_share_one_compilation(monkeypatch):
    calls = []
    real = stop_regex_module.compile_stop_regex

    def counting(patterns):
        calls.append(tuple(patterns))
        return real(patterns)

    monkeypatch.setattr(stop_regex_module, "compile_stop_regex", counting)
    compiler = StopRegexCompiler()
    first = compiler.compile(["ab+c"])
    assert compiler.compile(["ab+c"]) is first
    compiler.compile(["other"])
    assert calls == [("ab+c",), ("other",)]

    h = Harness(detokenize=True)
    calls.clear()
    rids = [h.submit([0], rid=f"s_{i}", max_new_tokens=6, stop_regex=["e.g"]) for i in range(4)]
    h.run_until_idle()
    assert calls == [("e.g",)]
    for rid in rids:  # output "bcdefg...": "efg" matches
        assert h.outputs[rid].finished_reason == {"type": "stop", "matched": "e.g"}


def test_a_refused_stop_regex_is_a_400_from_the_scheduler():
    h = Harness()
    rid = h.submit([0], stop_regex=NESTED_REPEATS)
    h.run_until_idle()
    reason = h.outputs[rid].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400 and "too complex" in reason["message"]


# ------------------------------------------------------------------------------ item 3: stop lists


def test_thousands_of_long_stop_strings_are_refused():
    # The attack: 4,000 stop strings of 250 characters on a streamed n=8 request (130 s of scheduler time).
    stops = [f"{i:04d}" + "x" * 246 for i in range(4000)]
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_STRINGS} strings, got 4000"):
        _verify(stop=stops, n=8)


@pytest.mark.parametrize("stop, message", [
    ("y" * (MAX_STOP_STR_LEN + 1), f"at most {MAX_STOP_STR_LEN} characters long, got one of {MAX_STOP_STR_LEN + 1}"),
    (["z" * MAX_STOP_STR_LEN] * 5, f"at most {MAX_STOP_STRS_TOTAL_LEN} characters long together"),
])
def test_stop_string_lengths_are_bounded(stop, message):
    with pytest.raises(ValueError, match=message):
        _verify(stop=stop)


def test_stop_limits_allow_what_clients_send():
    _verify(stop=["w" * MAX_STOP_STR_LEN] * (MAX_STOP_STRS_TOTAL_LEN // MAX_STOP_STR_LEN))
    _verify(stop=[f"<{i}>" for i in range(MAX_STOP_STRINGS)], stop_token_ids=[i % 1000 for i in range(MAX_STOP_TOKEN_IDS)],
            n=8)


def test_stop_token_ids_are_bounded_and_the_message_stays_short():
    ids = [1] * (MAX_STOP_TOKEN_IDS + 1)
    with pytest.raises(ValueError, match=f"at most {MAX_STOP_TOKEN_IDS} integer token ids") as info:
        _verify(stop_token_ids=ids)
    assert len(str(info.value)) < 400  # the refused list is not echoed whole


class _CountingTokenizer(FakeTokenizer):
    def __init__(self) -> None:
        self.decoded_lengths: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.decoded_lengths.append(len(ids))
        return super().decode(ids, **kwargs)


def _req_with(output_len: int, **params) -> tuple[Req, _CountingTokenizer]:
    sp = SamplingParams(max_new_tokens=1 << 20, **params)
    sp.verify()
    tokenizer = _CountingTokenizer()
    sp.normalize(tokenizer)
    req = Req("r", [0], sp)
    req.tokenizer = tokenizer
    req.output_ids = [i % 25 for i in range(output_len)]  # never "#": nothing matches yet
    return req, tokenizer


@pytest.mark.parametrize("params", [dict(stop_regex=[".*#"]), dict(stop_regex=["a+#"]),
                                    dict(stop=["#" * MAX_STOP_STR_LEN]), dict(stop_regex=["#"], stop=["##"])])
def test_the_per_token_stop_check_does_not_grow_with_the_output(params):
    decoded = {}
    for output_len in (3 * STOP_REGEX_MAX_WINDOW, 30 * STOP_REGEX_MAX_WINDOW):
        req, tokenizer = _req_with(output_len, **params)
        req.check_finished()
        assert not req.finished()
        decoded[output_len] = sum(tokenizer.decoded_lengths)
    # The same tail is decoded after 3k and after 30k tokens (a pattern without bound is searched
    # in the last STOP_REGEX_MAX_WINDOW tokens, as a stop string in its own length's window).
    assert decoded[3 * STOP_REGEX_MAX_WINDOW] == decoded[30 * STOP_REGEX_MAX_WINDOW] <= 3 * (STOP_REGEX_MAX_WINDOW + 1)


def test_an_unbounded_stop_regex_still_matches_inside_the_window():
    req, _ = _req_with(5000, stop_regex=["k.*#"])
    req.output_ids.append(HASH_ID)
    req.tokenizer = _HashTokenizer()
    req.check_finished()
    assert isinstance(req.finished_reason, FINISH_MATCHED_REGEX)


HASH_ID = 2600


class _HashTokenizer(FakeTokenizer):
    """FakeTokenizer's letters, and "#" for HASH_ID."""

    def decode(self, ids, **kwargs) -> str:
        return "".join("#" if i == HASH_ID else chr(ord("a") + i % 26) for i in ids)
