"""Grammar backends by name (`--grammar-backend`), each imported only when chosen."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srt.constrained.grammar import GrammarBackend

if TYPE_CHECKING:
    from srt.constrained.jump_forward import JumpForward

GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "outlines")


def create_grammar_backend(name: str, tokenizer: Any, eos_token_id: int, vocab_size: int,
                           cache_size: int, jump: "JumpForward | None" = None) -> GrammarBackend:
    """The backend `name` over `tokenizer`. `vocab_size`: the model's logits width (at least the
    tokenizer's); `jump`: the forced-bytes walker of the outlines backend (the others compute
    forced bytes themselves)."""
    if name == "xgrammar":
        from srt.constrained.xgrammar_backend import XGrammarBackend

        return XGrammarBackend(tokenizer, eos_token_id, vocab_size, cache_size)
    if name == "llguidance":
        from srt.constrained.llguidance_backend import LLGuidanceBackend

        return LLGuidanceBackend(tokenizer, eos_token_id, vocab_size, cache_size)
    if name == "outlines":
        from srt.constrained.outlines_backend import OutlinesBackend

        return OutlinesBackend(tokenizer, eos_token_id, cache_size, jump)
    raise ValueError(f"unknown grammar backend {name!r} (one of {', '.join(GRAMMAR_BACKENDS)})")
