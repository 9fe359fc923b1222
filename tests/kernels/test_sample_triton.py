"""The one-pass sampler (srt/layers/sample_triton.py) in Triton's interpreter: greedy rows equal
torch.argmax (ties too), sampled rows follow softmax(logits / T) (chi-square), a row's draw
depends only on its seed, and `sample` takes it where it applies."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

pytest.importorskip("triton")

from srt.layers import sampler  # noqa: E402
from srt.layers.sample_triton import gumbel_sample  # noqa: E402
from srt.layers.sampler import SamplingBatchInfo, sample  # noqa: E402
from tests.kernels.compile_sm90 import compile_in_subprocess, ptxas  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _info(temps: list[float], seeds: list[int | None] | None = None,
          positions: list[int] | None = None, vocab: int = 8) -> SamplingBatchInfo:
    bs = len(temps)
    return SamplingBatchInfo(
        temperatures=torch.tensor(temps, device=DEV), top_ps=torch.ones(bs, device=DEV),
        top_ks=torch.full((bs,), vocab, device=DEV), min_ps=torch.zeros(bs, device=DEV),
        all_greedy=all(t == 0 for t in temps), need_top_p_k=False, need_min_p=False,
        seeds=seeds or [None] * bs, positions=positions or [0] * bs)


def _chi_square_ok(ids: torch.Tensor, p: torch.Tensor) -> None:
    """Counts of ids against n * p: the statistic under the 0.001 quantile of its df."""
    n, k = ids.numel(), p.numel()
    counts = torch.bincount(ids.cpu(), minlength=k).double()
    expected = n * p.double()
    stat = float(((counts - expected) ** 2 / expected).sum())
    limits = {3: 16.27, 7: 24.32}  # chi-square 0.999 quantiles by degrees of freedom
    assert stat < limits[k - 1], (stat, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("chunk", [16, 4096])
def test_greedy_rows_equal_argmax_with_ties(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=g)
    logits[1, 3] = logits[1, 60] = logits[1].max() + 1  # a tie across chunks: the first id
    logits[2, 40] = logits[2, 41] = logits[2].max() + 1  # a tie inside a block
    logits[3, 69] = logits[3].max() + 1  # the last id
    logits[4, :] = float("-inf")
    logits[4, 33] = 0.5  # every other token forbidden
    temps = torch.zeros(5)
    out = gumbel_sample(logits.to(DEV), temps.to(DEV), torch.arange(5, device=DEV), chunk=chunk)
    assert out.cpu().tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_tie_in_one_lane_across_blocks_takes_the_first() -> None:
    """Ids 7 and 7 + BLOCK meet in the same lane of one chunk's loop: the first stays."""
    from srt.layers.sample_triton import BLOCK

    logits = torch.randn(2, 2 * BLOCK + 50, generator=torch.Generator().manual_seed(4))
    logits[:, 7] = logits[:, 7 + BLOCK] = logits.max() + 1
    logits[1, 7 + 2 * BLOCK] = logits.max() + 1  # the later, larger one wins
    out = gumbel_sample(logits.to(DEV), torch.zeros(2, device=DEV), torch.arange(2, device=DEV))
    assert out.cpu().tolist() == [7, 7 + 2 * BLOCK] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("chunk", [4, 8])
def test_sampled_rows_follow_softmax_at_temperature(chunk: int) -> None:
    """600 rows of the same 8 logits, each its own seed (one program a row in the
    interpreter: the count is what the suite's time allows; ignoring the temperature gives a
    statistic near 80 against the limit of 24); chunk 4 spreads a row over two chunks, so
    the cross-chunk pick is tested too."""
    g = torch.Generator().manual_seed(1)
    row = torch.randn(8, generator=g) * 1.5
    n, t = 600, 0.7
    ids = gumbel_sample(row.expand(n, 8).contiguous().to(DEV), torch.full((n,), t, device=DEV),
                        torch.arange(n, device=DEV) * 7919 + 3, chunk=chunk)
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 8
    _chi_square_ok(ids, torch.softmax(row / t, dim=0))


def test_forbidden_tokens_are_never_drawn() -> None:
    """-inf logits (min_new_tokens' stop ids, grammar masks) are never drawn; the rest stay
    equally likely."""
    logits = torch.zeros(240, 6)
    logits[:, [1, 4]] = float("-inf")
    ids = gumbel_sample(logits.to(DEV), torch.ones(240, device=DEV),
                        torch.arange(240, device=DEV), chunk=4).cpu().tolist()
    assert not set(ids) & {1, 4}
    keep = [0, 2, 3, 5]
    _chi_square_ok(torch.tensor([keep.index(i) for i in ids]), torch.full((4,), 0.25))


def test_a_row_draw_depends_only_on_its_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `sample`: a seeded row at a position gives the same token whatever its
    neighbours, their number or the generator's state; other positions give other draws."""
    monkeypatch.setattr(sampler, "FUSED", "always")
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 40, generator=g)

    def one(rows: list[int], seeds: list[int | None], positions: list[int], gen_seed: int):
        gen = torch.Generator(device=DEV).manual_seed(gen_seed)
        info = _info([0.9] * len(rows), seeds, positions, vocab=40)
        return sample(logits[rows].to(DEV), info, gen).cpu().tolist()

    alone = one([2], [11], [5], 0)
    crowded = one([0, 1, 2, 3], [None, 7, 11, None], [0, 3, 5, 9], 123)
    assert crowded[2] == alone[0]
    draws = {one([2], [11], [p], 0)[0] for p in range(40)}
    assert len(draws) > 5  # positions draw afresh (a near-flat 40-way choice)


def test_sample_takes_the_kernel_only_without_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    """FUSED "always": a plain temperature batch is sampled by `gumbel_sample` (its draws for a
    seeded row equal the kernel's own with that row's key); top-k rows keep the torch path."""
    monkeypatch.setattr(sampler, "FUSED", "always")
    calls = []
    real = gumbel_sample

    def spy(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr("srt.layers.sample_triton.gumbel_sample", spy)
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(3)).to(DEV)
    info = _info([0.0, 0.8, 1.3], [None, 5, None], [0, 4, 0])
    ids = sample(logits, info, torch.Generator(device=DEV).manual_seed(0))
    assert len(calls) == 1 and int(ids[0]) == int(logits[0].argmax())
    key = torch.tensor([sampler._seed_of(5, 4)], device=DEV)
    assert int(ids[1]) == int(real(logits[1:2], info.temperatures[1:2], key)[0])
    filtered = dataclasses.replace(info, need_top_p_k=True,
                                   top_ks=torch.tensor([8, 2, 8], device=DEV))
    sample(logits, filtered, torch.Generator(device=DEV).manual_seed(0))
    assert len(calls) == 1


def test_a_kernel_that_fails_to_build_falls_back_to_torch(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A compile error of the kernel (at the start-up warm-up) leaves sampling to the torch
    sequence from then on, with a warning, instead of failing every sampled request."""
    monkeypatch.setattr(sampler, "FUSED", "always")

    def broken(*args, **kw):
        raise RuntimeError("no PTX for this device")

    monkeypatch.setattr("srt.layers.sample_triton.gumbel_sample", broken)
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(5)).to(DEV)
    info = _info([0.0, 0.8])
    ids = sample(logits, info, torch.Generator(device=DEV).manual_seed(0))
    assert sampler.FUSED == "never" and "no PTX" in caplog.text
    assert int(ids[0]) == int(logits[0].argmax()) and 0 <= int(ids[1]) < 8


@pytest.mark.skipif(ptxas() is None, reason="Triton's NVIDIA backend has no ptxas here")
def test_kernels_compile_for_sm90() -> None:
    """Both kernels through Triton's compiler and ptxas for an H100 / H200 (the interpreter
    above does not compile them), stage 1 for float32 and bfloat16 logits: Philox's rounds
    (multiply-high instructions) are in its code."""
    chunk32, philox32, chunk16, philox16, pick, _ = compile_in_subprocess("sample")
    assert min(chunk32, chunk16, pick) > 0
    assert philox32 > 0 and philox16 > 0
