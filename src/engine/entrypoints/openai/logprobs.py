"""SGLang logprob lists -> the two OpenAI logprob formats.

The manager reports a token as `[logprob, token_id, text]` and the alternatives at a position as
a list of such entries. Completions use the legacy columnar format (tokens, token_logprobs,
top_logprobs dicts, text_offset); chat uses per-token objects with bytes: the token's own bytes
where the vocabulary gives them (a token that holds part of a character has bytes that are not
UTF-8 on their own, while its text is U+FFFD), else the UTF-8 of its text.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Sequence

from engine.entrypoints.openai.protocol import (
    ChatCompletionTokenLogprob,
    CompletionLogProbs,
    TopLogprob,
)
from engine.utils.tokenizer_utils import TokenBytes

# One token: [logprob, token_id, text]. Text is None when the manager was not asked for it.
TokenEntry = Sequence
Decode = Callable[[int], str]

# OpenAI reports impossible tokens with this value; JSON has no -inf.
MIN_LOGPROB = -9999.0


def _finite(logprob: Optional[float]) -> Optional[float]:
    if logprob is None:
        return None
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _finite_or_min(logprob: Optional[float]) -> float:
    """A number the OpenAI chat format can carry: -inf and a missing value become MIN_LOGPROB."""
    return MIN_LOGPROB if logprob is None or not math.isfinite(logprob) else logprob


def _text(entry: TokenEntry, decode: Decode) -> str:
    text = entry[2] if len(entry) > 2 else None
    return text if text is not None else decode(int(entry[1]))


def to_completion_logprobs(
    token_entries: List[TokenEntry],
    top_entries: List[Optional[List[TokenEntry]]],
    decode: Decode,
    text_offset: int = 0,
) -> CompletionLogProbs:
    """Legacy format. `text_offset` is where the first token starts in the returned text.

    Each top_logprobs dict also holds the chosen token, as OpenAI documents ("up to logprobs + 1
    elements").
    """
    result = CompletionLogProbs()
    offset = text_offset
    for position, entry in enumerate(token_entries):
        token = _text(entry, decode)
        logprob = _finite(entry[0])
        result.tokens.append(token)
        result.token_logprobs.append(logprob)
        result.text_offset.append(offset)
        offset += len(token)
        tops = top_entries[position] if position < len(top_entries) else None
        if logprob is None:
            # The first prompt token has no logprob, so it has no alternatives either.
            result.top_logprobs.append(None)
            continue
        alternatives: Dict[str, Optional[float]] = {}
        for top in tops or []:
            alternatives.setdefault(_text(top, decode), _finite(top[0]))
        alternatives.setdefault(token, logprob)
        result.top_logprobs.append(alternatives)
    return result


def to_chat_logprobs(
    token_entries: List[TokenEntry],
    top_entries: List[Optional[List[TokenEntry]]],
    decode: Decode,
    token_bytes: Optional[TokenBytes] = None,
) -> List[ChatCompletionTokenLogprob]:
    def bytes_of(entry: TokenEntry, text: str) -> List[int]:
        raw = token_bytes(int(entry[1])) if token_bytes is not None else None
        return list(raw if raw is not None else text.encode("utf-8"))

    content = []
    for position, entry in enumerate(token_entries):
        token = _text(entry, decode)
        tops = top_entries[position] if position < len(top_entries) else None
        alternatives = []
        for top in tops or []:
            top_text = _text(top, decode)
            alternatives.append(TopLogprob(token=top_text, bytes=bytes_of(top, top_text),
                                           logprob=_finite_or_min(top[0])))
        content.append(
            ChatCompletionTokenLogprob(
                token=token,
                bytes=bytes_of(entry, token),
                logprob=_finite_or_min(entry[0]),
                top_logprobs=alternatives,
            )
        )
    return content
