"""NGRAM drafts (srt/model_process/ngram.py): the incremental index proposes what a brute-force
search over the whole sequence proposes, also after the sequence is rewritten."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from srt.model_process.ngram import NgramIndex


def brute_force(seq: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The longest suffix of min_n..max_n tokens that occurs earlier followed by a token; the
    k tokens after its latest such occurrence, the sequence continued by copying them."""
    for n in range(max_n, min_n - 1, -1):
        if n > len(seq):
            continue
        suffix = seq[-n:]
        for end in range(len(seq) - 1, n - 1, -1):  # occurrence seq[end - n:end], end < len
            if seq[end - n : end] == suffix:
                ext = list(seq)
                for i in range(k):  # what follows the occurrence, copied on past the end
                    ext.append(ext[end + i])
                return ext[len(seq) :]
    return []


tokens = st.lists(st.integers(0, 5), max_size=60)


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(tokens, min_size=1, max_size=6), lo=st.integers(1, 3),
       span=st.integers(0, 4), k=st.integers(1, 6), rewrite=st.integers(0, 10))
def test_index_matches_brute_force(chunks: list[list[int]], lo: int, span: int, k: int,
                                   rewrite: int) -> None:
    idx = NgramIndex(lo, lo + span)
    seq: list[int] = []
    for i, chunk in enumerate(chunks):
        seq = seq + chunk
        if i == 2 and rewrite and seq:  # a jump-forward rewrote the tail
            seq = seq[: max(0, len(seq) - rewrite)] + [9, 8]
        idx.sync(seq)
        assert idx.propose(k) == brute_force(seq, lo, lo + span, k), (seq, lo, span, k)


def test_copy_of_the_prompt_is_proposed() -> None:
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    idx = NgramIndex(1, 4)
    idx.sync(prompt + [3, 11, 12])
    assert idx.propose(4) == [13, 14, 15, 16]
    idx.sync(prompt + [3, 11, 12, 13, 14])  # appended
    assert idx.propose(2) == [15, 16]
    idx.sync(prompt + [3, 99])  # no earlier occurrence of 99
    assert idx.propose(4) == []
    idx.sync([4, 5, 6, 6])  # a run drafts itself on
    assert idx.propose(3) == [6, 6, 6]
    idx.sync([1, 2, 3, 1, 2])  # as does a cycle
    assert idx.propose(5) == [3, 1, 2, 3, 1]


def brute_tree(seq: list[int], min_n: int, max_n: int, k: int,
               breadth: int) -> set[tuple[int, ...]]:
    """The tree's paths from a plain reading of the rule: the continuations (k tokens, copied
    on past the end) of the recurring suffixes' latest occurrences (up to 8: the longest
    suffix's, latest first, then shorter ones'), merged in that order with at most `breadth`
    children a node; the occurrence of rank r weighs 1 / (r + 1), a path's score is the
    product over its nodes of 0.9 x the node's share of its parent's weight; the best k."""
    occ: list[int] = []
    for n in range(max_n, min_n - 1, -1):
        if n > len(seq):
            continue
        ends = [e for e in range(len(seq) - 1, n - 1, -1) if seq[e - n : e] == seq[-n:]]
        # (the index keeps each n-gram's latest 8 occurrences)
        occ += [e for e in ends[:8] if e not in occ]
        if len(occ) >= 8:
            break
    order: list[tuple[int, ...]] = []
    weight: dict[tuple[int, ...], float] = {(): 0.0}
    kids: dict[tuple[int, ...], int] = {(): 0}
    for r, e in enumerate(occ[:8]):
        ext = list(seq)
        for i in range(k):
            ext.append(ext[e + i])
        path: tuple[int, ...] = ()
        weight[()] += 1 / (r + 1)
        for t in ext[len(seq) :]:
            nxt = path + (t,)
            if nxt not in weight:
                if kids[path] >= breadth:
                    break
                kids[path] += 1
                kids[nxt] = 0
                weight[nxt] = 0.0
                order.append(nxt)
            weight[nxt] += 1 / (r + 1)
            path = nxt

    def score(p: tuple[int, ...]) -> float:
        return 1.0 if not p else score(p[:-1]) * weight[p] / weight[p[:-1]] * 0.9

    best = sorted(range(len(order)), key=lambda i: (-score(order[i]), i))[:k]
    return {order[i] for i in best}


@settings(max_examples=300, deadline=None)
@given(seq=st.lists(st.integers(0, 3), max_size=50), lo=st.integers(1, 2),
       span=st.integers(0, 3), k=st.integers(1, 7), breadth=st.integers(1, 4))
def test_tree_matches_brute_force(seq: list[int], lo: int, span: int, k: int,
                                  breadth: int) -> None:
    idx = NgramIndex(lo, lo + span)
    idx.sync(seq)
    toks, parents = idx.propose_tree(k, breadth)
    assert len(toks) <= k and all(-1 <= p < i for i, p in enumerate(parents))
    paths: list[tuple[int, ...]] = []
    for t, p in zip(toks, parents):
        paths.append((paths[p] if p >= 0 else ()) + (t,))
    assert set(paths) == brute_tree(seq, lo, lo + span, k, breadth), (seq, toks, parents)
    if breadth == 1:  # one child a node: the chain `propose` drafts
        assert toks == idx.propose(k) and parents == list(range(-1, len(toks) - 1))
