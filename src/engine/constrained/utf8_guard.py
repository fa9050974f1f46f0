"""Keeping constrained output valid UTF-8, whatever the grammar backend lets through.

xgrammar (0.2.x) matches code points byte by byte, and its character classes let the UTF-8-style
encodings of the surrogates U+D800..U+DFFF through (`[^"]` accepts the bytes ED A0 80); a
length-bounded string rewritten to a pattern also accepted the overlong E0 80. Those bytes are not
UTF-8: decoded with replacement they become up to three U+FFFD each, so a JSON string of 12
characters came back with 14, and a client that decodes strictly fails.

`Utf8Masks` holds, for each state of a UTF-8 decoder (how many continuation bytes the character
being spelled still needs, and the range the next one must fall in), the vocabulary bitmask of the
tokens whose bytes keep the output valid from that state. A constrained request ANDs the mask of
its state into its grammar's row, so the grammar only ever chooses among tokens that keep the
output decodable; a stop token (or any token without bytes of its own) is allowed only between
characters.

Built once per grammar backend from the vocabulary's bytes (one pass over the vocabulary, a few
numpy operations per state); per token the state advances over that token's bytes.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

# A decoder state: (continuation bytes still needed, lowest and highest allowed next byte).
State = Tuple[int, int, int]
# Between characters: nothing pending.
ACCEPT = 0
STATES: Tuple[State, ...] = (
    (0, 0, 0),
    (1, 0x80, 0xBF),
    (2, 0xA0, 0xBF),  # after E0: no overlong three-byte forms
    (2, 0x80, 0xBF),
    (2, 0x80, 0x9F),  # after ED: no surrogates
    (3, 0x90, 0xBF),  # after F0: no overlong four-byte forms
    (3, 0x80, 0xBF),
    (3, 0x80, 0x8F),  # after F4: nothing above U+10FFFF
)
_STATE_INDEX = {state: i for i, state in enumerate(STATES)}


def _after_lead(byte: int) -> Optional[int]:
    """The state after the first byte of a character (None: no character starts with it)."""
    if byte < 0x80:
        return ACCEPT
    if 0xC2 <= byte <= 0xDF:
        return _STATE_INDEX[(1, 0x80, 0xBF)]
    if byte == 0xE0:
        return _STATE_INDEX[(2, 0xA0, 0xBF)]
    if byte == 0xED:
        return _STATE_INDEX[(2, 0x80, 0x9F)]
    if 0xE1 <= byte <= 0xEF:
        return _STATE_INDEX[(2, 0x80, 0xBF)]
    if byte == 0xF0:
        return _STATE_INDEX[(3, 0x90, 0xBF)]
    if 0xF1 <= byte <= 0xF3:
        return _STATE_INDEX[(3, 0x80, 0xBF)]
    if byte == 0xF4:
        return _STATE_INDEX[(3, 0x80, 0x8F)]
    return None  # a stray continuation byte, C0, C1, F5..FF


def advance(state: int, data: bytes) -> Optional[int]:
    """The state after `data` from `state` (None: the bytes are not valid UTF-8 there)."""
    current: Optional[int] = state
    for byte in data:
        assert current is not None
        needed, low, high = STATES[current]
        if needed == 0:
            current = _after_lead(byte)
        elif low <= byte <= high:
            current = ACCEPT if needed == 1 else _STATE_INDEX[(needed - 1, 0x80, 0xBF)]
        else:
            current = None
        if current is None:
            return None
    return current


class Utf8Masks:
    """Per decoder state, the packed vocabulary mask (xgrammar's int32 layout) of the tokens that
    keep the output valid UTF-8."""

    def __init__(self, token_bytes: Sequence[bytes], mask_words: int) -> None:
        self.token_bytes: List[bytes] = list(token_bytes)
        vocab = len(self.token_bytes)
        if mask_words * 32 < vocab:
            raise ValueError(f"a mask of {mask_words} words cannot hold {vocab} tokens")
        lengths = np.array([len(b) for b in self.token_bytes], dtype=np.int64)
        firsts = np.array([b[0] if b else -1 for b in self.token_bytes], dtype=np.int64)
        # Leading continuation bytes (10xxxxxx): what finishes a character begun before the token.
        leading = np.array([_leading_continuations(b) for b in self.token_bytes], dtype=np.int64)
        # The rest of the token (from its first non-continuation byte) on its own.
        # (Valid up to an unfinished last character; Python's incremental decoder is no judge of
        # that: it lets b"\xed\xa0" wait for more.)
        rest_ok = np.array([advance(ACCEPT, b[k:]) is not None for b, k in zip(self.token_bytes, leading.tolist())],
                           dtype=bool)
        rows = []
        for needed, low, high in STATES:
            if needed == 0:
                allowed = (leading == 0) & rest_ok
            else:
                in_range = (firsts >= low) & (firsts <= high)
                # Either the token only continues the character (all its bytes are continuations,
                # fewer than still needed), or it finishes it and the rest is valid on its own.
                partial = (leading < needed) & (leading == lengths)
                finishing = (leading == needed) & rest_ok
                allowed = (lengths > 0) & in_range & (partial | finishing)
            rows.append(_pack(allowed, mask_words))
        self.masks = torch.from_numpy(np.stack(rows))  # [len(STATES), mask_words] int32

    def next_state(self, state: int, token: int) -> Optional[int]:
        """The state after `token` (None: it would make the output invalid UTF-8)."""
        if not 0 <= token < len(self.token_bytes):
            return state  # beyond the vocabulary's bytes: the grammar has refused it already
        return advance(state, self.token_bytes[token])

    def restrict(self, vocab_mask: torch.Tensor, row: int, state: int) -> None:
        """AND the tokens allowed in `state` into row `row` of a packed vocabulary mask."""
        vocab_mask[row].bitwise_and_(self.masks[state].to(vocab_mask.device))


def _leading_continuations(data: bytes) -> int:
    count = 0
    for byte in data:
        if byte & 0xC0 != 0x80:
            break
        count += 1
    return count


def _pack(allowed: np.ndarray, mask_words: int) -> np.ndarray:
    """Bit j of int32 word w allows token 32 * w + j (little-endian bit order within the word)."""
    bits = np.zeros(mask_words * 32, dtype=bool)
    bits[: allowed.shape[0]] = allowed
    packed = np.packbits(bits, bitorder="little")  # byte i holds tokens 8i..8i+7
    return packed.view("<i4").astype(np.int32)
