"""Tests of srt.memory_pool: slot / row accounting against a reference set, buffer layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.memory_pool import ReqToTokenPool, TokenToKVPool


def make_kv_pool(size: int, layers: int = 1, kv_heads: int = 2, head_dim: int = 4,
                 dtype: torch.dtype = torch.float32) -> TokenToKVPool:
    return TokenToKVPool(size, layers, kv_heads, head_dim, dtype, "cpu")


# ---------------------------------------------------------------------- TokenToKVPool


def test_fresh_pool_hands_out_every_slot_once_and_never_the_padding_slot() -> None:
    pool = make_kv_pool(10)
    assert pool.available_size() == 10
    a = pool.alloc(4)
    b = pool.alloc(6)
    assert a is not None and b is not None
    assert a.dtype == torch.int64 and a.dim() == 1 and a.device.type == "cpu"
    got = a.tolist() + b.tolist()
    assert sorted(got) == list(range(10))  # every slot once; slot 10 (padding) never
    assert pool.available_size() == 0
    assert pool.alloc(1) is None
    assert pool.available_size() == 0


def test_alloc_too_many_returns_none_and_takes_nothing() -> None:
    pool = make_kv_pool(8)
    first = pool.alloc(5)
    assert first is not None
    assert pool.alloc(4) is None
    assert pool.available_size() == 3
    rest = pool.alloc(3)
    assert rest is not None
    assert sorted(first.tolist() + rest.tolist()) == list(range(8))


def test_alloc_zero_is_empty_and_free_empty_is_noop() -> None:
    pool = make_kv_pool(4)
    out = pool.alloc(0)
    assert out is not None and out.numel() == 0
    pool.free(torch.empty(0, dtype=torch.int64))
    assert pool.available_size() == 4


def test_free_accepts_other_int_dtypes_and_returns_them_as_int64() -> None:
    pool = make_kv_pool(6)
    slots = pool.alloc(6)
    assert slots is not None
    pool.free(slots[:3].to(torch.int32))
    again = pool.alloc(3)
    assert again is not None and again.dtype == torch.int64
    assert sorted(again.tolist()) == sorted(slots[:3].tolist())


def test_free_then_realloc_returns_all_slots_and_clear_resets() -> None:
    pool = make_kv_pool(12)
    parts = [pool.alloc(n) for n in (3, 4, 5)]
    assert all(p is not None for p in parts)
    # free in a different order than allocated
    for p in (parts[1], parts[2], parts[0]):
        pool.free(p)
    assert pool.available_size() == 12
    everything = pool.alloc(12)
    assert everything is not None
    assert sorted(everything.tolist()) == list(range(12))
    pool.clear()
    assert pool.available_size() == 12
    assert sorted(pool.alloc(12).tolist()) == list(range(12))


@st.composite
def kv_ops(draw: st.DrawFn) -> tuple[int, list[tuple[str, int, int]]]:
    size = draw(st.integers(1, 40))
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["alloc", "free"]),
                st.integers(0, size + 5),  # alloc: n (may exceed what is free)
                st.integers(0, 2**16),  # free: which outstanding slots (seed)
            ),
            max_size=40,
        )
    )
    return size, ops


@settings(max_examples=150, deadline=None)
@given(kv_ops())
def test_kv_pool_matches_reference_set(case: tuple[int, list[tuple[str, int, int]]]) -> None:
    size, ops = case
    pool = make_kv_pool(size)
    out: set[int] = set()  # slots currently handed out
    for op, n, seed in ops:
        if op == "alloc":
            before = pool.available_size()
            got = pool.alloc(n)
            if n > size - len(out):
                assert got is None
                assert pool.available_size() == before  # nothing taken
            else:
                assert got is not None
                slots = got.tolist()
                assert len(slots) == n
                assert len(set(slots)) == n, "duplicate slot in one alloc"
                assert not (set(slots) & out), "slot handed out twice"
                assert all(0 <= s < size for s in slots), "padding slot or out of range"
                out |= set(slots)
        else:
            if not out:
                continue
            g = torch.Generator().manual_seed(seed)
            ordered = sorted(out)
            perm = torch.randperm(len(ordered), generator=g).tolist()
            k = 1 + seed % len(ordered)
            chosen = [ordered[i] for i in perm[:k]]
            pool.free(torch.tensor(chosen, dtype=torch.int64))
            out -= set(chosen)
        assert pool.available_size() == size - len(out)
    # Free all that is out: every slot comes back exactly once.
    if out:
        pool.free(torch.tensor(sorted(out), dtype=torch.int64))
    assert pool.available_size() == size
    everything = pool.alloc(size)
    assert everything is not None and sorted(everything.tolist()) == list(range(size))
    assert pool.alloc(1) is None


def test_slots_come_back_in_fifo_order_across_small_and_large_frees() -> None:
    """The free list is a FIFO: never-used slots in index order, then freed ones in the order
    they were freed (every TP rank must hand out the same slots). A reference deque of ints
    gives the exact order; frees mix one-slot, short and long (over the merge size) chunks."""
    from collections import deque

    size = 20_000
    pool = make_kv_pool(size)
    ref = deque(range(size))
    out: list[int] = []
    g = torch.Generator().manual_seed(3)
    for step in range(300):
        if step % 3 != 2 or not out:
            n = int(torch.randint(0, 3000 if step % 7 == 0 else 40, (1,), generator=g))
            n = min(n, len(ref))
            got = pool.alloc(n)
            assert got is not None and got.tolist() == [ref.popleft() for _ in range(n)]
            out.extend(got.tolist())
        else:
            k = int(torch.randint(1, len(out) + 1, (1,), generator=g))
            perm = torch.randperm(len(out), generator=g)[:k].tolist()
            chosen = [out[i] for i in perm]
            t = torch.tensor(chosen, dtype=torch.int32 if step % 2 else torch.int64)
            pool.free(t)
            t.fill_(-1)  # the pool kept its own copy
            ref.extend(chosen)
            gone = set(chosen)
            out = [x for x in out if x not in gone]
        assert pool.available_size() == len(ref)
    rest = pool.alloc(len(ref))
    assert rest is not None and rest.tolist() == list(ref)
    assert pool.alloc(1) is None


@pytest.mark.parametrize(
    "dtype,itemsize", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)]
)
def test_buffer_shapes_and_bytes_per_token(dtype: torch.dtype, itemsize: int) -> None:
    pool = TokenToKVPool(size=17, num_layers=3, kv_heads=5, head_dim=8, dtype=dtype, device="cpu")
    assert len(pool.k_buffer) == 3 and len(pool.v_buffer) == 3
    for buf in pool.k_buffer + pool.v_buffer:
        assert buf.shape == (18, 5, 8)  # size + 1: the padding slot
        assert buf.dtype == dtype
    # 2 (K and V) * layers * kv_heads * head_dim * itemsize
    assert pool.bytes_per_token == 2 * 3 * 5 * 8 * itemsize
    # every layer's K and V are separate storage
    ptrs = {b.data_ptr() for b in pool.k_buffer + pool.v_buffer}
    assert len(ptrs) == 6
    k1, v1 = pool.get_kv_buffer(1)
    assert k1 is pool.k_buffer[1] and v1 is pool.v_buffer[1]


def test_padding_slot_is_writable() -> None:
    pool = make_kv_pool(4)
    k, _ = pool.get_kv_buffer(0)
    k[4] = 1.0  # slot `size` exists
    assert pool.alloc(4) is not None and pool.alloc(1) is None


# ---------------------------------------------------------------------- ReqToTokenPool


def test_req_pool_table_shape() -> None:
    pool = ReqToTokenPool(size=6, context_len=33, device="cpu")
    assert pool.req_to_token.shape == (6, 33)
    assert pool.req_to_token.dtype == torch.int32
    assert pool.available_size() == 6


def test_req_pool_rows_exhaust_and_come_back() -> None:
    pool = ReqToTokenPool(size=4, context_len=8, device="cpu")
    rows = [pool.alloc() for _ in range(4)]
    assert sorted(rows) == [0, 1, 2, 3]
    assert pool.alloc() is None
    assert pool.available_size() == 0
    pool.free(rows[2])
    assert pool.available_size() == 1
    assert pool.alloc() == rows[2]
    assert pool.alloc() is None
    pool.clear()
    assert pool.available_size() == 4
    assert sorted(pool.alloc() for _ in range(4)) == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_req_pool_free_out_of_range_raises(bad: int) -> None:
    pool = ReqToTokenPool(size=4, context_len=8, device="cpu")
    pool.alloc()
    with pytest.raises(ValueError):
        pool.free(bad)
    assert pool.available_size() == 3  # nothing appended


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 12),
    st.lists(st.tuples(st.booleans(), st.integers(0, 2**16)), max_size=40),
)
def test_req_pool_matches_reference_set(size: int, ops: list[tuple[bool, int]]) -> None:
    pool = ReqToTokenPool(size=size, context_len=4, device="cpu")
    out: set[int] = set()
    for is_alloc, seed in ops:
        if is_alloc:
            row = pool.alloc()
            if len(out) == size:
                assert row is None
            else:
                assert row is not None and 0 <= row < size and row not in out
                out.add(row)
        elif out:
            row = sorted(out)[seed % len(out)]
            pool.free(row)
            out.remove(row)
        assert pool.available_size() == size - len(out)
    for row in sorted(out):
        pool.free(row)
    assert sorted(pool.alloc() for _ in range(size)) == list(range(size))
    assert pool.alloc() is None
