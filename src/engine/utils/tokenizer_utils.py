"""Loading the Hugging Face tokenizer of a model directory."""

from __future__ import annotations

import json
import logging
import pickle
import re
from typing import Any, Callable, Dict, List, Optional, Set

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


def tokenizer_to_bytes(tokenizer: Any) -> Optional[bytes]:
    """`tokenizer` pickled for a child process that needs the same tokenizer (the detokenizer), or
    None when it cannot travel that way (the child then loads it from disk).

    Why: loading through AutoTokenizer reads the model's config, which imports torch and most of
    transformers (several CPU seconds per process, while the schedulers import the same); an
    unpickled tokenizer imports only its own class's module. A class of remote code
    (transformers_modules) stays home: the child could not import it before loading it itself.
    """
    if not type(tokenizer).__module__.startswith(("transformers.", "tokenizers.")):
        return None
    try:
        return pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # any object of a future release that pickle refuses: load it instead
        logger.debug("Tokenizer %s does not pickle (%s); the children load it", type(tokenizer).__name__, e)
        return None


def tokenizer_from_bytes(data: Optional[bytes], path: str, trust_remote_code: bool = False) -> Any:
    """The tokenizer pickled by `tokenizer_to_bytes`, else (None, or bytes that do not load) the one
    stored in `path`."""
    if data is not None:
        try:
            return pickle.loads(data)
        except Exception as e:  # a parent with another transformers, say: the files are the truth
            logger.warning("Could not unpickle the launcher's tokenizer (%s); loading it from %s", e, path)
    return load_tokenizer(path, trust_remote_code)


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


TokenBytes = Callable[[int], Optional[bytes]]
_BYTE_FALLBACK_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SENTENCEPIECE_SPACE = "\u2581"


def make_token_bytes(tokenizer: Any) -> TokenBytes:
    """`token_bytes(token_id)`: the bytes the token itself stands for (OpenAI's logprob `bytes`),
    or None where the vocabulary does not say (the caller then encodes the token's text).

    Decoding one token of a multi-byte character alone gives U+FFFD, whose UTF-8 is not the
    token's bytes. Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen) spell each byte with one
    printable character, so the token's string maps back to its bytes; SentencePiece vocabularies
    with byte fallback spell a lone byte `<0xNN>` and a space `▁`. Added (special) tokens are their
    text. Answers are cached: at most one entry per vocabulary id.
    """
    kinds = _decoder_kinds(tokenizer)
    added = {int(i): str(t) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    if "ByteLevel" in kinds:
        alphabet = byte_level_alphabet()

        def spell(token: str) -> Optional[bytes]:
            codes = [alphabet.get(c) for c in token]
            return None if any(c is None for c in codes) else bytes(c for c in codes if c is not None)
    elif "ByteFallback" in kinds:
        def spell(token: str) -> Optional[bytes]:
            byte = _BYTE_FALLBACK_TOKEN.fullmatch(token)
            return bytes([int(byte.group(1), 16)]) if byte else token.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")
    else:
        return lambda token_id: None

    cache: Dict[int, Optional[bytes]] = {}

    def token_bytes(token_id: int) -> Optional[bytes]:
        if token_id in cache:
            return cache[token_id]
        if token_id in added:
            value: Optional[bytes] = added[token_id].encode("utf-8")
        else:
            token = tokenizer.convert_ids_to_tokens(token_id)
            value = spell(token) if isinstance(token, str) else None
        cache[token_id] = value
        return value

    if not _spells_decode(tokenizer, token_bytes):
        logger.warning("Token bytes of %s disagree with its decode; logprob bytes are the tokens' text",
                       type(tokenizer).__name__)
        return lambda token_id: None
    return token_bytes


def byte_level_alphabet() -> Dict[str, int]:
    """Byte-level BPE's alphabet: the character standing for each byte. Printable Latin-1 bytes
    stand for themselves; the others (controls, space, ...) take the characters from U+0100 on,
    in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in alphabet.values()]
    alphabet.update({chr(0x100 + k): b for k, b in enumerate(others)})
    return alphabet


def _decoder_kinds(tokenizer: Any) -> Set[str]:
    """The component types of a fast tokenizer's decoder (empty for any other tokenizer)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return set()
    kinds: Set[str] = set()
    stack = [decoder]
    while stack:
        part = stack.pop()
        if isinstance(part, dict):
            kinds.add(str(part.get("type")))
            stack.extend(part.get("decoders") or [])
    return kinds


def _spells_decode(tokenizer: Any, token_bytes: TokenBytes) -> bool:
    """The tokens' bytes of a probe text, joined, decode to what the tokenizer decodes: a guard
    against a vocabulary whose strings are not spelled as assumed."""
    probe = "Hello, world! 12 + 3 = 15.\n\tnaïve café – 東京 😀"
    ids = tokenizer.encode(probe, add_special_tokens=False)
    parts = [token_bytes(i) for i in ids]
    if any(p is None for p in parts):
        return False
    joined = b"".join(p for p in parts if p is not None).decode("utf-8", errors="replace")
    return joined == tokenizer.decode(ids) or joined.lstrip() == tokenizer.decode(ids).lstrip()
