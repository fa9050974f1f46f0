"""The xgrammar backend: JSON schema, regex and EBNF compiled against the model's tokenizer.

xgrammar precomputes, per grammar state, which tokens of the vocabulary can follow, so filling one
request's mask costs microseconds; it runs on the CPU, whatever device the model is on.
"""

from __future__ import annotations

import json
import logging
from typing import Any, List

import torch
import xgrammar as xgr

from engine.constrained.base_grammar_backend import (
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarCompileError,
    clean_backend_error,
)

logger = logging.getLogger(__name__)


class XGrammarGrammar(BaseGrammarObject):
    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        super().__init__()
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)

    def _accept(self, token: int) -> bool:
        return bool(self.matcher.accept_token(token))

    def _rollback(self, num_tokens: int) -> bool:
        try:
            self.matcher.rollback(num_tokens)
        except RuntimeError:  # beyond the matcher's rollback history
            return False
        return True

    def _reset(self) -> None:
        self.matcher.reset()

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(vocab_mask, row)

    def copy(self) -> "XGrammarGrammar":
        return XGrammarGrammar(self.compiled)


class XGrammarGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: List[int], any_whitespace: bool = True,
                 num_threads: int = 2) -> None:
        super().__init__(num_threads)
        # The model's stop tokens (not only the tokenizer's EOS) end a completed grammar, so a
        # chat model may close its turn the way it was trained to.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, max_threads=num_threads)
        self.any_whitespace = any_whitespace

    def dispatch_json(self, schema: str) -> XGrammarGrammar:
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise GrammarCompileError(f"Invalid json_schema: it is not valid JSON ({e}).") from None
        if not isinstance(parsed, (dict, bool)):
            raise GrammarCompileError("Invalid json_schema: a JSON schema must be an object (or a boolean).")
        try:
            compiled = self.compiler.compile_json_schema(schema, any_whitespace=self.any_whitespace)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(f"Invalid json_schema: {clean_backend_error(e)}") from None
        return XGrammarGrammar(compiled)

    def dispatch_regex(self, regex: str) -> XGrammarGrammar:
        try:
            compiled = self.compiler.compile_regex(regex)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(f"Invalid regex: {clean_backend_error(e)}") from None
        return XGrammarGrammar(compiled)

    def dispatch_ebnf(self, ebnf: str) -> XGrammarGrammar:
        try:
            compiled = self.compiler.compile_grammar(ebnf)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarCompileError(f"Invalid ebnf: {clean_backend_error(e)}") from None
        return XGrammarGrammar(compiled)

    def reset(self) -> None:
        super().reset()
        self.compiler.clear_cache()
