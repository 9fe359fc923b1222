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
