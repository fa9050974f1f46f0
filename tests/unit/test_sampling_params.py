"""SamplingParams: defaults, validation messages, normalisation and the IPC round trip."""

from __future__ import annotations

import msgspec
import pytest

from engine.sampling.sampling_params import SamplingParams


def test_defaults_match_sglang() -> None:
    p = SamplingParams()
    assert (p.max_new_tokens, p.min_new_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (128, 0, 1.0, 1.0, -1, 0.0)
    assert (p.frequency_penalty, p.presence_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop is None and p.stop_token_ids is None and p.logit_bias is None and p.sampling_seed is None
    assert (p.ignore_eos, p.skip_special_tokens, p.spaces_between_special_tokens, p.no_stop_trim) == (
        False, True, True, False,
    )
    assert p.n == 1
    p.verify(vocab_size=100)


def test_unknown_key_raises_and_names_it() -> None:
    with pytest.raises(ValueError, match="bogus_knob"):
        SamplingParams(temperature=0.5, bogus_knob=3)


INVALID = [
    # (kwargs, field named in the message, allowed range named in the message)
    ({"temperature": -0.1}, "temperature", ">= 0"),
    ({"temperature": "hot"}, "temperature", ">= 0"),
    ({"temperature": True}, "temperature", ">= 0"),
    ({"temperature": float("nan")}, "temperature", ">= 0"),
    ({"top_p": 0.0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "[1, 2147483647]"),
    ({"top_k": 2.5}, "top_k", "[1, 2147483647]"),
    ({"top_k": 1 << 40}, "top_k", "[1, 2147483647]"),
    ({"min_p": -0.1}, "min_p", "[0, 1]"),
    ({"min_p": 1.1}, "min_p", "[0, 1]"),
    ({"frequency_penalty": 2.5}, "frequency_penalty", "[-2, 2]"),
    ({"frequency_penalty": -2.01}, "frequency_penalty", "[-2, 2]"),
    ({"presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "(0, 2]"),
    ({"repetition_penalty": 2.1}, "repetition_penalty", "(0, 2]"),
    ({"max_new_tokens": -1}, "max_new_tokens", "[0, 2147483647]"),
    ({"max_new_tokens": 1.5}, "max_new_tokens", "[0, 2147483647]"),
    ({"min_new_tokens": -1}, "min_new_tokens", "[0, 2147483647]"),
    ({"min_new_tokens": 5, "max_new_tokens": 4}, "min_new_tokens", "<= max_new_tokens (4)"),
    ({"n": 0}, "n", "[1, 128]"),
    ({"n": "2"}, "n", "[1, 128]"),
    ({"n": 129}, "n", "[1, 128]"),
    ({"sampling_seed": 1 << 80}, "sampling_seed", "64-bit"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"stop": ["ok", ""]}, "stop", "non-empty"),
    ({"stop": [1, 2]}, "stop", "list of strings"),
    ({"stop_token_ids": [1, -3]}, "stop_token_ids", ">= 0"),
    ({"stop_token_ids": [1, 100]}, "stop_token_ids", "< vocab_size (100)"),
    ({"stop_token_ids": "7"}, "stop_token_ids", "token ids"),
    ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
    ({"sampling_seed": 1.5}, "sampling_seed", "integer"),
    ({"logit_bias": {"100": 1.0}}, "logit_bias", "< vocab_size (100)"),
    ({"logit_bias": {"abc": 1.0}}, "logit_bias", "token id"),
    ({"logit_bias": {"5": 101.0}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {5: "big"}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": [1, 2]}, "logit_bias", "mapping"),
    # JSON integers are unbounded; the scheduler's msgpack holds 64 bits (a fuzzer found the 500).
    ({"custom_params": {"x": 1 << 64}}, "custom_params", "fit 64 bits"),
    ({"custom_params": {"a": [{"b": -(1 << 70)}]}}, "custom_params", "fit 64 bits"),
]


@pytest.mark.parametrize("kwargs,field,allowed", INVALID)
def test_invalid_values_name_field_and_range(kwargs: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs).verify(vocab_size=100)
    message = str(info.value)
    assert message.startswith(field), message
    assert allowed in message, message


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0},
        {"top_p": 1.0},
        {"top_k": 1},
        {"top_k": 0},
        {"min_p": 1.0},
        {"frequency_penalty": -2, "presence_penalty": 2},
        {"repetition_penalty": 2.0},
        {"max_new_tokens": 0},
        {"max_new_tokens": None, "min_new_tokens": 1000},
        {"min_new_tokens": 4, "max_new_tokens": 4},
        {"stop": "x", "stop_token_ids": [0, 99]},
        {"logit_bias": {"0": -100, 99: 100.0}},
        {"sampling_seed": -(1 << 63)},
        {"custom_params": {"x": (1 << 64) - 1, "y": -(1 << 63), "z": [1.5, None, "s", {"w": True}]}},
    ],
)
def test_edge_values_are_valid(kwargs: dict) -> None:
    SamplingParams(**kwargs).verify(vocab_size=100)


def test_top_k_zero_means_disabled() -> None:
    assert SamplingParams(top_k=0).top_k == -1


def test_vocab_checks_are_skipped_without_vocab_size() -> None:
    SamplingParams(stop_token_ids=[10**6], logit_bias={"123456": 1}).verify()


def test_normalize_greedy_and_stops() -> None:
    p = SamplingParams(temperature=0.0, top_k=50, stop="</s>", stop_token_ids=[3, 3, 7])
    p.normalize(None)
    assert (p.temperature, p.top_k) == (1.0, 1)
    assert p.is_greedy
    assert p.stop == ["</s>"] and p.stop_strs == ["</s>"]
    assert p.stop_str_max_len == 4  # characters without a tokenizer
    assert p.stop_token_ids == {3, 7}
    before = p.to_dict()
    p.normalize(None)  # idempotent
    assert p.to_dict() == before


def test_normalize_non_greedy_keeps_temperature() -> None:
    p = SamplingParams(temperature=0.7, top_k=5)
    p.normalize()
    assert (p.temperature, p.top_k, p.stop, p.stop_token_ids, p.stop_str_max_len) == (0.7, 5, [], set(), 0)


class _WordTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [len(w) for w in text.split()]


def test_stop_str_max_len_in_tokens_with_tokenizer() -> None:
    p = SamplingParams(stop=["a b c", "longwordonly"])
    p.normalize(_WordTokenizer())
    assert p.stop_str_max_len == 3


def test_ipc_round_trip_through_msgpack_and_json() -> None:
    p = SamplingParams(
        max_new_tokens=None, temperature=0.3, top_k=4, stop=["x", "yy"], stop_token_ids=[9, 2],
        sampling_seed=42, logit_bias={5: 1.5, "7": -2}, n=2, ignore_eos=True,
    )
    p.verify(vocab_size=10)
    p.normalize()
    d = p.to_dict()
    for codec in (msgspec.msgpack, msgspec.json):
        back = SamplingParams.from_dict(codec.decode(codec.encode(d)))
        back.normalize()
        assert back == p
    assert d["stop_token_ids"] == [2, 9] and d["logit_bias"] == {"5": 1.5, "7": -2.0}


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="seed"):
        SamplingParams.from_dict({"seed": 3})
