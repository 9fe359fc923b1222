"""The tokenizer's vocabulary as outlines-core wants it: each token as the bytes it stands for.

Byte-level BPE tokenizers (GPT-2 style: SmolLM2, Llama 3, Qwen) store every byte as a printable
stand-in character (a space is "Ġ"); SentencePiece-style ones mark a leading space with "▁" and
write raw bytes as "<0xAB>". Special tokens are left out: only EOS may end a constrained output,
and outlines-core adds it itself.
"""

from __future__ import annotations

from typing import Any


def byte_level_alphabet() -> dict[str, int]:
    """Stand-in character -> byte of the GPT-2 byte-level alphabet.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are mapped, in byte order,
    onto code points from 256 up.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _is_byte_level(vocab: dict[str, int]) -> bool:
    # Byte-level vocabularies spell a leading space "Ġ" and never contain a raw space.
    return any(t.startswith("Ġ") for t in vocab) and not any(" " in t for t in vocab)


def token_bytes_map(tokenizer: Any) -> dict[int, bytes]:
    """Token id -> bytes, for every non-special token of the tokenizer."""
    vocab: dict[str, int] = tokenizer.get_vocab()
    special = set(tokenizer.all_special_ids)
    out: dict[int, bytes] = {}
    if _is_byte_level(vocab):
        alphabet = byte_level_alphabet()
        for tok, i in vocab.items():
            if i in special:
                continue
            try:
                out[i] = bytes(alphabet[c] for c in tok)
            except KeyError:  # an added token outside the alphabet (e.g. "<tool_call>")
                out[i] = tok.encode("utf-8")
        return out
    for tok, i in vocab.items():
        if i in special:
            continue
        if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
            out[i] = bytes([int(tok[3:5], 16)])
        else:
            out[i] = tok.replace("▁", " ").encode("utf-8")
    return out


def build_vocabulary(tokenizer: Any, eos_token_id: int,
                     token_bytes: dict[int, bytes] | None = None) -> Any:
    """An outlines_core.Vocabulary over the tokenizer (EOS excluded from the byte map);
    `token_bytes` is `token_bytes_map(tokenizer)` when the caller already has it."""
    from outlines_core import Vocabulary

    if token_bytes is None:
        token_bytes = token_bytes_map(tokenizer)
    grouped: dict[bytes, list[int]] = {}
    for i, b in token_bytes.items():
        if i == eos_token_id or not b:
            continue
        grouped.setdefault(b, []).append(i)
    return Vocabulary(eos_token_id, grouped)
