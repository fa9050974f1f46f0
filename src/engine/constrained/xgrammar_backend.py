"""The xgrammar backend: JSON schema, regex, EBNF and structural tags compiled against the model's
tokenizer.

xgrammar precomputes, per grammar state, which tokens of the vocabulary can follow, so filling one
request's mask costs microseconds; it runs on the CPU, whatever device the model is on.
"""

from __future__ import annotations

import copy
import json
import logging
from typing import Any, Callable, Dict, List, Union

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from engine.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarCompileError,
    clean_backend_error,
)
from engine.constrained.utf8_guard import ACCEPT, Utf8Masks

logger = logging.getLogger(__name__)

# xgrammar (0.2.x) compiles a string with minLength / maxLength to characters that include raw
# control characters, which JSON forbids: the output would not parse. Such strings are rewritten
# to the same length bounds over the characters JSON allows unescaped (a pattern compiles
# correctly). SGLang passes the schema as is; xgrammar's rule lets no escape in either, so the
# rewrite only takes the raw control characters away. The pattern's automaton grows fast with the
# bound (64: ~0.1 s to compile, 1024: ~5 s), so longer bounds keep xgrammar's own rule.
MAX_REWRITTEN_STRING_LENGTH = 64
_JSON_SAFE_CHAR = r'[^"\\\x00-\x1f]'
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "additionalItems")


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, compiled: xgr.CompiledGrammar, utf8: Utf8Masks) -> None:
        super().__init__()
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        # xgrammar lets bytes through that are not UTF-8 (surrogates, utf8_guard.py): the output's
        # UTF-8 decoder state after each accepted token (the last one is the current state).
        self.utf8 = utf8
        self.utf8_states = [ACCEPT]

    def _accept(self, token: int) -> bool:
        state = self.utf8.next_state(self.utf8_states[-1], token)
        if state is None or not self.matcher.accept_token(token):
            return False
        self.utf8_states.append(state)
        return True

    def _rollback(self, num_tokens: int) -> bool:
        if num_tokens >= len(self.utf8_states):
            return False
        try:
            self.matcher.rollback(num_tokens)
        except RuntimeError:  # beyond the matcher's rollback history
            return False
        del self.utf8_states[len(self.utf8_states) - num_tokens:]
        return True

    def _reset(self) -> None:
        self.matcher.reset()
        self.utf8_states = [ACCEPT]

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(vocab_mask, row)
        self.utf8.restrict(vocab_mask, row, self.utf8_states[-1])

    def copy(self) -> "XGrammarGrammar":
        return XGrammarGrammar(self.compiled, self.utf8)

    def memory_size_bytes(self) -> int:
        return int(self.compiled.memory_size_bytes)


class XGrammarGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: List[int], any_whitespace: bool = True,
                 num_threads: int = 2) -> None:
        super().__init__(num_threads)
        # The model's stop tokens (not only the tokenizer's EOS) end a completed grammar, so a
        # chat model may close its turn the way it was trained to.
        info = _tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # No cache of xgrammar's own (unbounded by default): BaseGrammarBackend's bounded one keeps
        # the compiled grammars.
        self.compiler = xgr.GrammarCompiler(info, max_threads=num_threads, cache_enabled=False)
        self.any_whitespace = any_whitespace
        self.utf8 = Utf8Masks(info.decoded_vocab, (vocab_size + 31) // 32)

    def dispatch_json(self, schema: str) -> XGrammarGrammar:
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarCompileError(f"Invalid json_schema: it is not valid JSON ({e}).") from None
        if not isinstance(parsed, (dict, bool)):
            raise GrammarCompileError("Invalid json_schema: a JSON schema must be an object (or a boolean).")
        if _rewrite_length_bounded_strings(parsed):
            schema = json.dumps(parsed)
        return self._matcher_of("json_schema", lambda text: self.compiler.compile_json_schema(
            text, any_whitespace=self.any_whitespace), schema)

    def dispatch_regex(self, regex: str) -> XGrammarGrammar:
        return self._matcher_of("regex", self.compiler.compile_regex, regex)

    def dispatch_ebnf(self, ebnf: str) -> XGrammarGrammar:
        return self._matcher_of("ebnf", self.compiler.compile_grammar, ebnf)

    def dispatch_structural_tag(self, structural_tag: str) -> XGrammarGrammar:
        """SGLang's two shapes: the legacy `{"structures": [{"begin", "schema", "end"}], "triggers":
        [...], "at_least_one": false}` (free text until a trigger, then one of the structures that
        start with it: its begin, JSON of its schema, its end; and so on), or xgrammar's own
        `{"type": "structural_tag", "format": {...}}`. The JSON parts are compiled as this server
        compiles any JSON schema (its whitespace flag, its string fix)."""
        try:
            tag = json.loads(structural_tag)
        except json.JSONDecodeError as e:
            raise GrammarCompileError(f"Invalid structural_tag: it is not valid JSON ({e}).") from None
        if not isinstance(tag, dict) or (tag.get("structures") is None) == (tag.get("format") is None):
            raise GrammarCompileError('Invalid structural_tag: it must be an object with either "structures" and '
                                      '"triggers" (the legacy shape) or "format".')
        fmt = _legacy_format(tag) if tag.get("format") is None else copy.deepcopy(tag["format"])
        try:
            fmt = self._json_as_grammar(fmt)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(f"Invalid structural_tag: {clean_backend_error(e)}") from None
        text = json.dumps({"type": "structural_tag", "format": fmt})
        return self._matcher_of("structural_tag", self.compiler.compile_structural_tag, text)

    def _json_as_grammar(self, fmt: Any) -> Any:
        """`fmt` with each plain JSON-schema part replaced by the grammar this server compiles for
        that schema (xgrammar would otherwise allow any whitespace in it, whatever
        --constrained-json-disable-any-whitespace says)."""
        if not isinstance(fmt, dict):
            return fmt
        kind = fmt.get("type")
        if kind == "json_schema" and set(fmt) <= {"type", "json_schema"}:
            schema = copy.deepcopy(fmt.get("json_schema"))
            schema = {} if schema is None else schema  # SGLang's default for a missing schema
            _rewrite_length_bounded_strings(schema)
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=self.any_whitespace)
            return {"type": "grammar", "grammar": str(grammar)}
        if "content" in fmt:
            fmt["content"] = self._json_as_grammar(fmt["content"])
        for key in ("elements", "tags"):
            if isinstance(fmt.get(key), list):
                fmt[key] = [self._json_as_grammar(item) for item in fmt[key]]
        return fmt

    def reset(self) -> None:
        super().reset()
        self.compiler.clear_cache()

    def _matcher_of(self, kind: str, compile_fn: Callable[[str], xgr.CompiledGrammar], text: str) -> XGrammarGrammar:
        try:
            return XGrammarGrammar(compile_fn(text), self.utf8)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's parse and conversion errors
            raise GrammarCompileError(f"Invalid {kind}: {clean_backend_error(e)}") from None


def _tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: List[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, the stop tokens' text left out. xgrammar reads an added
    token's text (`<|eot|>`) as ordinary text, so a grammar that allows it (a JSON string, or
    `"<" [^>]+ ">"`) let the model emit a stop token as text, and the request ended right there with
    an output the grammar had not finished. A stop token still ends a complete grammar (by id)."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=sorted(stop_token_ids) or None)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return info  # xgrammar reads other tokenizers' vocabularies its own ways
    stops = set(info.stop_token_ids)
    encoded: List[Union[bytes, str]] = [""] * info.vocab_size
    for token, index in tokenizer.get_vocab().items():
        if 0 <= index < info.vocab_size and index not in stops:
            encoded[index] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, info.dump_metadata())


def _legacy_format(tag: Dict[str, Any]) -> Dict[str, Any]:
    """xgrammar's format for SGLang's legacy shape, as xgrammar's from_legacy_structural_tag builds
    it: triggered tags, each structure a tag whose content is JSON (GrammarCompileError if malformed)."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if (not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers
            or not all(isinstance(t, str) and t for t in triggers)):
        raise GrammarCompileError('Invalid structural_tag: "structures" must be a non-empty list and "triggers" a '
                                  'non-empty list of non-empty strings.')
    at_least_one = tag.get("at_least_one", False)
    if not isinstance(at_least_one, bool):
        raise GrammarCompileError('Invalid structural_tag: "at_least_one" must be a boolean.')
    tags = []
    for structure in structures:
        if (not isinstance(structure, dict) or not isinstance(structure.get("begin"), str)
                or not isinstance(structure.get("end"), str)):
            raise GrammarCompileError('Invalid structural_tag: each structure needs string "begin" and "end".')
        tags.append({"type": "tag", "begin": structure["begin"], "end": structure["end"],
                     "content": {"type": "json_schema", "json_schema": structure.get("schema")}})
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags, "at_least_one": at_least_one}


def _rewrite_length_bounded_strings(schema: Any) -> bool:
    """Rewrite, in place, the length-bounded strings xgrammar would compile wrongly; True if any."""
    if isinstance(schema, list):
        return any([_rewrite_length_bounded_strings(item) for item in schema])
    if not isinstance(schema, dict):
        return False
    changed = False
    if _is_plain_length_bounded_string(schema):
        low = schema.pop("minLength", 0)
        high = schema.pop("maxLength", None)
        schema["pattern"] = f"^{_JSON_SAFE_CHAR}{{{low},{'' if high is None else high}}}$"
        changed = True
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            changed |= any([_rewrite_length_bounded_strings(sub) for sub in schema[key].values()])
    for key in _SUBSCHEMA_LISTS + _SUBSCHEMAS:
        if key in schema:
            changed |= _rewrite_length_bounded_strings(schema[key])
    return changed


def _is_plain_length_bounded_string(schema: dict) -> bool:
    if schema.get("type") != "string" or not ("minLength" in schema or "maxLength" in schema):
        return False
    if any(key in schema for key in ("pattern", "format", "enum", "const")):
        return False
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    if not isinstance(low, int) or (high is not None and not isinstance(high, int)):
        return False
    return high is None or (0 <= low <= high <= MAX_REWRITTEN_STRING_LENGTH)
