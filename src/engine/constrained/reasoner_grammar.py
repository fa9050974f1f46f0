"""A grammar that waits for the model's reasoning to end (SGLang's ReasonerGrammarObject).

A reasoning model answers `...thinking...</think>{"a": 1}`: the constraint is for the answer, not
for the thinking. With `--reasoning-parser` and a request that starts in its reasoning
(`require_reasoning`, which the chat route sets by SGLang's rule), the request's matcher is wrapped
in a `ReasonerGrammar`: every token is allowed until the output ends with the token ids of the
format's closing tag, then the inner grammar constrains the rest from its start. The reasoning
parser of the chat route splits the same text at the same tag, so the answer it returns in
`content` is what the grammar matched.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from engine.constrained.base_grammar_backend import BaseGrammarObject


class ReasonerGrammar(BaseGrammarObject):
    supports_rollback = False  # see _rollback: speculative decoding keeps such requests plain

    def __init__(self, inner: BaseGrammarObject, think_end_ids: Sequence[int]) -> None:
        super().__init__()
        if not think_end_ids:
            raise ValueError("the reasoning's closing tag must be at least one token")
        self.inner = inner
        self.think_end_ids: Tuple[int, ...] = tuple(think_end_ids)
        # Tokens accepted while thinking (a bounded tail: only the closing tag's length matters).
        self.thinking_tail: List[int] = []
        self.thinking = True

    def _accept(self, token: int) -> bool:
        if not self.thinking:
            return self.inner.accept_token(token)
        tail = self.thinking_tail
        tail.append(token)
        if len(tail) > len(self.think_end_ids):
            del tail[0]
        if tuple(tail) == self.think_end_ids:
            self.thinking = False
        return True

    def _rollback(self, num_tokens: int) -> bool:
        # The thinking tail keeps too little history to undo; the caller rebuilds from the start
        # (sync_with replays the output, which is cheap for thinking tokens).
        return False

    def _reset(self) -> None:
        self.inner = self.inner.copy()
        self.thinking_tail = []
        self.thinking = True

    def is_terminated(self) -> bool:
        return not self.thinking and self.inner.is_terminated()

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, row: int) -> None:
        # While thinking the row keeps its all-allowed default.
        if not self.thinking:
            self.inner.fill_vocab_mask(vocab_mask, row)

    def copy(self) -> "ReasonerGrammar":
        return ReasonerGrammar(self.inner.copy(), self.think_end_ids)
