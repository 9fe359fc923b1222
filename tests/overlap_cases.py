"""A mixed workload for comparing the overlapped loop with the plain one on a model process
stepped in this process (CPU and GPU tests): greedy requests that finish at every length from
the fill on, stop ids that fire mid-way, two samples of one prompt, logprob requests, seeded
sampling, and (given a byte-level tokenizer) a regex with jump-forward and a stop string."""

from __future__ import annotations

import random
from typing import Any

import pytest

from srt.managers.io_struct import LogprobOptions, TokenizedGenerateReq
from tests.model_process import serve_all

Outputs = dict[str, tuple[Any, ...]]


def mixed_requests(vocab: int, n: int, seed: int, stops: dict[str, int] | None = None,
                   tokenizer: Any = None, long: int = 0) -> list[TokenizedGenerateReq]:
    """n varied requests, two samples of one prompt, `long` requests of 48 tokens, and with a
    tokenizer a regex and a stop-string request."""
    rng = random.Random(seed)
    top = min(vocab, 5000)
    reqs = []
    for i in range(n):
        ids = [rng.randrange(300, top) for _ in range(rng.randrange(3, 40))]
        params: dict[str, Any] = {"temperature": 0, "ignore_eos": True,
                                  "max_new_tokens": [1, 2, 3, 5, 9, 17, 24][i % 7]}
        rid = f"r{i}"
        if stops and rid in stops:
            params["stop_token_ids"] = [stops[rid]]
        logprob = None
        if i % 4 == 1:
            logprob = LogprobOptions(logprob_start_len=[-1, 0][i % 2], top_logprobs_num=2)
        if i % 5 == 3:
            params.update(temperature=0.8, top_p=0.9, seed=100 + i)
        reqs.append(TokenizedGenerateReq(rid, ids, params, stream=i % 3 == 0, logprob=logprob))
    prompt = [rng.randrange(300, top) for _ in range(12)]
    for k in range(2):  # two samples of one prompt (n = 2)
        reqs.append(TokenizedGenerateReq(f"g-{k}", prompt, {"temperature": 0,
                                         "max_new_tokens": 10, "ignore_eos": True}, group="g"))
    for k in range(long):
        ids = [rng.randrange(300, top) for _ in range(6)]
        reqs.append(TokenizedGenerateReq(f"long-{k}", ids, {"temperature": 0,
                                         "max_new_tokens": 48, "ignore_eos": True}))
    if tokenizer is not None:
        enc = tokenizer.encode
        # Short, so that the batch chains once it is done: while a constrained request runs,
        # every step waits for the host (its FSM mask needs the previous token).
        reqs.append(TokenizedGenerateReq("regex", enc("Is the sky blue?"), {
            "temperature": 0, "max_new_tokens": 12, "regex": r"The answer is (yes|no)\."}))
        reqs.append(TokenizedGenerateReq("stopstr", enc("Count: one, two,"), {
            "temperature": 0, "max_new_tokens": 24, "stop": [" five"]}, stream=True))
    return reqs


def serve(server: Any, reqs: list[TokenizedGenerateReq]) -> Outputs:
    """rid -> (ids, finish reason, completion tokens, output logprobs, prompt logprobs, cached
    tokens)."""
    res = {}
    for rid, outs in serve_all(server, reqs).items():
        out_lp = [x for t in outs if t.output_logprobs is not None
                  for x in t.output_logprobs.logprobs]
        in_lp = [x for t in outs if t.input_logprobs is not None
                 for x in t.input_logprobs.logprobs]
        res[rid] = ([i for t in outs for i in t.new_ids], outs[-1].finish_reason,
                    outs[-1].completion_tokens, out_lp, in_lp, outs[-1].cached_tokens)
    return res


def late_stops(outputs: Outputs) -> dict[str, int]:
    """For each greedy request, a token its output first writes at index 2 or later: as a stop
    id it fires in a decode step."""
    stops = {}
    for rid, (ids, *_rest) in outputs.items():
        late = [t for j, t in enumerate(ids) if j >= 2 and t not in ids[:j]]
        if late and rid.startswith("r"):
            stops[rid] = late[0]
    return stops


def assert_same(got: Outputs, want: Outputs, tol: float = 1e-4) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        g, w = got[rid], want[rid]
        assert g[:3] == w[:3], (rid, g[:3], w[:3])
        assert g[3] == pytest.approx(w[3], abs=tol), rid
        assert [x if x is not None else 0.0 for x in g[4]] == pytest.approx(
            [x if x is not None else 0.0 for x in w[4]], abs=tol), rid
