"""Loading the Hugging Face tokenizer of a model directory."""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List

logger = logging.getLogger(__name__)

# What a decoder writes for bytes that do not form a character: invalid ones, and at the end of a
# text, the first bytes of a character whose next token has not come yet.
REPLACEMENT_CHAR = "\ufffd"


def settled_text_len(text: str) -> int:
    """Length of `text` without its trailing U+FFFD, which the next token may still turn into a
    character (a stop string that ends in that character ends in the next token)."""
    return len(text.rstrip(REPLACEMENT_CHAR))


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """Load the (fast when available) tokenizer stored in `path`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    logger.debug("Loaded tokenizer %s from %s", type(tokenizer).__name__, path)
    return tokenizer


BatchDecode = Callable[[List[List[int]], bool, bool], List[str]]


def make_batch_decoder(tokenizer: Any) -> BatchDecode:
    """`decode(sequences, skip_special_tokens, spaces_between_special_tokens) -> texts`, equal to
    `tokenizer.batch_decode(...)` with those flags.

    For a transformers fast tokenizer that keeps the library's own decode path, the Rust
    tokenizer's `decode_batch` is called directly: transformers' batch_decode converts every id
    through a Python generator first, which cost ~70% of the detokenizer's CPU at 1024 running
    requests. The clean-up step that transformers may apply afterwards is applied the same way
    (`clean_up_tokenization_spaces`, which it skips for BPE models unless forced). Fast tokenizers
    ignore spaces_between_special_tokens; any other tokenizer goes through batch_decode.
    """
    def slow(sequences: List[List[int]], skip_special: bool, spaces_between: bool) -> List[str]:
        return tokenizer.batch_decode(sequences, skip_special_tokens=skip_special,
                                      spaces_between_special_tokens=spaces_between)

    rust = _rust_tokenizer(tokenizer)
    if rust is None:
        return slow

    clean_up = _applies_clean_up(tokenizer)

    def fast(sequences: List[List[int]], skip_special: bool, spaces_between: bool) -> List[str]:
        if not sequences:
            return []
        texts = rust.decode_batch(sequences, skip_special_tokens=skip_special)
        return [tokenizer.clean_up_tokenization(t) for t in texts] if clean_up else texts

    if not _agrees(fast, slow, tokenizer):
        logger.warning("The direct batch decoder disagrees with %s.batch_decode; using batch_decode",
                       type(tokenizer).__name__)
        return slow
    return fast


def _agrees(fast: BatchDecode, slow: BatchDecode, tokenizer: Any) -> bool:
    """Both decoders give the same texts on a probe of ids (special tokens, single ids, runs):
    a guard against a transformers release whose decode path differs from the one mirrored."""
    vocab = len(tokenizer)
    specials = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < vocab]
    probe = [[i] for i in range(min(vocab, 64))] + [specials + list(range(min(vocab, 200)))]
    probe += [list(range(start, min(vocab, start + 50))) for start in range(0, vocab, max(vocab // 20, 1))]
    return all(fast(probe, skip, True) == slow(probe, skip, True) for skip in (True, False))


def _rust_tokenizer(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose decode path is the
    library's own (None for anything else: slow tokenizers, subclasses that override decoding)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None
    own = (cls._decode is PreTrainedTokenizerFast._decode and cls.decode is PreTrainedTokenizerBase.decode
           and cls.batch_decode is PreTrainedTokenizerBase.batch_decode)
    return getattr(tokenizer, "_tokenizer", None) if own else None


def _applies_clean_up(tokenizer: Any) -> bool:
    """Whether transformers' _decode would run clean_up_tokenization on the decoded text."""
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return False
    is_bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    return not is_bpe or bool(forced)


def byte_level_alphabet() -> Dict[str, int]:
    """Byte-level BPE's alphabet: the character standing for each byte. Printable Latin-1 bytes
    stand for themselves; the others (controls, space, ...) take the characters from U+0100 on,
    in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in alphabet.values()]
    alphabet.update({chr(0x100 + k): b for k, b in enumerate(others)})
    return alphabet
