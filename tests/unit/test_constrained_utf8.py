"""Constrained output is valid UTF-8 and matches its schema, also when sampled.

xgrammar's character classes let the UTF-8-style bytes of surrogates through (ED A0 80): a
`maxLength: 12` string came back with 14 characters, three of them U+FFFD. `utf8_guard` masks
every token that would make the output invalid UTF-8; these tests check it against Python's
decoder, and check sampled outputs (many seeds, many schemas) with a JSON-schema validator and a
strict UTF-8 decode of the tokens' own bytes. In-process (Harness + the real TpModelWorker)."""

from __future__ import annotations

import json
import random
from typing import Any, List

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from sched_utils import Harness

xgrammar = pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar (pip install xgrammar)")
jsonschema = pytest.importorskip("jsonschema", reason="schema validation needs jsonschema")

from engine.constrained.utf8_guard import ACCEPT, STATES, Utf8Masks, advance  # noqa: E402
from engine.utils.tokenizer_utils import make_token_bytes  # noqa: E402


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _valid_prefix(data: bytes) -> bool:
    """Some continuation makes `data` valid UTF-8 (Python's incremental decoder lets b"\xed\xa0"
    pass while it waits, so completions are tried: the first continuation byte is the only one
    with a narrower range)."""
    if _decodes(data):
        return True
    return any(_decodes(data + bytes([first]) + b"\x80" * more) for more in range(3) for first in range(0x80, 0xC0))


def _allowed(masks: Utf8Masks, state: int) -> List[bool]:
    words = masks.masks[state].numpy().view("<u4")
    return [bool(words[i // 32] >> (i % 32) & 1) for i in range(len(masks.token_bytes))]


@pytest.mark.slow  # every state of the guard against the whole vocabulary
def test_the_masks_allow_exactly_what_keeps_the_bytes_valid_utf8():
    """Oracle: Python's strict decoder. Random byte strings as a vocabulary, random valid prefixes
    as the output so far: a token is allowed iff prefix + token is valid UTF-8 up to an unfinished
    last character (and a token without bytes only between characters)."""
    rng = random.Random(0)
    interesting = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0, 0xE1,
                   0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]
    vocab = [b""] + [bytes([b]) for b in range(256)]
    vocab += [bytes(rng.choice(interesting) for _ in range(rng.randint(1, 5))) for _ in range(600)]
    vocab += [c.encode() for c in "é札😀\ud7ff\ue000\U0010ffff"]
    # Invalid inside one token (Python's incremental decoder lets the first two wait for more).
    vocab += [b"a\xed\xa0", b"\x7f\xe0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf"]
    masks = Utf8Masks(vocab, (len(vocab) + 31) // 32 + 1)
    prefixes = [b"", b"a", b"\xc3", b"\xe0", b"\xe0\xa0", b"\xed", b"\xed\x9f", b"\xf0", b"\xf0\x90", b"\xf0\x90\x80",
                b"\xf4", b"\xf4\x8f", b"\xf1\x80", "札".encode()[:2]]
    for prefix in prefixes:
        state = advance(ACCEPT, prefix)
        assert state is not None
        allowed = _allowed(masks, state)
        for token, ok in zip(vocab, allowed):
            expected = _valid_prefix(prefix + token) and (bool(token) or state == ACCEPT)
            assert ok == expected, (prefix, token)
            if ok:
                assert masks.next_state(state, vocab.index(token)) == advance(state, token)
    assert len(STATES) == 8


# ---------------------------------------------------------------------------------------------
# Sampled constrained outputs on the built-in model
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    return path, AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def harness(model):
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    path, tok = model
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=32768, max_running_requests=64)
    return Harness(worker=TpModelWorker(args), tokenizer=tok, max_total_tokens=32768, overlap=True,
                   constrained_json_disable_any_whitespace=True)


def output_text(model, ids: List[int]) -> str:
    """The output's text from its tokens' own bytes, decoded strictly (raises on invalid UTF-8);
    the stop token that ends a complete grammar is not part of it (other special tokens are their
    text, which a grammar may match: `<|system|>` is "<", 8 characters, ">")."""
    from engine.builtin_model import STOP_TOKEN_IDS

    token_bytes = make_token_bytes(model[1])
    return b"".join(token_bytes(i) or b"" for i in ids if i not in STOP_TOKEN_IDS).decode("utf-8")


def high_byte_bias(model, rng: random.Random) -> dict:
    """A logit_bias that favours raw high bytes (lead and continuation bytes of multi-byte
    characters, and the ones no character uses): the outputs then spell characters byte by byte,
    where a grammar that checks bytes loosely lets invalid sequences through."""
    from engine.utils.tokenizer_utils import byte_level_alphabet

    tok = model[1]
    ids = {b: tok.convert_tokens_to_ids(c) for c, b in byte_level_alphabet().items() if b >= 0x80}
    picked = rng.sample(sorted(ids), 24) + [0xED, 0xE0, 0xF4, 0xA0, 0xBF, 0x80]
    return {str(ids[b]): rng.uniform(4.0, 9.0) for b in picked}


def run_sampled(model, h: Harness, schemas: List[dict], seed0: int, temperature: float = 1.0,
                biased: bool = True) -> int:
    """Sample every schema once; returns how many outputs were complete (and checked)."""
    tok = model[1]
    rng = random.Random(seed0)
    rids = []
    for i, schema in enumerate(schemas):
        prompt = tok(f"Item {seed0 + i}: the JSON.").input_ids
        bias = high_byte_bias(model, rng) if biased else None
        rids.append(h.submit(prompt, max_new_tokens=160, temperature=temperature, sampling_seed=seed0 + i,
                             logit_bias=bias, json_schema=json.dumps(schema)))
    h.run_until_idle()
    checked = 0
    for rid, schema in zip(rids, schemas):
        out = h.outputs[rid]
        if out.finished_reason["type"] == "length":
            continue  # an unfinished string cannot be checked; the length bound says nothing on validity
        assert out.finished_reason["type"] == "stop", (schema, out.finished_reason)
        text = output_text(model, out.output_ids)
        jsonschema.validate(json.loads(text), schema)
        checked += 1
    return checked


NAME_12 = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"]}


@pytest.mark.slow
def test_the_reported_schema_stays_valid_over_many_seeds(model, harness):
    # The report: chat response_format with name maxLength 12, temperature 0.7, seed 0.
    assert run_sampled(model, harness, [NAME_12] * 32, seed0=0, temperature=0.7, biased=False) >= 24
    # The same with the sampling pushed towards raw bytes.
    assert run_sampled(model, harness, [NAME_12] * 48, seed0=1000) >= 36


@pytest.mark.parametrize("kind,constraint,oracle", [
    ("regex", "[^a-z]{2,8}", r"[^a-z]{2,8}"),
    ("ebnf", 'root ::= "<" [^>]{1,8} ">"', r"<[^>]{1,8}>"),
])
def test_sampled_regex_and_ebnf_outputs_are_valid_utf8(model, harness, kind, constraint, oracle):
    import re

    tok, rng, rids = model[1], random.Random(7), []
    for i in range(24):
        rids.append(harness.submit(tok(f"Line {i}.").input_ids, max_new_tokens=40, temperature=1.0,
                                   sampling_seed=i, logit_bias=high_byte_bias(model, rng), **{kind: constraint}))
    harness.run_until_idle()
    for rid in rids:
        out = harness.outputs[rid]
        assert out.finished_reason["type"] == "stop", out.finished_reason
        assert re.fullmatch(oracle, output_text(model, out.output_ids), re.DOTALL)


NAMES = st.from_regex(r"[a-z]{1,5}", fullmatch=True)
TEXTS = st.text(st.characters(blacklist_categories=("Cs", "Cc")), max_size=4)
STRINGS = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n}, st.integers(0, 3),
              st.integers(0, 4)),
    st.builds(lambda n: {"type": "string", "pattern": f"^.{{0,{n}}}$"}, st.integers(1, 6)),
    st.builds(lambda n: {"type": "string", "pattern": f"^[^a-z]{{1,{n}}}$"}, st.integers(1, 6)),
    st.builds(lambda values: {"enum": values}, st.lists(TEXTS, min_size=1, max_size=3, unique=True)),
)
LEAVES = st.one_of(STRINGS, STRINGS, st.just({"type": "integer", "minimum": -50, "maximum": 50}),
                   st.just({"type": "boolean"}))


def _containers(children):
    arrays = st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 2))
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props),
                       "additionalProperties": False})
    return st.one_of(arrays, objects)


SCHEMAS = st.recursive(LEAVES, _containers, max_leaves=4).map(
    lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]})


# 4 batches of 32 random schemas, derandomized: every run samples the same schemas with the same
# seeds and biases. No shrinking: a batch's samples depend a little on the batch it runs in.
@pytest.mark.slow
@settings(max_examples=4, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                 HealthCheck.function_scoped_fixture])
@given(schemas=st.lists(SCHEMAS, min_size=32, max_size=32), seed=st.integers(0, 2**31))
def test_sampled_outputs_of_random_schemas_are_valid_utf8_and_match(model, harness, schemas, seed):
    checked = run_sampled(model, harness, schemas, seed0=seed, temperature=1.0)
    assert checked >= len(schemas) // 2


@pytest.fixture(scope="module")
def backend(model):
    from engine.constrained.xgrammar_backend import XGrammarGrammarBackend

    tok = model[1]
    return XGrammarGrammarBackend(tok, len(tok), [tok.eos_token_id], any_whitespace=False)


def _accepts(model, grammar, text: str) -> bool:
    """The grammar takes `text` (spelled one byte-level token per byte) and can then end."""
    from engine.utils.tokenizer_utils import byte_level_alphabet

    tok = model[1]
    ids = {b: tok.convert_tokens_to_ids(c) for c, b in byte_level_alphabet().items()}
    matcher = grammar.copy()
    return all(matcher.accept_token(ids[b]) for b in text.encode()) and matcher.accept_token(tok.eos_token_id)


@pytest.mark.parametrize("schema", [{"type": "string", "maxLength": 3}, {"type": "string", "minLength": 1, "maxLength": 3}])
def test_length_bounded_strings_are_sglangs_language_without_raw_control_characters(model, backend, schema):
    # SGLang hands such a schema to xgrammar as is: its rule takes characters up to the bound, raw
    # control characters (invalid JSON) included, and no escape. Ours is rewritten to the same
    # language without the control characters.
    grammar = backend.dispatch_json(json.dumps(schema))
    sglang = backend._matcher_of("json_schema", lambda text: backend.compiler.compile_json_schema(
        text, any_whitespace=False), json.dumps(schema))
    for text in ['"abc"', '"東京😀"', '"a b"', '""', '"abcd"', '"a\\nb"', '"\\""', '"\\u00e9"']:
        valid = _accepts(model, sglang, text)
        assert _accepts(model, grammar, text) == valid, text
        if valid:
            jsonschema.validate(json.loads(text), schema)
    assert _accepts(model, sglang, '"a\x01"') and not _accepts(model, grammar, '"a\x01"')
