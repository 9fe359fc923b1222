"""srt/cpu_threads.py: the thread count per CPU rank and the spin setting for model processes."""

from __future__ import annotations

from typing import Any

from srt import cpu_threads


def test_threads_share_the_cores_among_local_ranks(monkeypatch: Any) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 8)
    assert [cpu_threads.threads_per_rank(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads.threads_per_rank(2) is None  # the user's setting stands


def test_spin_count_only_where_the_user_set_none(monkeypatch: Any) -> None:
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert cpu_threads.child_env() == {"GOMP_SPINCOUNT": "1000"}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cpu_threads.child_env() == {}
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")
    assert cpu_threads.child_env() == {}


def test_spawned_children_see_the_extra_environment_only() -> None:
    import multiprocessing as mp
    import os

    from srt.launcher import _environment

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with _environment({"SRT_TEST_EXTRA": "1"}):
        p = ctx.Process(target=_report, args=(q,))
        p.start()
    p.join(60)
    assert q.get() == "1"
    assert "SRT_TEST_EXTRA" not in os.environ


def _report(q: Any) -> None:
    import os

    q.put(os.environ.get("SRT_TEST_EXTRA"))
