"""The LoRA segmented products (srt/lora/sgmv.py) and one layer's LoRA (srt/lora/layers.py)
against dense float64 references on random inputs: the Triton kernel in the interpreter without
CUDA, the torch path everywhere. Output rows are poisoned before the call; rows of no adapter must
keep the poison (write) or their old value (add)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from srt.lora.sgmv import row_blocks, sgmv_torch, sgmv_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 1234.5


def _grouping(row_slots: list[int], slots: int) -> tuple[torch.Tensor, list[int]]:
    """rows grouped by slot (-1: no adapter, left out) and the slot boundaries."""
    s = np.asarray(row_slots)
    valid = np.nonzero(s >= 0)[0]
    rows = valid[np.argsort(s[valid], kind="stable")]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(s[valid], minlength=slots))])
    return torch.from_numpy(rows.astype(np.int64)), indptr.tolist()


def _blocks(row_slots: list[int], slots: int, block_m: int, pad: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouping's block table on the device, with `pad` padding blocks (slot -1) after."""
    s = np.asarray(row_slots)
    counts = np.bincount(s[s >= 0], minlength=slots)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    slot, start = row_blocks(counts, indptr, block_m)
    slot = np.concatenate([slot, np.full(pad, -1)])
    start = np.concatenate([start, np.zeros(pad, dtype=np.int64)])
    return torch.from_numpy(slot).to(DEV), torch.from_numpy(start).to(DEV)


def _triton(x, w, out, row_slots, slots, add, block_m=16, pad=0) -> None:  # noqa: ANN001
    rows, indptr = _grouping(row_slots, slots)
    sgmv_triton(x, w, out, rows.to(DEV), torch.tensor(indptr, device=DEV),
                *_blocks(row_slots, slots, block_m, pad), block_m, add)


def _reference(x: torch.Tensor, w: torch.Tensor, row_slots: list[int], out: torch.Tensor,
               add: bool) -> torch.Tensor:
    want = out.double().clone()
    for r, s in enumerate(row_slots):
        if s >= 0:
            y = x[r].double() @ w[s].double().t()
            want[r] = want[r] + y if add else y
    return want


CASES = [
    # rows' slots, slots, N, K: a shrink (small N, long K), an expand (long N, small K), a
    # decode-like batch alternating adapters, a group longer than one row block
    ([0, 0, 1, -1, 2, 1, 0], 3, 24, 72),
    ([1, -1, 0, 1, 1], 2, 80, 8),
    ([0, 1, 0, 1, 2, 3, 2, -1, -1, 3], 4, 16, 40),
    ([2] * 37 + [-1, 0, 0], 3, 33, 20),
]


@pytest.mark.parametrize("path", ["torch", "triton", "triton64"])
@pytest.mark.parametrize("add", [False, True], ids=["write", "add"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_sgmv_against_dense(path: str, add: bool, case: int) -> None:
    row_slots, slots, n, k = CASES[case]
    g = torch.Generator().manual_seed(case * 2 + add)
    t = len(row_slots)
    x = torch.randn(t, k, generator=g).to(DEV)
    w = torch.randn(slots, n, k, generator=g).to(DEV)
    out = (torch.randn(t, n, generator=g) if add else torch.full((t, n), POISON)).to(DEV)
    want = _reference(x.cpu(), w.cpu(), row_slots, out.cpu(), add)
    rows, indptr = _grouping(row_slots, slots)
    if path == "torch":
        sgmv_torch(x, w, out, rows.to(DEV), indptr, add)
    else:  # blocks of 16 rows with 3 padding blocks (a CUDA graph's table), or of 64
        _triton(x, w, out, row_slots, slots, add, 64 if path == "triton64" else 16,
                0 if path == "triton64" else 3)
    torch.testing.assert_close(out.cpu().double(), want, rtol=2e-3, atol=2e-3)
    untouched = [r for r, s in enumerate(row_slots) if s < 0]
    if untouched and not add:
        assert (out[untouched] == POISON).all()


def test_sgmv_strided_views() -> None:
    """A slice's expand: x a column block of the shrink output, w and out column blocks."""
    g = torch.Generator().manual_seed(7)
    row_slots = [1, 0, -1, 1]
    x_all = torch.randn(4, 3 * 8, generator=g).to(DEV)
    w_all = torch.randn(2, 50, 8, generator=g).to(DEV)
    out_all = torch.randn(4, 50, generator=g).to(DEV)
    x, w, out = x_all[:, 8:16], w_all[:, 20:45], out_all[:, 20:45]
    want = _reference(x.cpu(), w.cpu(), row_slots, out.cpu(), True)
    before = out_all.clone()
    _triton(x, w, out, row_slots, 2, True)
    torch.testing.assert_close(out.cpu().double(), want, rtol=2e-3, atol=2e-3)
    assert torch.equal(out_all[:, :20], before[:, :20])
    assert torch.equal(out_all[:, 45:], before[:, 45:])


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("layer", ["qkv", "qv", "down"])
def test_lora_layer_against_merged_weights(path: str, layer: str) -> None:
    """One layer's LoRA (srt/lora/layers.py) over 3 slots of adapters of ranks 2, 4 and 8 (the
    rank-2 one without k): each row's output is the base output plus its adapter's
    scaling-weighted B A x, slice by slice; rows of no adapter keep the base output. A grid
    table padded past the step's blocks, as a CUDA graph's, changes nothing. With q and v
    adapted but not k ("qv"), k's columns between them keep the base output."""
    from srt.layers.linear import QKVParallelLinear, RowParallelLinear
    from srt.lora.layers import LoraBatchInfo, LoraLinear, Slice

    g = torch.Generator().manual_seed(3)
    hidden, heads, kv_heads, hd = 64, 4, 2, 16
    if layer in ("qkv", "qv"):
        base = QKVParallelLinear(hidden, hd, heads, kv_heads)
        q, kv = heads * hd, kv_heads * hd
        slices = [Slice("q_proj", "q", 0, q), Slice("k_proj", "k", q, kv),
                  Slice("v_proj", "v", q + kv, kv)]
        fan_in, outs = hidden, {"q_proj": q, "k_proj": kv, "v_proj": kv}
        if layer == "qv":
            del slices[1], outs["k_proj"]
    else:
        base = RowParallelLinear(96, hidden)
        slices = [Slice("down_proj", None, 0, hidden)]
        fan_in, outs = 96, {"down_proj": hidden}
    base.weight.data.copy_(torch.randn(base.weight.shape, generator=g))
    base = base.to(DEV)
    lora = LoraLinear(base, slices, fan_in, layer == "down", 3, 8, torch.float32,
                      torch.device(DEV))
    adapters = []
    for slot, r in enumerate((2, 4, 8)):
        pairs = {m: (torch.randn(r, fan_in, generator=g), torch.randn(n, r, generator=g))
                 for m, n in outs.items() if not (r == 2 and m == "k_proj")}
        lora.write_slot(slot, pairs)
        adapters.append(pairs)
    row_slots = [1, -1, 0, 2, 2, 1, -1, 0, 2]
    x = torch.randn(len(row_slots), fan_in, generator=g).to(DEV)
    base_out = x @ base.weight.t()
    want = base_out.cpu().double().clone()
    for row, slot in enumerate(row_slots):
        if slot < 0:
            continue
        for s in slices:
            if s.module in adapters[slot]:
                a, b = adapters[slot][s.module]
                want[row, s.out_offset:s.out_offset + s.out_size] += \
                    b.double() @ (a.double() @ x[row].cpu().double())
    rows, indptr = _grouping(row_slots, 3)
    info = LoraBatchInfo(rows.to(DEV), torch.tensor(indptr, device=DEV),
                         *_blocks(row_slots, 3, 16, pad=2), 16,
                         indptr if path == "torch" else None)
    out = lora.apply(x, base_out.clone(), info)
    torch.testing.assert_close(out.cpu().double(), want, rtol=1e-3, atol=1e-3)


def test_row_blocks() -> None:
    counts = np.array([3, 0, 37, 1])
    indptr = np.concatenate([[0], np.cumsum(counts)])
    slot, start = row_blocks(counts, indptr, 16)
    assert slot.tolist() == [0, 2, 2, 2, 3] and start.tolist() == [0, 3, 19, 35, 40]
    slot, start = row_blocks(np.zeros(4, dtype=np.int64), np.zeros(5, dtype=np.int64), 16)
    assert len(slot) == 0 and len(start) == 0


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_k_shrink_then_expand(splits: int) -> None:
    """A shrink into float32 partial sums over K splits (some empty when K is short), then an
    expand that adds them as it reads them: the dense B (A x) of each row's slot."""
    g = torch.Generator().manual_seed(splits)
    row_slots = [0, 2, -1, 2, 1, 0, 0, 2, 1]
    t, k, r, n = len(row_slots), 200, 8, 40
    x = torch.randn(t, k, generator=g).to(DEV)
    a = torch.randn(3, r, k, generator=g).to(DEV)
    b = torch.randn(3, n, r, generator=g).to(DEV)
    part = torch.full((splits, t, r), POISON, device=DEV)
    _triton(x, a, part, row_slots, 3, False)
    valid = [i for i, s in enumerate(row_slots) if s >= 0]
    want_a = _reference(x.cpu(), a.cpu(), row_slots, torch.zeros(t, r), False)
    torch.testing.assert_close(part.sum(0).cpu().double()[valid], want_a[valid], rtol=2e-3,
                               atol=2e-3)
    out = torch.randn(t, n, generator=g).to(DEV)
    want = _reference(want_a.float(), b.cpu(), row_slots, out.cpu(), True)
    _triton(part, b, out, row_slots, 3, True)
    torch.testing.assert_close(out.cpu().double(), want, rtol=2e-3, atol=2e-3)
