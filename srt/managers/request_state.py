"""Per-sample state in the HTTP process, from submission to the last result.

The result loop puts each StrOut (or a Failed marker) on the sample's queue; `ReqState.add`
folds one StrOut into the state and returns the answer so far. Every list in an answer is
cumulative, streaming too, so any single answer is complete on its own (SGLang's /generate
stream). `ReqState.add_delta` folds it in too but answers with what is new only (the OpenAI
streams), so a stream costs O(1) per token there.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from srt.managers.io_struct import SpecCounts, StrOut, TokenLogprobs


@dataclass(frozen=True)
class Failed:
    """Put on a request's queue when the server fails: its consumer raises ServerFailure."""

    reason: str


def _triples(lp: TokenLogprobs) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """TokenLogprobs -> the API's [logprob, token_id, text or None] per token, and per token
    the list of such triples of its top tokens (None for the first prompt token)."""
    texts = lp.texts or [None] * len(lp.token_ids)
    top_texts = lp.top_texts or [None] * len(lp.top_ids)
    tokens = [[v, t, x] for v, t, x in zip(lp.logprobs, lp.token_ids, texts)]
    tops: list[list[list[Any]] | None] = []
    for values, ids, words in zip(lp.top_logprobs, lp.top_ids, top_texts):
        if values is None or ids is None:
            tops.append(None)
        else:
            tops.append([[v, t, w] for v, t, w in zip(values, ids, words or [None] * len(ids))])
    return tokens, tops


@dataclass
class LogprobState:
    """The logprobs of one sample so far, as meta_info reports them (cumulative)."""

    input_token_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)
    output_token_logprobs: list[list[Any]] = field(default_factory=list)
    output_top_logprobs: list[Any] = field(default_factory=list)

    def add(self, out: StrOut) -> dict[str, Any]:
        """Fold the StrOut's entries in; returns them alone (meta_info's four lists)."""
        new: dict[str, Any] = {"input_token_logprobs": [], "input_top_logprobs": [],
                               "output_token_logprobs": [], "output_top_logprobs": []}
        if out.input_logprobs is not None:
            tokens, tops = _triples(out.input_logprobs)
            self.input_token_logprobs += tokens
            self.input_top_logprobs += tops
            new["input_token_logprobs"], new["input_top_logprobs"] = tokens, tops
        if out.output_logprobs is not None:
            tokens, tops = _triples(out.output_logprobs)
            self.output_token_logprobs += tokens
            self.output_top_logprobs += tops
            new["output_token_logprobs"], new["output_top_logprobs"] = tokens, tops
        return new

    def meta(self) -> dict[str, Any]:
        values = [t[0] for t in self.input_token_logprobs if t[0] is not None]
        return {
            "input_token_logprobs": list(self.input_token_logprobs),
            "output_token_logprobs": list(self.output_token_logprobs),
            "input_top_logprobs": list(self.input_top_logprobs),
            "output_top_logprobs": list(self.output_top_logprobs),
            # mean logprob of the prompt tokens from logprob_start_len on (None: none asked)
            "normalized_prompt_logprob": sum(values) / len(values) if values else None,
        }


@dataclass
class ReqState:
    user_rid: str
    parent_rid: str = ""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    logprobs: LogprobState | None = None  # None: no logprobs asked
    lora_id: int = 0  # its LoRA adapter (0: none): an adapter in use is not unloaded
    text: str = ""  # the output text so far

    def _fold(self, out: StrOut) -> dict[str, Any] | None:
        """Fold one StrOut in; its new logprob entries (None: no logprobs asked)."""
        if out.text_start == len(self.text):
            self.text += out.text
        else:  # the final decode differs from what was shown (rare)
            self.text = self.text[: out.text_start] + out.text
        self.output_ids.extend(out.new_ids)
        self.finished = out.finish_reason is not None
        return self.logprobs.add(out) if self.logprobs is not None else None

    def add(self, out: StrOut) -> dict[str, Any]:
        """Fold one StrOut in; returns the answer so far."""
        self._fold(out)
        return self.result_dict(out)

    def add_delta(self, out: StrOut) -> dict[str, Any]:
        """Fold one StrOut in; returns what it adds: `text` from `text_start` on (the text
        before it unchanged), the new ids, and meta_info with the counts and the new logprob
        entries only."""
        new = self._fold(out)
        meta = self._meta(out)
        if new is not None:
            meta.update(new)
        return {"text": out.text, "text_start": out.text_start, "output_ids": out.new_ids,
                "meta_info": meta}

    def _meta(self, out: StrOut) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.user_rid,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": out.finish_reason,
            "forward_passes": out.forward_passes,
        }
        if out.spec is not None:
            meta.update(spec_meta(out.spec, out.completion_tokens))
        return meta

    def result_dict(self, out: StrOut) -> dict[str, Any]:
        """The answer so far; every list in it is cumulative (streaming too)."""
        meta = self._meta(out)
        if self.logprobs is not None:
            meta.update(self.logprobs.meta())
        if out.embedding is not None:  # --is-embedding (SGLang's /encode answer)
            return {"embedding": out.embedding, "meta_info": meta}
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def spec_meta(spec: SpecCounts, completion_tokens: int) -> dict[str, Any]:
    """meta_info's speculative decoding fields, SGLang's names: spec_verify_ct (verification
    steps), spec_accept_length (output tokens per step), spec_accept_rate (accepted / drafted),
    and the counts."""
    return {
        "spec_verify_ct": spec.verify_ct,
        "spec_accept_length": round(completion_tokens / spec.verify_ct, 4)
        if spec.verify_ct else 0.0,
        "spec_accept_rate": round(spec.accepted_tokens / spec.draft_tokens, 4)
        if spec.draft_tokens else 0.0,
        "spec_draft_token_num": spec.draft_tokens,
        "spec_accept_token_num": spec.accepted_tokens,
    }
