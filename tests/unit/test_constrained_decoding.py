"""Constrained decoding in the scheduler, on the built-in random model: only the grammar can make
its output valid, so every output that parses proves the mask, the matcher and the overlap
interplay right. In-process (Harness + the real TpModelWorker) to stay fast."""

from __future__ import annotations

import json
import re
import threading
from typing import Any, List

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sched_utils import Harness

xgrammar = pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar (pip install xgrammar)")
jsonschema = pytest.importorskip("jsonschema", reason="schema validation needs jsonschema")

from engine.constrained.base_grammar_backend import BaseGrammarBackend, BaseGrammarObject  # noqa: E402
from engine.constrained.grammar_manager import server_grammar_backend  # noqa: E402


@pytest.fixture(scope="module")
def model():
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    path = ensure_builtin_model()
    return path, AutoTokenizer.from_pretrained(path)


def make_harness(model, overlap: bool = True, max_total_tokens: int = 16384, max_running: int = 64,
                 **kwargs: Any) -> Harness:
    from engine.scheduler.tp_worker import TpModelWorker
    from engine.server_args import ServerArgs

    path, tok = model
    page = kwargs.get("page_size", 1)
    args = ServerArgs(model_path=path, device="cpu", max_total_tokens=max_total_tokens, page_size=page,
                      max_running_requests=max_running)
    kwargs.setdefault("constrained_json_disable_any_whitespace", True)
    return Harness(worker=TpModelWorker(args), tokenizer=tok, max_total_tokens=max_total_tokens, overlap=overlap,
                   **kwargs)


def prompt(model, i: int) -> List[int]:
    return model[1](f"Request {i}: answer in the required format.").input_ids


def text_of(model, h: Harness, rid: str) -> str:
    return model[1].decode(h.outputs[rid].output_ids, skip_special_tokens=True)


def run(h: Harness) -> None:
    h.run_until_idle()
    assert len(h.scheduler.grammar_manager) == 0
    h.scheduler.check_memory()  # strict: a leak raises


# ---------------------------------------------------------------------------------------------
# Random JSON schemas with an upper bound on the length of any output that matches them
# ---------------------------------------------------------------------------------------------
NAMES = st.from_regex(r"[a-z]{1,6}", fullmatch=True)
SCALARS = st.one_of(st.integers(-99, 99), st.booleans(), st.none(), st.text(max_size=4))
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, n: {"type": "string", "minLength": lo, "maxLength": lo + n}, st.integers(0, 3),
              st.integers(0, 3)),
    st.builds(lambda n: {"type": "string", "pattern": f"^[a-z0-9]{{1,{n}}}$"}, st.integers(1, 5)),
    st.builds(lambda lo, n: {"type": "integer", "minimum": lo, "maximum": lo + n}, st.integers(-500, 500),
              st.integers(0, 1000)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda values: {"enum": values}, st.lists(SCALARS, min_size=1, max_size=4, unique_by=json.dumps)),
    st.builds(lambda value: {"const": value}, SCALARS),
)


def _containers(children):
    arrays = st.builds(lambda item, lo, n: {"type": "array", "items": item, "minItems": lo, "maxItems": lo + n},
                       children, st.integers(0, 2), st.integers(0, 2))
    objects = st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda props: st.builds(
            lambda required: {"type": "object", "properties": props, "required": sorted(required),
                              "additionalProperties": False},
            st.sets(st.sampled_from(sorted(props)))))
    return st.one_of(arrays, objects)


SCHEMAS = st.recursive(LEAVES, _containers, max_leaves=6)


def max_output_bytes(schema: dict) -> int:
    """An upper bound on the UTF-8 length of compact JSON matching `schema` (no free whitespace)."""
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        return max(max(len(json.dumps(v).encode()), len(json.dumps(v, ensure_ascii=False).encode())) + 8
                   for v in values)
    kind = schema["type"]
    if kind == "string":
        if "pattern" in schema:
            return 2 + int(re.search(r",(\d+)\}", schema["pattern"]).group(1))
        return 2 + 6 * schema["maxLength"]  # a character is at most 6 bytes (\uXXXX)
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind in ("boolean", "null"):
        return 5
    if kind == "array":
        return 2 + schema["maxItems"] * (max_output_bytes(schema["items"]) + 2)
    return 2 + sum(len(json.dumps(k).encode()) + 4 + max_output_bytes(v) for k, v in schema["properties"].items())


@pytest.fixture(scope="module")
def schema_harness(model):
    return make_harness(model)


# Hypothesis tries its simplest example first, so the 200 random schemas come as 5 batches of 40
# after that one; a seeded run (derandomize) gives the same schemas every time. The @given function
# lives inside the test so that the variety check below sees exactly the schemas of this run, with
# no state shared between tests.
@pytest.mark.slow  # 240 schemas compiled and decoded
def test_random_json_schemas_give_valid_json(model, schema_harness):
    h = schema_harness
    seen: List[str] = []

    @settings(max_examples=6, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(schemas=st.lists(SCHEMAS, min_size=40, max_size=40))
    def check(schemas: List[dict]) -> None:
        rids = []
        for i, schema in enumerate(schemas):
            # Every byte may be its own token; one more for the stop token.
            budget = max_output_bytes(schema) + 1
            rids.append(h.submit(prompt(model, i), max_new_tokens=budget, json_schema=json.dumps(schema)))
            seen.append(json.dumps(schema, sort_keys=True))
        run(h)
        for rid, schema in zip(rids, schemas):
            out = h.outputs[rid]
            assert out.finished_reason["type"] == "stop", (schema, out.finished_reason, text_of(model, h, rid))
            value = json.loads(text_of(model, h, rid))
            jsonschema.validate(value, schema)

    check()
    # The run really covered ~200 different schemas (not one simple schema repeated).
    assert len(seen) == 240 and len(set(seen)) >= 150


# ---------------------------------------------------------------------------------------------
# Regex and EBNF
# ---------------------------------------------------------------------------------------------
REGEXES = [
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}",
    r"(yes|no|maybe)",
    r"[a-z]{2,5}@[a-z]{2,4}\.(com|org)",
    r"\(\d{1,3}\) [A-Z][a-z]{0,4}",
    r"(ab|cd){1,3}x?",
]
# Regular EBNF grammars and a Python regex for the same language (the oracle).
EBNFS = [
    ('root ::= greeting " " name "!"\ngreeting ::= "hello" | "hi" | "hey"\nname ::= [A-Z] [a-z]{1,5}',
     r"(hello|hi|hey) [A-Z][a-z]{1,5}!"),
    ('root ::= "{" pair ("," pair){0,2} "}"\npair ::= "\\"" [a-z]{1,3} "\\":" [0-9]{1,2}',
     r'\{"[a-z]{1,3}":[0-9]{1,2}(,"[a-z]{1,3}":[0-9]{1,2}){0,2}\}'),
    ('root ::= "[" (item ("," item)*)? "]"\nitem ::= "true" | "false"', None),
]


@pytest.mark.parametrize("overlap", [False, True])
def test_regex_and_ebnf_outputs_match_their_grammar(model, overlap):
    h = make_harness(model, overlap=overlap)
    regex_rids = [(h.submit(prompt(model, i), max_new_tokens=40, regex=r), r) for i, r in enumerate(REGEXES)]
    ebnf_rids = [(h.submit(prompt(model, i), max_new_tokens=40, ebnf=g), oracle) for i, (g, oracle) in enumerate(EBNFS)]
    run(h)
    for rid, pattern in regex_rids:
        assert h.outputs[rid].finished_reason["type"] == "stop"
        assert re.fullmatch(pattern, text_of(model, h, rid)), (pattern, text_of(model, h, rid))
    for rid, oracle in ebnf_rids:
        text = text_of(model, h, rid)
        if oracle is not None:
            assert h.outputs[rid].finished_reason["type"] == "stop"
            assert re.fullmatch(oracle, text), (oracle, text)
        else:  # an unbounded list: a prefix of the language when cut by the length
            assert re.fullmatch(r"\[((true|false)(,(true|false))*)?\]?", text) or re.fullmatch(
                r"\[((true|false)(,(true|false))*,?)?(t|tr|tru|f|fa|fal|fals)?", text), text


# ---------------------------------------------------------------------------------------------
# Scheduling configurations: identical constrained greedy outputs
# ---------------------------------------------------------------------------------------------
CONSTRAINTS = [
    {"json_schema": json.dumps({"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"}}, "required": ["id", "tags", "ok"], "additionalProperties": False})},
    {"regex": r"[a-z]{3,8}( [a-z]{2,6}){0,4}\."},
    {"ebnf": 'root ::= "(" [0-9]{1,3} ("+" [0-9]{1,3}){0,5} ")"'},
    {},  # a free request in the same batches
]


def _run_config(model, overlap: bool, repeat_prompts: bool = False, **kwargs: Any) -> List[List[int]]:
    h = make_harness(model, overlap=overlap, **kwargs)
    long_prefix = model[1]("A shared, fairly long instruction that several requests start with. " * 3).input_ids
    rids = []
    for i in range(12):
        p = long_prefix + prompt(model, i)[1:]
        rids.append(h.submit(p, max_new_tokens=48, **CONSTRAINTS[i % len(CONSTRAINTS)]))
    run(h)
    outputs = [h.outputs[r].output_ids for r in rids]
    if repeat_prompts:  # the same prompts again: radix cache hits
        again = [h.submit(long_prefix + prompt(model, i)[1:], max_new_tokens=48, **CONSTRAINTS[i % len(CONSTRAINTS)])
                 for i in range(12)]
        run(h)
        assert all(h.outputs[r].cached_tokens > 0 for r in again)
        assert [h.outputs[r].output_ids for r in again] == outputs
    return outputs


CONFIGS = {
    "overlap": dict(overlap=True),
    "radix-hits": dict(overlap=True, repeat_prompts=True),
    "chunked-prefill": dict(overlap=True, chunked_prefill_size=16),
    "mixed-chunk": dict(overlap=True, chunked_prefill_size=16, enable_mixed_chunk=True),
    "page16": dict(overlap=True, page_size=16),
    "no-radix": dict(overlap=True, disable_radix_cache=True),
}


@pytest.fixture(scope="module")
def reference_outputs(model):
    return _run_config(model, overlap=False)


# Two configurations in the fast lane, all of them in the full suite.
FAST_CONFIGS = ("overlap", "mixed-chunk")


@pytest.mark.parametrize("name", [name if name in FAST_CONFIGS else pytest.param(name, marks=pytest.mark.slow)
                                  for name in CONFIGS])
def test_constrained_greedy_outputs_identical_across_loops_and_configs(model, reference_outputs, name):
    assert _run_config(model, **CONFIGS[name]) == reference_outputs


# Long-running constrained requests in a small pool, admitted optimistically: they get retracted
# and re-prefilled, and their matchers must continue exactly where they stopped.
RETRACT_CONSTRAINTS = [
    {"regex": "[0-9]{40}"},
    {"json_schema": json.dumps({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                "minItems": 14, "maxItems": 14})},
    {},
]


def _run_retract(model, overlap: bool, max_total_tokens: int) -> List[List[int]]:
    h = make_harness(model, overlap=overlap, max_total_tokens=max_total_tokens, schedule_conservativeness=0.3)
    rids = [h.submit(prompt(model, i), max_new_tokens=44, **RETRACT_CONSTRAINTS[i % 3]) for i in range(12)]
    run(h)
    return [h.outputs[r].output_ids for r in rids]


@pytest.mark.parametrize("overlap", [pytest.param(False, marks=pytest.mark.slow), True])
def test_retracted_constrained_requests_continue_exactly(model, overlap, caplog):
    reference = _run_retract(model, overlap=False, max_total_tokens=4096)
    with caplog.at_level("WARNING"):
        outputs = _run_retract(model, overlap=overlap, max_total_tokens=200)
    assert "Retract requests" in caplog.text
    assert outputs == reference


# ---------------------------------------------------------------------------------------------
# Finishing: complete grammar, dead end, bad constraints
# ---------------------------------------------------------------------------------------------
def test_grammar_completion_finishes_with_the_stop_token(model):
    from engine.builtin_model import STOP_TOKEN_IDS

    h = make_harness(model)
    normal = h.submit(prompt(model, 0), max_new_tokens=30, regex="(red|green|blue)")
    ignore = h.submit(prompt(model, 0), max_new_tokens=30, regex="(red|green|blue)", ignore_eos=True)
    run(h)
    # Any of the model's stop tokens may close a complete grammar (EOS or the chat's EOT).
    reason = h.outputs[normal].finished_reason
    assert reason["type"] == "stop" and reason["matched"] in STOP_TOKEN_IDS
    # ignore_eos: the stop token does not end the request, the terminated grammar does.
    assert h.outputs[ignore].finished_reason["type"] == "stop"
    assert text_of(model, h, normal) == text_of(model, h, ignore) in ("red", "green", "blue")


@pytest.mark.parametrize("overlap", [False, True])
def test_grammar_dead_end_finishes_with_a_clear_abort(model, overlap):
    # The grammar allows only the stop token after "ab"; min_new_tokens forbids it: no token is left.
    h = make_harness(model, overlap=overlap)
    rid = h.submit(prompt(model, 0), max_new_tokens=20, min_new_tokens=6, regex="ab")
    free = h.submit(prompt(model, 1), max_new_tokens=8)
    run(h)
    reason = h.outputs[rid].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400
    accepted = len(model[1].encode("ab", add_special_tokens=False))
    assert f"dead end after {accepted} output tokens" in reason["message"]
    assert h.outputs[rid].output_ids[:accepted] == model[1].encode("ab", add_special_tokens=False)
    assert h.outputs[free].finished_reason == {"type": "length", "length": 8}


BAD_CONSTRAINTS = [
    ({"json_schema": "{not json"}, "Invalid json_schema: it is not valid JSON"),
    ({"json_schema": "[1, 2]"}, "must be an object"),
    ({"json_schema": json.dumps({"type": "banana"})}, 'Unsupported type "banana"'),
    ({"regex": "(unclosed"}, "Invalid regex"),
    ({"ebnf": "root ::= undefined_rule"}, 'Rule "undefined_rule" is not defined'),
]


def test_bad_constraints_are_refused_with_the_reason(model):
    h = make_harness(model)
    rids = [(h.submit(prompt(model, 0), **params), needle) for params, needle in BAD_CONSTRAINTS]
    again = [(h.submit(prompt(model, 0), **params), needle) for params, needle in BAD_CONSTRAINTS]  # cached errors
    ok = h.submit(prompt(model, 0), max_new_tokens=5, regex="[a-c]{4}")
    run(h)
    for rid, needle in rids + again:
        reason = h.outputs[rid].finished_reason
        assert reason["type"] == "abort" and reason["status_code"] == 400, reason
        assert needle in reason["message"], reason["message"]
        assert h.outputs[rid].output_ids == []
    assert h.outputs[ok].finished_reason["type"] == "stop" and re.fullmatch("[a-c]{4}", text_of(model, h, ok))


def test_grammar_backend_none_refuses_constrained_requests(model):
    h = make_harness(model, grammar_backend="none")
    rid = h.submit(prompt(model, 0), regex="a+")
    free = h.submit(prompt(model, 0), max_new_tokens=2)
    run(h)
    reason = h.outputs[rid].finished_reason
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert "--grammar-backend none" in reason["message"]
    assert h.outputs[free].finished_reason["type"] == "length"


# ---------------------------------------------------------------------------------------------
# The grammar queue: compilation off the scheduling thread, cache, aborts while waiting
# ---------------------------------------------------------------------------------------------
class GatedBackend(BaseGrammarBackend):
    """Compiles with the real xgrammar backend, but only once `gate` is set."""

    def __init__(self, real: BaseGrammarBackend) -> None:
        super().__init__(num_threads=1)
        self.real = real
        self.gate = threading.Event()
        self.compiled: List[str] = []

    def _wait(self) -> None:
        assert self.gate.wait(timeout=60), "test gate never opened"

    def dispatch_json(self, schema: str) -> BaseGrammarObject:
        self._wait()
        self.compiled.append(schema)
        return self.real.dispatch_json(schema)

    def dispatch_regex(self, regex: str) -> BaseGrammarObject:
        self._wait()
        self.compiled.append(regex)
        return self.real.dispatch_regex(regex)

    def dispatch_ebnf(self, ebnf: str) -> BaseGrammarObject:
        self._wait()
        return self.real.dispatch_ebnf(ebnf)


def _real_backend(h: Harness):
    s = h.scheduler
    return server_grammar_backend(s.server_args, s.tokenizer, s.vocab_size, s.eos_token_ids)


def _gated(h: Harness) -> GatedBackend:
    real, reason = _real_backend(h)
    assert real is not None, reason
    gated = GatedBackend(real)
    # The scheduler's grammar manager builds its backend at the first constrained request: this one.
    h.scheduler.grammar_manager._backend_factory = lambda: (gated, None)
    return gated


@pytest.mark.parametrize("overlap", [False, True])
def test_waiting_for_a_grammar_blocks_nobody_and_can_be_aborted(model, overlap):
    h = make_harness(model, overlap=overlap)
    gated = _gated(h)
    waiting = h.submit(prompt(model, 0), max_new_tokens=8, regex="[a-z]{8}")
    doomed = h.submit(prompt(model, 1), max_new_tokens=8, regex="[0-9]{8}")
    free = h.submit(prompt(model, 2), max_new_tokens=6)
    for _ in range(200):
        h.step()
        if h.outputs[free].finished_reason is not None:
            break
    assert h.outputs[free].finished_reason == {"type": "length", "length": 6}
    assert len(h.scheduler.grammar_manager) == 2 and h.outputs[waiting].output_ids == []
    assert h.scheduler.internal_state()["num_grammar_queue_reqs"] == 2
    h.abort(doomed)
    h.step()
    assert h.outputs[doomed].finished_reason["type"] == "abort"
    assert len(h.scheduler.grammar_manager) == 1
    gated.gate.set()
    run(h)
    assert re.fullmatch("[a-z]{8}", text_of(model, h, waiting))
    # The aborted request's compilation still finished and is cached for the next request.
    again = h.submit(prompt(model, 1), max_new_tokens=9, regex="[0-9]{8}")
    run(h)
    assert re.fullmatch("[0-9]{8}", text_of(model, h, again))
    assert sorted(gated.compiled) == ["[0-9]{8}", "[a-z]{8}"]


def test_same_constraint_compiles_once_and_n_requests_share_it(model):
    h = make_harness(model)
    gated = _gated(h)
    schema = json.dumps({"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 2})
    rids = [h.submit(prompt(model, i), max_new_tokens=16, json_schema=schema, temperature=1.0, sampling_seed=i)
            for i in range(6)]
    h.step()
    assert len(h.scheduler.grammar_manager) == 6
    gated.gate.set()
    run(h)
    assert gated.compiled == [schema]
    for rid in rids:
        value = json.loads(text_of(model, h, rid))
        assert len(value) == 2 and set(value) <= {"x", "y"}


def test_abort_all_reaches_the_grammar_queue(model):
    h = make_harness(model)
    gated = _gated(h)
    rids = [h.submit(prompt(model, i), max_new_tokens=8, regex="z+") for i in range(3)]
    h.step()
    h.abort(abort_all=True)
    h.step()
    assert all(h.outputs[r].finished_reason["type"] == "abort" for r in rids)
    gated.gate.set()
    run(h)


# ---------------------------------------------------------------------------------------------
# Load: a mix of constrained and free requests, with retraction, leaves nothing behind
# ---------------------------------------------------------------------------------------------
MIXED_POOL = 200


def test_mixed_load_with_retraction_leaks_nothing(model, caplog):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5},
                                               "b": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                                "maximum": 9}, "maxItems": 4}},
              "required": ["a", "b"], "additionalProperties": False}
    h = make_harness(model, overlap=True, max_total_tokens=MIXED_POOL, max_running=16, schedule_conservativeness=0.3)
    rids = []
    with caplog.at_level("WARNING"):
        for i in range(40):
            if i % 3 == 0:
                rids.append((h.submit(prompt(model, i), max_new_tokens=60, json_schema=json.dumps(schema)), True))
            else:
                rids.append((h.submit(prompt(model, i), max_new_tokens=10 + i % 7 * 5), False))
            if i % 10 == 9:
                h.abort(rids[i - 4][0])  # some aborts mid-flight
            h.step()
        run(h)
    assert "Retract requests" in caplog.text
    state = h.scheduler.internal_state()
    assert state["num_grammar_queue_reqs"] == 0 and state["num_running_reqs"] == 0
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"]
    for rid, constrained in rids:
        out = h.outputs[rid]
        assert out.finished_reason is not None
        if constrained and out.finished_reason["type"] == "stop":
            jsonschema.validate(json.loads(text_of(model, h, rid)), schema)


# ---------------------------------------------------------------------------------------------
# Matcher repair and the mask itself
# ---------------------------------------------------------------------------------------------
def test_matcher_sync_rolls_back_and_rebuilds(model):
    h = make_harness(model)
    backend, _ = _real_backend(h)
    tok = model[1]
    grammar = backend.dispatch_regex("(hello|help) world")
    ids = tok.encode("hello world", add_special_tokens=False)
    assert grammar.sync_with(ids) and grammar.num_accepted == len(ids)
    assert grammar.sync_with(ids[:1]) and grammar.num_accepted == 1  # rolled back
    assert grammar.sync_with(ids) and not grammar.is_terminated()
    fresh = grammar.copy()
    assert fresh.num_accepted == 0 and fresh.sync_with(ids)
    assert not grammar.copy().sync_with(tok.encode("hi", add_special_tokens=False))


def test_vocab_mask_applies_to_every_sampling_path():
    from engine.constrained.vocab_mask import allocate_vocab_mask, apply_vocab_mask

    vocab = 70
    mask = allocate_vocab_mask(2, vocab)
    mask[0] = 0
    mask[0, 1] = 1 << 3  # only token 35 allowed in row 0
    logits = torch.randn(2, vocab)
    before = logits.clone()
    apply_vocab_mask(logits, mask)
    assert torch.isinf(logits[0]).sum() == vocab - 1 and logits[0, 35] == before[0, 35]
    assert torch.equal(logits[1], before[1])  # an all-ones row changes nothing


def test_vocab_mask_numpy_and_torch_paths_agree():
    """float32 CPU logits take the numpy unpacking, other dtypes the torch shifts: same result,
    also on a column slice of padded logits."""
    from engine.constrained.vocab_mask import apply_vocab_mask

    gen = torch.Generator().manual_seed(3)
    mask = torch.randint(-(2**31), 2**31 - 1, (5, 4), dtype=torch.int32, generator=gen)
    padded = torch.randn(5, 128, generator=gen)
    fast = padded.clone()[:, :100]
    slow = padded.double()[:, :100]
    apply_vocab_mask(fast, mask)
    apply_vocab_mask(slow, mask)
    assert torch.equal(torch.isinf(fast), torch.isinf(slow)) and torch.isinf(fast).any()
    for row in range(5):
        for token in range(100):
            allowed = (int(mask[row, token // 32]) >> (token % 32)) & 1
            assert bool(torch.isinf(fast[row, token])) == (not allowed)
