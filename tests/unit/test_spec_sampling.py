"""Rejection sampling of draft tokens (`verify_sample`): greedy rows emit their argmax, and a
sampled row emits tokens distributed as the model's filtered distribution whatever the draft
token is; a chi-square test over many draws that rejects a sampler accepting every draft."""

from __future__ import annotations

import math

import torch

from srt.layers.sampler import SamplingBatchInfo, _filtered_probs, verify_sample

V = 12


def _info(n: int, temperature: float, top_k: int = V, seeds: list | None = None,
          positions: list | None = None) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.full((n,), temperature), top_ps=torch.ones(n),
        top_ks=torch.full((n,), top_k, dtype=torch.int64), min_ps=torch.zeros(n),
        all_greedy=temperature == 0, need_top_p_k=top_k < V, need_min_p=False,
        seeds=seeds or [None] * n, positions=positions or [0] * n)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the cells of non-zero probability, and its degrees of freedom;
    a draw in a cell of zero probability makes it infinite."""
    n = counts.sum().item()
    if (counts[probs == 0] > 0).any():
        return math.inf, 0
    keep = probs > 0
    exp = probs[keep] * n
    return float(((counts[keep] - exp) ** 2 / exp).sum()), int(keep.sum()) - 1


# chi-square critical values at p = 0.001
CRITICAL = {3: 16.27, 4: 18.47, 5: 20.52, 7: 24.32, 11: 31.26}


def test_greedy_rows_emit_the_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g)
    draft_next = torch.tensor([3, -1, int(logits[2].argmax()), 0, -1, 5])
    out = verify_sample(logits, _info(6, 0.0), draft_next, g)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_draws_follow_the_model_distribution_for_any_draft() -> None:
    n = 40_000
    g = torch.Generator().manual_seed(1)
    row = torch.randn(V, generator=g) * 1.5
    for top_k, draft in ((V, int(row.argmax())), (V, int(row.argmin())), (6, 2)):
        info = _info(n, 0.9, top_k)
        logits = row.expand(n, V).clone()
        p = _filtered_probs(logits[:1], _info(1, 0.9, top_k))[0]
        p = p / p.sum()
        out = verify_sample(logits, info, torch.full((n,), draft), g)
        counts = torch.bincount(out, minlength=V).double()
        stat, df = _chi_square(counts, p.double())
        assert stat < CRITICAL[df], (top_k, draft, stat, df)
        # the draft is accepted with its probability
        assert abs(counts[draft].item() / n - p[draft].item()) < 0.01
        # a sampler that accepted every draft fails the same test
        naive = torch.zeros(V, dtype=torch.float64)
        naive[draft] = n
        assert _chi_square(naive, p.double())[0] > CRITICAL[df]


def test_rows_without_a_draft_are_plain_samples() -> None:
    n = 30_000
    g = torch.Generator().manual_seed(2)
    row = torch.randn(V, generator=g)
    p = torch.softmax(row / 1.3, -1).double()
    out = verify_sample(row.expand(n, V).clone(), _info(n, 1.3), torch.full((n,), -1), g)
    stat, df = _chi_square(torch.bincount(out, minlength=V).double(), p)
    assert stat < CRITICAL[df]


def test_seeded_rows_repeat() -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(3))
    info = _info(4, 1.0, seeds=[7, 7, 8, None], positions=[0, 1, 0, 0])
    draft = torch.tensor([1, 2, 3, 4])
    a = verify_sample(logits, info, draft, torch.Generator().manual_seed(10))
    b = verify_sample(logits, info, draft, torch.Generator().manual_seed(11))
    assert a[:3].tolist() == b[:3].tolist()  # seeded rows ignore the shared generator


def test_several_children_keep_the_model_distribution() -> None:
    """A row of a draft tree tries its children in order: each emitted token, a child's or
    not, is distributed as p, and each child is emitted with its probability; a sampler that
    took the first child whenever it could fails the same test."""
    n = 40_000
    g = torch.Generator().manual_seed(5)
    row = torch.randn(V, generator=g) * 1.5
    top = row.argsort(descending=True)
    for kids in ([int(top[0]), int(top[1]), int(top[2])], [int(top[-1]), int(top[3])],
                 [int(top[1]), -1, -1]):
        info = _info(n, 0.9)
        p = torch.softmax(row / 0.9, -1)
        children = torch.tensor(kids).expand(n, len(kids)).clone()
        out = verify_sample(row.expand(n, V).clone(), info, children, g)
        counts = torch.bincount(out, minlength=V).double()
        stat, df = _chi_square(counts, p.double())
        assert stat < CRITICAL[df], (kids, stat)
        for c in kids:
            if c >= 0:
                assert abs(counts[c].item() / n - p[c].item()) < 0.01, (kids, c)
        naive = torch.zeros(V, dtype=torch.float64)  # always the first child
        naive[kids[0]] = n
        assert _chi_square(naive, p.double())[0] > CRITICAL[df]


def test_greedy_tree_rows_emit_the_argmax() -> None:
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, V, generator=g)
    best = logits.argmax(-1)
    children = torch.tensor([[int(best[0]), 1, 2], [3, 4, -1], [-1, -1, -1]])
    assert verify_sample(logits, _info(3, 0.0), children, g).tolist() == best.tolist()
