"""OpenAI's logprob `bytes`: each token's own bytes, also for a token that holds part of a character
(its text alone is U+FFFD, whose UTF-8 is not the token's bytes)."""

from __future__ import annotations

import pytest

from engine.entrypoints.openai.logprobs import to_chat_logprobs
from engine.utils.tokenizer_utils import make_token_bytes

TEXT = "naïve café – 東京 😀😀 ж\n\tok"


@pytest.fixture(scope="module")
def byte_level():
    from transformers import AutoTokenizer

    from engine.builtin_model import ensure_builtin_model

    return AutoTokenizer.from_pretrained(ensure_builtin_model())


@pytest.fixture(scope="module")
def byte_fallback():
    """A SentencePiece-style vocabulary: a few pieces with ▁ for the space, and <0xNN> pieces for
    every byte of anything else (Llama 2, Mistral, Gemma spell bytes this way)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "n", "a", "ï", "v", "e", "▁caf", "é", "▁ok", "o", "k", "c", "f", "ok"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("name", ["byte_level", "byte_fallback"])
def test_token_bytes_join_to_the_text_and_partial_tokens_are_raw_bytes(request, name):
    tok = request.getfixturevalue(name)
    token_bytes = make_token_bytes(tok)
    ids = tok.encode(TEXT, add_special_tokens=False)
    parts = [token_bytes(i) for i in ids]
    assert None not in parts
    joined = b"".join(parts)
    assert joined.decode("utf-8").strip() == TEXT  # SentencePiece adds the leading space of "▁"
    partial = [p for i, p in zip(ids, parts) if "\ufffd" in tok.decode([i])]
    assert partial, "the text must have tokens that hold part of a character"
    assert all(p != "\ufffd".encode() for p in partial)
    with pytest.raises(UnicodeDecodeError):
        partial[0].decode("utf-8")
    # Special tokens are their text.
    assert token_bytes(tok.eos_token_id) == tok.eos_token.encode()


def test_a_tokenizer_without_a_byte_vocabulary_gives_none():
    class Plain:
        def decode(self, ids, **kwargs):
            return "".join(chr(97 + i) for i in ids)

    assert make_token_bytes(Plain())(3) is None


def test_chat_logprobs_carry_the_tokens_bytes(byte_level):
    tok = byte_level
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) == 2
    entries = [[-0.5, i, tok.decode([i])] for i in ids]
    tops = [[[-0.5, i, tok.decode([i])], [-1.0, ids[0], tok.decode([ids[0]])]] for i in ids]
    content = to_chat_logprobs(entries, tops, decode=lambda i: tok.decode([i]), token_bytes=make_token_bytes(tok))
    assert [c.token for c in content] == ["\ufffd", "\ufffd"]
    assert bytes(content[0].bytes + content[1].bytes) == "😀".encode()
    assert bytes(content[1].top_logprobs[1].bytes) == bytes(content[0].bytes)
    # Without a vocabulary to ask (or where it has no answer), the UTF-8 of the text, as before.
    plain = to_chat_logprobs(entries, tops, decode=lambda i: "", token_bytes=lambda i: None)
    assert plain[0].bytes == list("\ufffd".encode())
