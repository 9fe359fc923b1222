"""srt.managers.token_bytes: the bytes each token stands for (OpenAI's logprob `bytes`)."""

from __future__ import annotations

from typing import Any

from srt.managers.token_bytes import TokenBytes, byte_alphabet


def test_byte_alphabet_is_a_bijection_onto_bytes() -> None:
    alphabet = byte_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == 65 and alphabet["Ġ"] == 32 and alphabet["Ċ"] == 10


def test_byte_level_tokens_join_to_the_text(smollm2_tokenizer: Any) -> None:
    tb = TokenBytes(smollm2_tokenizer)
    assert tb.byte_level
    text = "héllo 中文 😀🌟 and plain words\n"
    ids = smollm2_tokenizer.encode(text)
    pieces = [tb(i, smollm2_tokenizer.decode([i])) for i in ids]
    assert b"".join(bytes(p) for p in pieces) == text.encode()
    # some token is part of a character: its text alone is U+FFFD, its bytes are not
    assert any(smollm2_tokenizer.decode([i]) == "\ufffd" and bytes(p) != "\ufffd".encode()
               for i, p in zip(ids, pieces))
    eos = smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert bytes(tb(eos, "<|im_end|>")) == b"<|im_end|>"  # special: the UTF-8 of its text


class SentencePieceLike:
    """Just the tokenizer methods TokenBytes uses, with a SentencePiece-style vocabulary."""

    vocab = {"<s>": 0, "▁the": 1, "<0xE2>": 2, "<0x80>": 3, "ing": 4}
    all_special_ids = [0]

    def get_added_vocab(self) -> dict[str, int]:
        return {}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def convert_ids_to_tokens(self, i: int) -> str:
        return {v: k for k, v in self.vocab.items()}[i]


def test_sentencepiece_byte_fallback_and_text_fallback() -> None:
    tb = TokenBytes(SentencePieceLike())
    assert not tb.byte_level
    assert tb(2, "\ufffd") == [0xE2] and tb(3, "\ufffd") == [0x80]
    assert tb(1, " the") == list(b" the")
    assert tb(0, "<s>") == list(b"<s>")
