"""The capacity model on synthetic curves, and its loader on a real bench_serving file.

Pure Python and small workloads (a few thousand simulated requests), so the whole file runs in
seconds on a CPU.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import pytest

from benchmarks.capacity import (CurvePoint, DecodeStepModel, MixClass, ReplicaCurve, SimConfig,
                                 Target, Workload, curve_from_docs, load_curve, main, make_requests,
                                 predict, simulate)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEEP = os.path.join(REPO, "benchmarks/results/2026-12-01-h200/serving_smollm2-135m.json")
LONG_MIX = os.path.join(REPO, "benchmarks/results/2026-12-02-h200-long-fa/"
                              "srt_serving_long_llama3-8b_auto.json")

PREFILL = 20000.0


def synthetic(cache_tokens: int | None = None) -> ReplicaCurve:
    """A replica whose decode step grows from 10 ms (batch 2.5) to 20 ms (batch 80)."""
    doc: dict[str, Any] = {"prefill_tok_per_s": PREFILL, "cache_tokens": cache_tokens, "points": [
        {"rate": 1, "ttft_p50_ms": 30, "ttft_p99_ms": 60, "itl_p50_ms": 10, "itl_p99_ms": 20,
         "out_tok_per_s": 250},
        {"rate": 4, "ttft_p50_ms": 40, "ttft_p99_ms": 120, "itl_p50_ms": 12, "itl_p99_ms": 40,
         "out_tok_per_s": 1000},
        {"rate": 16, "ttft_p50_ms": 80, "ttft_p99_ms": 400, "itl_p50_ms": 20, "itl_p99_ms": 90,
         "out_tok_per_s": 4000}]}
    return curve_from_docs([("synthetic", doc)])


MIX = (MixClass(1.0, 1024, 128), MixClass(0.2, 4096, 64))
LOOSE = Target(ttft_p99_ms=1000.0, itl_p99_ms=150.0)


def workload(rate: float, share: float = 0.5, tenants: int = 8, n: int = 2000) -> Workload:
    return Workload(rate, MIX, share, tenants, num_requests=n, seed=1)


def test_decode_model_interpolates_and_grows_past_the_largest_batch() -> None:
    m = DecodeStepModel(synthetic().points)
    assert m.streams == [2.5, 12.0, 80.0]  # out tok/s x mean gap (the ITL p50 here)
    assert m.step_ms(1) == 10.0
    assert m.step_ms(46) == pytest.approx(12 + (46 - 12) / (80 - 12) * 8)
    assert m.step_ms(160) == pytest.approx(40.0)  # throughput stays at 80 / 20 ms
    steps = [m.step_ms(n) for n in range(1, 200)]
    assert steps == sorted(steps)


def test_decode_model_never_steps_faster_with_a_bigger_batch() -> None:
    noisy = [CurvePoint(1, 100, 1, 1, 1, 1, step_ms=12.0, streams=4.0),
             CurvePoint(2, 200, 1, 1, 1, 1, step_ms=9.0, streams=8.0)]
    assert DecodeStepModel(noisy).step_ms(8) == 12.0


def test_one_request_costs_its_prefill_then_one_step_per_token() -> None:
    curve = synthetic()
    w = Workload(0.001, (MixClass(1.0, 2000, 5),), num_requests=1)
    r = simulate(curve, w, "round_robin", 1)
    assert r.ttft_p50_ms == pytest.approx(2000 / PREFILL * 1e3)
    assert r.itl_p50_ms == pytest.approx(10.0) and r.itl_p99_ms == pytest.approx(10.0)


def test_a_cached_tenant_prefix_saves_its_prefill() -> None:
    w = Workload(0.001, (MixClass(1.0, 2000, 2),), prefix_share=0.75, tenants=1, num_requests=2)
    reqs = make_requests(w)
    r = simulate(synthetic(), w, "round_robin", 1, requests=reqs)
    # far apart: the first pays 2000 tokens, the second only the 500 after the cached prefix
    assert r.ttft_p50_ms == pytest.approx(500 / PREFILL * 1e3)
    assert r.ttft_p99_ms == pytest.approx(2000 / PREFILL * 1e3)
    assert r.hit_rate == 0.5


def test_more_request_rate_never_needs_fewer_replicas() -> None:
    curve = synthetic(cache_tokens=8000)
    for policy in ("round_robin", "cache_aware"):
        needed = [predict(curve, workload(rate), LOOSE, policy, 24).replicas
                  for rate in (2, 8, 16, 32, 48)]
        assert None not in needed, (policy, needed)
        assert needed == sorted(needed), (policy, needed)
        assert needed[-1] > needed[0], (policy, needed)  # the sweep really spans several counts


def test_cache_aware_needs_no_more_replicas_with_shared_prefixes_and_hits_more() -> None:
    # 8 tenants x (512 + 2048) prefix tokens do not fit one replica's 8000-token cache
    curve = synthetic(cache_tokens=8000)
    w = workload(32.0)
    rr = predict(curve, w, LOOSE, "round_robin", 24)
    ca = predict(curve, w, LOOSE, "cache_aware", 24)
    assert rr.replicas is not None and ca.replicas is not None
    assert ca.replicas <= rr.replicas
    for k in range(ca.first_tried, rr.replicas + 1):
        hit_rr = simulate(curve, w, "round_robin", k).hit_rate
        hit_ca = simulate(curve, w, "cache_aware", k).hit_rate
        assert hit_ca > hit_rr + 0.1, (k, hit_ca, hit_rr)


def test_without_a_shared_prefix_both_policies_need_the_same() -> None:
    curve = synthetic(cache_tokens=8000)
    for rate in (8.0, 32.0):
        w = workload(rate, share=0.0)
        rr = predict(curve, w, LOOSE, "round_robin", 24)
        ca = predict(curve, w, LOOSE, "cache_aware", 24)
        assert rr.replicas is not None and rr.replicas == ca.replicas
        assert all(r.hit_rate == 0.0 for r in rr.tried + ca.tried)


def test_a_target_one_replica_meets_at_low_rate_gives_one() -> None:
    for policy in ("round_robin", "cache_aware"):
        pred = predict(synthetic(), workload(0.5), LOOSE, policy, 8)
        assert pred.replicas == 1
        assert pred.tried[0].ttft_p99_ms <= LOOSE.ttft_p99_ms


def test_a_target_below_the_unloaded_latency_is_not_reachable() -> None:
    curve = synthetic()
    # with half of each prompt cached the 4096-token prompts still prefill 2048 tokens: 102 ms
    too_fast_ttft = Target(ttft_p99_ms=50.0, itl_p99_ms=150.0)
    too_fast_itl = Target(ttft_p99_ms=1000.0, itl_p99_ms=5.0)  # one step alone takes 10 ms
    for target in (too_fast_ttft, too_fast_itl):
        pred = predict(curve, workload(0.5), target, "cache_aware", 8)
        assert pred.replicas is None
        assert "not reachable within --max-replicas 8" in pred.reason


def test_too_few_replicas_allowed_is_not_reachable(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Any) -> None:
    path = tmp_path / "curve.json"
    path.write_text(json.dumps({"prefill_tok_per_s": PREFILL, "points": [
        {"rate": 1, "ttft_p50_ms": 30, "ttft_p99_ms": 60, "itl_p50_ms": 10, "itl_p99_ms": 20,
         "out_tok_per_s": 250}]}))
    out = tmp_path / "cap.json"
    rc = main(["--curves", str(path), "--rate", "40", "--mix", "1:1024:128",
               "--ttft-p99-ms", "1000", "--itl-p99-ms", "150", "--max-replicas", "2",
               "--num-requests", "500", "--out", str(out)])
    assert rc == 1
    assert "not reachable within --max-replicas 2" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert [p["replicas"] for p in saved["predictions"]] == [None, None]


def test_loader_reads_a_bench_serving_rate_sweep() -> None:
    with open(SWEEP) as f:
        runs = json.load(f)["runs"]
    assert len(runs) >= 2 and any(math.isinf(r["request_rate"]) for r in runs)
    curve = load_curve([SWEEP])
    by_rate = {(r["request_rate"] if math.isfinite(r["request_rate"]) else r["req_per_s"]): r
               for r in runs}
    assert [p.rate for p in curve.points] == sorted(by_rate)
    for p in curve.points:
        run = by_rate[p.rate]
        assert (p.ttft_p50_ms, p.ttft_p99_ms) == (run["ttft_ms_p50"], run["ttft_ms_p99"])
        assert (p.itl_p50_ms, p.itl_p99_ms) == (run["itl_ms_p50"], run["itl_ms_p99"])
        assert p.out_tok_per_s == run["out_tok_per_s"]
        assert p.step_ms == run["tpot_ms_p50"]  # the chunk gaps' p50 is near zero there
    best = max(r["input_tokens"] / r["completed"] / (r["ttft_ms_p50"] / 1e3) for r in runs)
    assert curve.prefill_tok_per_s == pytest.approx(best)
    assert curve.cache_tokens == 5687178


def test_loader_reads_the_long_mix_file_and_takes_the_long_prompts_prefill() -> None:
    with open(LONG_MIX) as f:
        doc = json.load(f)
    curve = load_curve([LONG_MIX])
    assert len(curve.points) == len(doc["runs"])
    run = doc["runs"][0]
    assert curve.points[0].step_ms == run["itl_ms_p50"]  # no TPOT in that file
    assert curve.prefill_tok_per_s == pytest.approx(
        doc["long_input_len"] / (run["long_ttft_ms_p50"] / 1e3))
    assert load_curve([LONG_MIX], prefill_tok_per_s=1234.0).prefill_tok_per_s == 1234.0


def test_loader_rejects_an_unknown_shape() -> None:
    with pytest.raises(ValueError, match="neither"):
        curve_from_docs([("x.json", {"rows": []})])
    with pytest.raises(ValueError, match="prefill"):
        curve_from_docs([("c.json", {"points": [
            {"rate": 1, "ttft_p50_ms": 1, "ttft_p99_ms": 1, "itl_p50_ms": 1, "itl_p99_ms": 1,
             "out_tok_per_s": 10}]})])


def test_simulation_is_deterministic_for_a_seed() -> None:
    w = workload(16.0, n=1000)
    a = simulate(synthetic(8000), w, "cache_aware", 3, SimConfig())
    b = simulate(synthetic(8000), w, "cache_aware", 3, SimConfig())
    assert a == b


def test_prefill_overhead_is_paid_once_per_prefill_batch() -> None:
    """A lone request's TTFT is the fixed prefill cost plus its tokens at the prefill speed;
    the floor and a plain curve file's `prefill_overhead_ms` carry it too."""
    from dataclasses import replace

    from benchmarks.capacity import unloaded_floor

    base = synthetic()
    slow = replace(base, prefill_overhead_ms=50.0)
    one = Workload(0.01, (MixClass(1.0, 2000, 2),), num_requests=3, seed=0)  # far apart
    a, b = simulate(base, one, "round_robin", 1), simulate(slow, one, "round_robin", 1)
    assert a.ttft_mean_ms == pytest.approx(2000 / PREFILL * 1e3)
    assert b.ttft_mean_ms == pytest.approx(a.ttft_mean_ms + 50.0)
    assert unloaded_floor(slow, one)[0] == pytest.approx(unloaded_floor(base, one)[0] + 50.0)
    doc = {"prefill_tok_per_s": PREFILL, "prefill_overhead_ms": 7.5, "points": [
        {"rate": 1, "ttft_p50_ms": 30, "ttft_p99_ms": 60, "itl_p50_ms": 10, "itl_p99_ms": 20,
         "out_tok_per_s": 250}]}
    assert curve_from_docs([("x", doc)]).prefill_overhead_ms == 7.5
    assert curve_from_docs([("x", doc)], prefill_overhead_ms=1.0).prefill_overhead_ms == 1.0
    with pytest.raises(ValueError):
        curve_from_docs([("x", doc)], prefill_overhead_ms=-1.0)
