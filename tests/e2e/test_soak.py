"""Two minutes of mixed load (scripts/soak.py) on the default model: no 5xx, no lost request,
the KV invariant at the end, and no memory growth after the warm-up."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from tests.conftest import REPO

DURATION_S = 120


def test_soak_two_minutes(server: Any, tmp_path: Any) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "scripts/soak.py", "--base-url", server.url, "--server-pid",
         str(server.proc.pid), "--duration", str(DURATION_S), "--concurrency", "4",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=DURATION_S + 300)
    assert out.exists(), proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    summary = proc.stdout[-4000:]
    assert report["server_errors"] == 0, (report["problems"], summary)
    assert report["lost"] == 0, (report["problems"], summary)
    assert report["unexpected"] == 0, (report["problems"], summary)
    # every kind of the mix ran, and was answered as it should be at least once
    kinds = report["by_kind"]
    for kind in ("short", "long", "stream", "disconnect", "abort", "bad", "regex",
                 "json_schema", "chat", "batch"):
        assert kind in kinds, (kind, kinds)
    assert kinds["bad"].get("expected_error", 0) == sum(kinds["bad"].values())
    assert kinds["disconnect"].get("disconnected", 0) >= 1
    assert report["aborts_landed"] >= 1, kinds["abort"]
    assert report["kv"]["ok"], report["kv"]
    rss = report["rss"]
    assert len(rss["samples"]) >= 10, rss
    assert rss["growth"] < 0.10, {k: v for k, v in rss.items() if k != "samples"}
    assert report["passed"] and proc.returncode == 0, summary
