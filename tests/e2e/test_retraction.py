"""A KV pool too small for the load: requests are retracted and re-run, never dropped, and the
greedy outputs (and the logprobs of the requests that ask for them) equal those of a large pool."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import pytest

from tests.conftest import BASE_ARGS, ServerProcess

PROMPTS = [f"Story number {i}: once upon a time there was a" + " very" * (i % 5) + " small fox"
           for i in range(16)]
# 16 requests of ~15 + 64 tokens need ~1,250 KV slots; a 300-slot pool must retract often.
NEW_TOKENS = 64
POOL = 300
BODY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}


def _body(i: int) -> dict[str, Any]:
    body: dict[str, Any] = {"text": PROMPTS[i], "sampling_params": BODY}
    if i % 2 == 0:  # half of them ask for logprobs: prompt ones are computed at the first fill
        body.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    return body


def _run_all(srv: ServerProcess) -> list[dict[str, Any]]:
    with cf.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: srv.generate(_body(i)), range(len(PROMPTS))))
    for i, r in enumerate(results):
        meta = r["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        if i % 2 == 0:  # each prompt token once, each output token once
            assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
            assert len(meta["output_token_logprobs"]) == NEW_TOKENS
            assert [t[1] for t in meta["output_token_logprobs"]] == r["output_ids"]
        else:
            assert "output_token_logprobs" not in meta
    return results


def test_small_pool_retracts_and_matches_large_pool(server: Any, smollm2_dir: str) -> None:
    reference = _run_all(server)
    small = ServerProcess([*BASE_ARGS, "--max-total-tokens", str(POOL)]).start()
    try:
        outputs = _run_all(small)
        info = small.server_info()
        assert info["max_total_num_tokens"] == POOL
        assert info["retracted_reqs"] > 0
        assert "retracted" in small.log()
        small.assert_kv_invariant()
    finally:
        small.stop()
    for i, (got, ref) in enumerate(zip(outputs, reference)):
        assert got["output_ids"] == ref["output_ids"], f"request {i} differs after retraction"
        if i % 2 == 0:
            for key in ("input_token_logprobs", "output_token_logprobs"):
                g, r = got["meta_info"][key], ref["meta_info"][key]
                assert [t[1] for t in g] == [t[1] for t in r]
                assert [t[0] for t in g] == pytest.approx([t[0] for t in r], abs=1e-4), (i, key)
