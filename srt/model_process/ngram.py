"""NGRAM drafts (prompt lookup): a request's next tokens guessed from its own prompt and output.

The longest suffix of the request's tokens (at most `max_n`, at least `min_n` tokens) that also
occurs earlier in them is looked up, and the tokens that followed its latest earlier occurrence
are the draft (continued as an overlapping copy where that occurrence is so recent that fewer
than k tokens follow it: a repeated token or a short cycle drafts itself k tokens on). Editing, summarizing and code rewriting copy long runs of the prompt, so the guess
is often right; where it is wrong the model's verification rejects it and nothing changes.

Each request keeps an index of its tokens, updated as tokens are appended: for every n in
min_n .. max_n, a map from each n-gram to the position just after its latest occurrence that is
followed by a token. So a lookup is max_n - min_n + 1 dictionary probes, whatever the length.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """The n-gram index of one token sequence (see the module docstring). `tokens` is the
    sequence as last seen; `sync` brings the index up to a new sequence that extends it (or
    rebuilds it if the sequence was rewritten, e.g. a jump-forward re-tokenized its tail)."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    # maps[n - min_n][ngram] = position after the latest occurrence followed by a token
    maps: list[dict[tuple[int, ...], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.maps = [{} for _ in range(self.max_n - self.min_n + 1)]

    def sync(self, seq: list[int]) -> None:
        """Index `seq`: only what was appended since the last call, unless it diverged."""
        old = self.tokens
        if len(seq) < len(old) or seq[len(old) - 1 : len(old)] != old[-1:] or (
                old and seq[: len(old)] != old):
            self.tokens = []
            self.maps = [{} for _ in self.maps]
            old = self.tokens
        start = len(old)
        self.tokens = list(seq)
        toks = self.tokens
        # An n-gram ending at `end` (exclusive) is recorded once the token at `end` exists.
        for end in range(max(start, 1), len(toks)):
            for k, m in enumerate(self.maps):
                n = self.min_n + k
                if end >= n:
                    m[tuple(toks[end - n : end])] = end

    def propose(self, k: int) -> list[int]:
        """k draft tokens to follow the indexed sequence (none if no suffix recurs)."""
        toks = self.tokens
        for j in range(len(self.maps) - 1, -1, -1):
            n = self.min_n + j
            if n > len(toks):
                continue
            pos = self.maps[j].get(tuple(toks[-n:]))
            if pos is not None:
                draft = toks[pos : pos + k]
                # An occurrence close to the end continues into the draft itself (an
                # overlapping copy, as in LZ77): a run or a short period drafts k tokens.
                for i in range(len(draft), k):
                    draft.append(draft[i - (len(toks) - pos)])
                return draft
        return []


class NgramProposer:
    """Drafts for running requests (`--speculative-algorithm NGRAM`). Each request's index lives
    on the request (`Req.draft_index`), so it follows the request through retraction."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: object, k: int) -> list[int]:
        """Up to k draft tokens for `req` (its prompt and output ids on the host)."""
        index = getattr(req, "draft_index")
        if index is None:
            index = NgramIndex(self.min_n, self.max_n)
            setattr(req, "draft_index", index)
        index.sync(req.origin_input_ids + req.output_ids)  # type: ignore[attr-defined]
        return index.propose(k) if k > 0 else []
