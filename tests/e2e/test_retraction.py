"""A KV pool too small for the load: requests are retracted and re-run, never dropped, and the
greedy outputs equal those of a large pool."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

from tests.conftest import BASE_ARGS, ServerProcess

PROMPTS = [f"Story number {i}: once upon a time there was a" + " very" * (i % 5) + " small fox"
           for i in range(16)]
BODY = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}


def _run_all(srv: ServerProcess) -> list[list[int]]:
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(
            lambda p: srv.generate({"text": p, "sampling_params": BODY}), PROMPTS))
    for r in results:
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    return [r["output_ids"] for r in results]


def test_small_pool_retracts_and_matches_large_pool(server: Any, smollm2_dir: str) -> None:
    reference = _run_all(server)
    small = ServerProcess([*BASE_ARGS, "--max-total-tokens", "600"]).start()
    try:
        outputs = _run_all(small)
        info = small.server_info()
        assert info["max_total_num_tokens"] == 600
        assert info["retracted_reqs"] > 0
        assert "retracted" in small.log()
        small.assert_kv_invariant()
    finally:
        small.stop()
    for i, (got, ref) in enumerate(zip(outputs, reference)):
        assert got == ref, f"request {i} differs after retraction"
