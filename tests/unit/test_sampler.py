"""Tests of srt.layers.sampler (sample, apply_penalties) and build_sampling_info."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from srt.layers.sampler import SamplingBatchInfo, apply_penalties, sample
from srt.model_process.req import Req
from srt.model_process.sampling_info import build_sampling_info
from srt.sampling_params import SamplingParams

CPU = torch.device("cpu")


def req(prompt: list[int], out: list[int] | None = None, **params: object) -> Req:
    return Req("r", list(prompt), SamplingParams(**params), output_ids=list(out or []))


def info_for(reqs: list[Req], vocab: int, stop_ids: list[set[int]] | None = None) -> SamplingBatchInfo:
    by_req = {id(r): s for r, s in zip(reqs, stop_ids or [set() for _ in reqs])}
    return build_sampling_info(reqs, vocab, CPU, lambda r: by_req[id(r)])[0]


def manual_info(bs: int, vocab: int, *, temperature: float = 1.0, top_p: float = 1.0,
                top_k: int | None = None, min_p: float = 0.0,
                seeds: list[int | None] | None = None,
                positions: list[int] | None = None) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.full((bs,), temperature),
        top_ps=torch.full((bs,), top_p),
        top_ks=torch.full((bs,), top_k if top_k is not None else vocab, dtype=torch.int64),
        min_ps=torch.full((bs,), min_p),
        all_greedy=temperature == 0.0,
        need_top_p_k=top_p < 1.0 or (top_k is not None and top_k < vocab),
        need_min_p=min_p > 0,
        seeds=seeds if seeds is not None else [None] * bs,
        positions=positions if positions is not None else [0] * bs,
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ build_sampling_info


def test_build_sampling_info_fields() -> None:
    reqs = [
        req([1, 2], temperature=0.0),
        req([3], [4, 5], temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=11),
        req([6], [7], top_k=1, temperature=0.5),  # top_k 1 is greedy
        req([8]),  # defaults
    ]
    info = info_for(reqs, 32)
    assert info.temperatures.tolist() == pytest.approx([0.0, 0.7, 0.0, 1.0])
    assert info.top_ks.tolist() == [32, 5, 1, 32]
    assert info.top_ps.tolist() == pytest.approx([1.0, 0.9, 1.0, 1.0])
    assert info.min_ps.tolist() == pytest.approx([0.0, 0.1, 0.0, 0.0])
    assert not info.all_greedy and info.need_top_p_k and info.need_min_p
    assert info.seeds == [None, 11, None, None]
    assert info.positions == [0, 2, 1, 0]
    assert info.output_counts is None and info.forbidden is None
    greedy = info_for([req([1], temperature=0.0), req([2], top_k=1)], 32)
    assert greedy.all_greedy and not greedy.need_min_p


# ------------------------------------------------------------------ greedy


def test_greedy_rows_equal_argmax_in_mixed_batch() -> None:
    torch.manual_seed(0)
    vocab = 50
    reqs = [req([1], temperature=0.0), req([1], temperature=1.3), req([1], top_k=1),
            req([1], temperature=0.0, top_p=0.5)]
    info = info_for(reqs, vocab)
    assert not info.all_greedy
    for trial in range(20):
        logits = torch.randn(4, vocab) * 3
        out = sample(logits, info, gen(trial))
        assert out.dtype == torch.int64 and out.shape == (4,)
        am = logits.argmax(-1)
        assert out[0] == am[0] and out[2] == am[2] and out[3] == am[3]


def test_all_greedy_batch_is_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, 40)
    info = info_for([req([1], temperature=0.0) for _ in range(6)], 40)
    assert info.all_greedy
    assert torch.equal(sample(logits, info, gen(0)), logits.argmax(-1))


def test_top_k_one_is_argmax_in_the_sampling_path() -> None:
    torch.manual_seed(2)
    logits = torch.randn(300, 20)
    info = manual_info(300, 20, temperature=1.0, top_k=1)
    assert torch.equal(sample(logits, info, gen(5)), logits.argmax(-1))


# ------------------------------------------------------------------ penalties


def reference_penalties(logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    out = logits.clone().double()
    for i, r in enumerate(reqs):
        p = r.sampling_params
        seen = set(r.origin_input_ids) | set(r.output_ids)
        for t in range(out.shape[1]):
            x = out[i, t].item()
            if t in seen:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            c = r.output_ids.count(t)
            x -= p.frequency_penalty * c
            x -= p.presence_penalty * (1 if c > 0 else 0)
            out[i, t] = x
    return out


def test_penalties_match_per_row_reference() -> None:
    torch.manual_seed(3)
    vocab = 24
    reqs = [
        req([1, 2, 3, 3], [4, 4, 4, 5], repetition_penalty=1.3),
        req([1, 7], [7, 8, 8], frequency_penalty=0.6),
        req([9], [2, 2, 10], presence_penalty=1.1),
        req([11, 12], [12, 13, 13, 13, 0], repetition_penalty=0.8, frequency_penalty=-0.5,
            presence_penalty=0.25),
        req([1, 2, 3], [4, 5]),  # no penalties: unchanged
        req([5, 6, 4], [], repetition_penalty=1.7),  # repetition over the prompt only
    ]
    info = info_for(reqs, vocab)
    assert info.output_counts is not None and info.seen_mask is not None
    logits = torch.randn(len(reqs), vocab) * 2
    logits[:, 3] = 1.5  # a positive seen logit
    logits[:, 4] = -1.5  # a negative seen logit
    got = apply_penalties(logits, info)
    want = reference_penalties(logits, reqs)
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[4], logits[4])
    # the reference changes something in every penalized row (the test is not vacuous)
    for i in (0, 1, 2, 3, 5):
        assert not torch.allclose(want[i].float(), logits[i])


def test_repetition_penalty_changes_greedy_choice() -> None:
    vocab = 8
    logits = torch.tensor([[0.0, 0.0, 3.0, 2.0, 0.0, 0.0, 0.0, -5.0]])
    r = req([2], [], temperature=0.0, repetition_penalty=2.0)  # 3.0 -> 1.5 < 2.0
    assert sample(logits, info_for([r], vocab)).item() == 3
    r = req([5], [3], temperature=0.0, frequency_penalty=1.5)  # 2.0 - 1.5 = 0.5
    assert sample(logits, info_for([r], vocab)).item() == 2
    r = req([5], [2, 2], temperature=0.0, frequency_penalty=0.6)  # 3.0 - 1.2 = 1.8 < 2.0
    assert sample(logits, info_for([r], vocab)).item() == 3
    r = req([5], [2, 2, 2], temperature=0.0, presence_penalty=0.9)  # 3.0 - 0.9 = 2.1 > 2.0
    assert sample(logits, info_for([r], vocab)).item() == 2


# ------------------------------------------------------------------ top-p / top-k / min-p


def allowed_top_p(probs: torch.Tensor, top_p: float) -> set[int]:
    """Smallest set of most likely tokens whose mass reaches top_p."""
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += probs[t].item()
        if mass >= top_p:
            break
    return set(kept)


def _draw(logits: torch.Tensor, info_one: dict, draws: int, seed: int) -> torch.Tensor:
    bs = logits.shape[0]
    rep = logits.repeat_interleave(draws, dim=0)
    info = manual_info(bs * draws, logits.shape[1], **info_one)
    return sample(rep, info, gen(seed)).view(bs, draws)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.85, 0.95])
def test_top_p_samples_only_the_nucleus(top_p: float) -> None:
    g = gen(int(top_p * 100))
    vocab, bs, draws = 16, 6, 600
    logits = torch.randn(bs, vocab, generator=g) * 1.5
    probs = torch.softmax(logits.double(), -1)
    # keep away from ties between cumulative mass and top_p (float32 vs float64)
    csum = probs.sort(-1, descending=True).values.cumsum(-1)
    assert ((csum - top_p).abs() > 1e-4).all()
    out = _draw(logits, {"top_p": top_p}, draws, seed=7)
    for i in range(bs):
        allowed = allowed_top_p(probs[i], top_p)
        got = set(out[i].tolist())
        assert got <= allowed, (i, sorted(got - allowed))
        # not over-restrictive: tokens with >= 3% of the kept mass all show up
        kept_mass = sum(probs[i, t].item() for t in allowed)
        frequent = {t for t in allowed if probs[i, t].item() / kept_mass >= 0.03}
        assert frequent <= got


@pytest.mark.parametrize("k", [2, 5])
def test_top_k_samples_only_the_k_most_likely(k: int) -> None:
    g = gen(100 + k)
    vocab, bs, draws = 12, 4, 400
    logits = torch.randn(bs, vocab, generator=g) * 0.5  # flat: many tokens would be drawn
    out = _draw(logits, {"top_k": k}, draws, seed=3)
    for i in range(bs):
        topk = set(logits[i].topk(k).indices.tolist())
        assert set(out[i].tolist()) == topk


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.7])
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float) -> None:
    g = gen(int(min_p * 1000))
    vocab, bs, draws = 16, 5, 600
    temperature = 0.8
    logits = torch.randn(bs, vocab, generator=g) * 1.5
    probs = torch.softmax(logits.double() / temperature, -1)
    ratio = probs / probs.max(-1, keepdim=True).values
    assert ((ratio - min_p).abs() > 1e-4).all()
    out = _draw(logits, {"min_p": min_p, "temperature": temperature}, draws, seed=11)
    for i in range(bs):
        allowed = {t for t in range(vocab) if ratio[i, t] >= min_p}
        got = set(out[i].tolist())
        assert got <= allowed
        kept_mass = sum(probs[i, t].item() for t in allowed)
        assert {t for t in allowed if probs[i, t].item() / kept_mass >= 0.03} <= got


# ------------------------------------------------------------------ distribution


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs * n
    return float(((counts.double() - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampled_frequencies_match_softmax(temperature: float) -> None:
    logits = torch.tensor([[1.0, 0.2, -0.5, 0.8, -1.5]])
    n = 20000
    out = _draw(logits, {"temperature": temperature}, n, seed=2024)[0]
    counts = torch.bincount(out, minlength=5)
    probs = torch.softmax(logits[0].double() / temperature, -1)
    freq = counts.double() / n
    assert (freq - probs).abs().max() < 0.012, (freq, probs)
    # 4 degrees of freedom: the 99.9% quantile is 18.5
    assert chi_square(counts, probs) < 18.5


def test_seeded_rows_have_the_right_distribution_too() -> None:
    logits = torch.tensor([[0.5, -0.3, 1.2, 0.0, -1.0]])
    n = 8000
    rep = logits.repeat(n, 1)
    # one seed, consecutive positions: the stream of one request
    info = manual_info(n, 5, seeds=[77] * n, positions=list(range(n)))
    out = sample(rep, info, gen(0))
    counts = torch.bincount(out, minlength=5)
    probs = torch.softmax(logits[0].double(), -1)
    assert chi_square(counts, probs) < 18.5


# ------------------------------------------------------------------ seeds


def test_seeded_rows_do_not_depend_on_the_rest_of_the_batch() -> None:
    vocab = 1000
    target = torch.randn(1, vocab, generator=gen(1)) * 0.05  # near uniform: 1000 outcomes
    for seed, position in [(42, 0), (42, 3), (7, 3), (123456789, 17)]:
        alone = sample(target, manual_info(1, vocab, seeds=[seed], positions=[position]), gen(0))
        others = torch.randn(4, vocab, generator=gen(seed))
        batch = torch.cat([others[:2], target, others[2:]])
        info = manual_info(5, vocab, seeds=[None, 5, seed, None, 9],
                           positions=[0, 1, position, 4, 2])
        mixed = sample(batch, info, gen(999))
        assert mixed[2].item() == alone.item()
        # and also with top-p in effect for the whole batch
        info_p = dataclasses.replace(info, top_ps=torch.full((5,), 0.999), need_top_p_k=True)
        alone_p = sample(
            target,
            dataclasses.replace(manual_info(1, vocab, seeds=[seed], positions=[position]),
                                top_ps=torch.full((1,), 0.999), need_top_p_k=True),
            gen(3),
        )
        assert sample(batch, info_p, gen(4))[2].item() == alone_p.item()


def test_seeded_rows_differ_across_positions_and_seeds() -> None:
    vocab = 1000
    logits = torch.zeros(1, vocab) + torch.randn(1, vocab, generator=gen(2)) * 0.01
    n = 40
    rows = logits.repeat(n, 1)
    by_pos = sample(rows, manual_info(n, vocab, seeds=[5] * n, positions=list(range(n))), gen(0))
    assert len(set(by_pos.tolist())) >= n - 3  # not one repeated token
    by_seed = sample(rows, manual_info(n, vocab, seeds=list(range(n)), positions=[3] * n), gen(0))
    assert len(set(by_seed.tolist())) >= n - 3
    # repeatable
    again = sample(rows, manual_info(n, vocab, seeds=[5] * n, positions=list(range(n))), gen(1))
    assert torch.equal(by_pos, again)


def test_unseeded_rows_follow_the_generator() -> None:
    vocab = 1000
    logits = torch.randn(8, vocab, generator=gen(3)) * 0.01
    info = manual_info(8, vocab)
    a = sample(logits, info, gen(10))
    b = sample(logits, info, gen(10))
    c = sample(logits, info, gen(11))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


# ------------------------------------------------------------------ min_new_tokens


def test_min_new_tokens_forbids_stop_ids_until_reached() -> None:
    vocab = 16
    reqs = [
        req([1], [3], temperature=0.0, min_new_tokens=3),  # 1 < 3: forbidden
        req([1], [3, 4, 5], temperature=0.0, min_new_tokens=3),  # reached
        req([1], [], temperature=0.0, min_new_tokens=2),  # no stop ids: nothing to forbid
        req([1], [], temperature=0.0, min_new_tokens=1),  # stop id beyond the vocab ignored
    ]
    stop_ids = [{5, 9}, {5, 9}, set(), {5, 40}]
    info = info_for(reqs, vocab, stop_ids)
    assert info.forbidden is not None and info.forbidden.shape == (4, vocab)
    assert info.forbidden.dtype == torch.bool
    assert info.forbidden[0].nonzero().flatten().tolist() == [5, 9]
    assert not info.forbidden[1].any() and not info.forbidden[2].any()
    assert info.forbidden[3].nonzero().flatten().tolist() == [5]
    logits = torch.zeros(4, vocab)
    logits[:, 5] = 10.0  # the stop token is the favourite
    logits[:, 9] = 9.0
    logits[:, 2] = 1.0
    out = sample(logits, info).tolist()
    assert out == [2, 5, 5, 9]
    # sampled rows never pick a forbidden token either
    samp = [req([1], [], temperature=1.0, min_new_tokens=4) for _ in range(200)]
    info = info_for(samp, vocab, [{5, 9}] * 200)
    drawn = sample(logits[:1].repeat(200, 1), info, gen(1))
    assert not ({5, 9} & set(drawn.tolist()))
    # once reached, nothing is forbidden
    done = info_for([req([1], [1, 2], min_new_tokens=2)], vocab, [{5}])
    assert done.forbidden is None


def test_static_rows_reused_only_for_the_same_requests_in_order() -> None:
    a = req([1], temperature=0.5, top_p=0.9, top_k=5)
    b = req([2], temperature=0.0, min_p=0.2, seed=7)
    c = req([3], temperature=1.0)
    info1, rows1 = build_sampling_info([a, b], 50, CPU, lambda r: set())
    a.output_ids.append(4)  # the per-step part changes, the parameters do not
    info2, rows2 = build_sampling_info([a, b], 50, CPU, lambda r: set(), rows1)
    assert rows2 is rows1 and info2.temperatures.data_ptr() == info1.temperatures.data_ptr()
    assert info2.positions == [1, 0] and info2.seeds == [None, 7]
    for batch in ([b, a], [a, b, c], [a]):  # another order, another request, one fewer
        info, rows = build_sampling_info(batch, 50, CPU, lambda r: set(), rows1)
        assert rows is not rows1
        fresh = build_sampling_info(batch, 50, CPU, lambda r: set())[0]
        for name in ("temperatures", "top_ps", "top_ks", "min_ps"):
            assert torch.equal(getattr(info, name), getattr(fresh, name)), name
        assert (info.all_greedy, info.need_top_p_k, info.need_min_p, info.seeds) == \
            (fresh.all_greedy, fresh.need_top_p_k, fresh.need_min_p, fresh.seeds)
