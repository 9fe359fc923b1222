"""The bytes a token stands for: the `bytes` of OpenAI's logprobs.

A token can be part of a UTF-8 character (its text alone then decodes to U+FFFD); OpenAI reports
the token's own bytes so that clients can join them. Byte-level BPE vocabularies (SmolLM2,
Llama 3, Qwen) spell each byte as one printable character of the GPT-2 byte alphabet: mapping the
token's characters back gives its exact bytes. SentencePiece byte-fallback tokens `<0xAB>` are one
byte. Anything else (special tokens, other vocabularies) is the UTF-8 of its text.

Runs in the HTTP process: only the tokenizer, no model.
"""

from __future__ import annotations

import re
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte alphabet, character -> byte: printable Latin-1 bytes stand for themselves,
    the other bytes for chr(256 + i) in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    others = [b for b in range(256) if chr(b) not in alphabet]
    alphabet.update({chr(256 + i): b for i, b in enumerate(others)})
    return alphabet


class TokenBytes:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.alphabet = byte_alphabet()
        self.special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        # Byte-level when every regular token is spelled in the byte alphabet.
        self.byte_level = all(
            all(c in self.alphabet for c in piece)
            for piece, i in tokenizer.get_vocab().items() if i not in self.special
        )
        self.cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int, text: str) -> list[int]:
        """The bytes of token_id; text is the token decoded alone (the fallback)."""
        got = self.cache.get(token_id)
        if got is None:
            got = self._bytes(token_id, text)
            self.cache[token_id] = got
        return got

    def _bytes(self, token_id: int, text: str) -> list[int]:
        if token_id not in self.special:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                if self.byte_level:
                    return [self.alphabet[c] for c in piece]
                m = _BYTE_TOKEN.fullmatch(piece)
                if m:
                    return [int(m.group(1), 16)]
        return list(text.encode("utf-8"))
