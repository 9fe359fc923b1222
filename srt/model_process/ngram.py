"""NGRAM drafts (prompt lookup): a request's next tokens guessed from its own prompt and output.

The longest suffix of the request's tokens (at most `max_n`, at least `min_n` tokens) that also
occurs earlier in them is looked up, and the tokens that followed its latest earlier occurrence
are the draft (continued as an overlapping copy where that occurrence is so recent that fewer
than k tokens follow it: a repeated token or a short cycle drafts itself k tokens on). Editing, summarizing and code rewriting copy long runs of the prompt, so the guess
is often right; where it is wrong the model's verification rejects it and nothing changes.

Each request keeps an index of its tokens, updated as tokens are appended: for every n in
min_n .. max_n, a map from each n-gram to the positions just after its latest occurrences (up to
MAX_OCCURRENCES) that are followed by a token. So a lookup is max_n - min_n + 1 dictionary
probes, whatever the length.

A tree of drafts (`--speculative-ngram-max-bfs-breadth` above 1, `propose_tree`) merges the
continuations of several occurrences: those of the longest recurring suffix, latest first, then
of shorter ones, into a trie in which a node has at most `breadth` children. The occurrence of
rank r weighs 1 / (r + 1); a node's score is its parent's times the share of the parent's
weight that passes through it times DECAY (a guess of how likely a node is reached: branches
split it by weight, depth wears it down), and the best k nodes are kept. With breadth 1 that is
the chain `propose` drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_OCCURRENCES = 8  # latest occurrences kept per n-gram (for tree drafts)
DECAY = 0.9  # a tree node's score: each level deeper is less likely to be reached


@dataclass
class NgramIndex:
    """The n-gram index of one token sequence (see the module docstring). `tokens` is the
    sequence as last seen; `sync` brings the index up to a new sequence that extends it (or
    rebuilds it if the sequence was rewritten, e.g. a jump-forward re-tokenized its tail)."""

    min_n: int
    max_n: int
    tokens: list[int] = field(default_factory=list)
    # maps[n - min_n][ngram] = positions after its latest occurrences followed by a token,
    # the latest last
    maps: list[dict[tuple[int, ...], list[int]]] = field(default_factory=list)

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
                    seen = m.setdefault(tuple(toks[end - n : end]), [])
                    seen.append(end)
                    if len(seen) > MAX_OCCURRENCES:
                        del seen[0]

    def _continuation(self, pos: int, k: int) -> list[int]:
        """The k tokens after position pos - 1. An occurrence close to the end continues into
        the draft itself (an overlapping copy, as in LZ77): a run or a short period drafts k
        tokens."""
        toks = self.tokens
        draft = toks[pos : pos + k]
        for i in range(len(draft), k):
            draft.append(draft[i - (len(toks) - pos)])
        return draft

    def _occurrences(self, most: int) -> list[int]:
        """Positions after the recurring suffixes' occurrences: the longest suffix's, latest
        first, then shorter ones' (new positions only), at most `most`."""
        toks = self.tokens
        out: list[int] = []
        for j in range(len(self.maps) - 1, -1, -1):
            n = self.min_n + j
            if n > len(toks):
                continue
            for pos in reversed(self.maps[j].get(tuple(toks[-n:]), ())):
                if pos not in out:
                    out.append(pos)
            if len(out) >= most:
                break
        return out[:most]

    def propose(self, k: int) -> list[int]:
        """k draft tokens to follow the indexed sequence (none if no suffix recurs)."""
        occ = self._occurrences(1)
        return self._continuation(occ[0], k) if occ else []

    def propose_tree(self, k: int, breadth: int) -> tuple[list[int], list[int]]:
        """At most k nodes (tokens, parents as `VerifyRows` reads them: -1 is the sequence's
        last token) merged from the continuations of up to MAX_OCCURRENCES occurrences, at most
        `breadth` children a node (see the module docstring)."""
        tokens: list[int] = []
        parents: list[int] = []
        weight: list[float] = []
        kids: dict[int, dict[int, int]] = {-1: {}}
        total = 0.0
        for rank, pos in enumerate(self._occurrences(MAX_OCCURRENCES)):
            w = 1.0 / (rank + 1)  # a later occurrence counts more
            total += w
            node = -1
            for t in self._continuation(pos, k):
                child = kids[node].get(t)
                if child is None:
                    if len(kids[node]) >= breadth:
                        break
                    child = kids[node][t] = len(tokens)
                    kids[child] = {}
                    tokens.append(t)
                    parents.append(node)
                    weight.append(0.0)
                weight[child] += w
                node = child
        # a node's score: its parent's x the share of the parent's weight it holds x DECAY,
        # so below its parent's, and a parent comes first: the best k hold their parents
        score: list[float] = []
        for i, p in enumerate(parents):
            up = (score[p], weight[p]) if p >= 0 else (1.0, total)
            score.append(up[0] * weight[i] / up[1] * DECAY)
        best = sorted(sorted(range(len(tokens)), key=lambda i: (-score[i], i))[:k])
        new = {old: i for i, old in enumerate(best)}
        return [tokens[i] for i in best], [new[parents[i]] if parents[i] >= 0 else -1
                                           for i in best]


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

    def propose_tree(self, req: object, k: int, breadth: int) -> tuple[list[int], list[int]]:
        """Up to k draft nodes for `req` in a tree of at most `breadth` children a node."""
        if k <= 0:
            return [], []
        self.propose(req, 0)  # (brings its index up to date)
        return getattr(req, "draft_index").propose_tree(k, breadth)
