"""Jump-forward inside the decode batch: a running request whose pattern forces text keeps its
row, and the batch's next step computes its new ids (a DECODE step with one row per new id)
together with one token of every other request. Compared with jumps through the waiting queue (each a fill round of its own):
the same greedy ids and finish reasons, fewer fill rounds, and the KV all given back."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

import srt.model_process.constraints as constraints
import srt.model_process.loop as loop_module
from srt.managers.io_struct import LogprobOptions, TokenizedGenerateReq
from srt.model_process.loop import ModelProcess
from tests.e2e.test_jump_forward import LONG_KEYS
from tests.model_process import cpu_model_server, kv_is_free, serve_all

REGEXES = [r"The answer is (yes|no)\. The colour is (red|green|blue)\.",
           r"Date: (19|20)[0-9]{2}-[01][0-9]-[0-3][0-9], place: [A-Z][a-z]{2,8}"]


def _requests(tok: Any) -> list[TokenizedGenerateReq]:
    def ids(text: str) -> list[int]:
        return tok.encode(text)

    greedy = {"temperature": 0, "max_new_tokens": 48}
    reqs = [
        TokenizedGenerateReq("schema", ids("Describe a person as JSON:"),
                             {**greedy, "max_new_tokens": 96,
                              "json_schema": json.dumps(LONG_KEYS)}),
        TokenizedGenerateReq("regex0", ids("Answer:"), {**greedy, "regex": REGEXES[0]},
                             stream=True),
        TokenizedGenerateReq("regex1", ids("When and where?"), {**greedy, "regex": REGEXES[1]}),
        # unconstrained neighbours of different lengths, one with output logprobs
        TokenizedGenerateReq("free0", ids("The capital of France is"),
                             {**greedy, "max_new_tokens": 24, "ignore_eos": True}),
        TokenizedGenerateReq("free1", ids("def fibonacci(n):"),
                             {**greedy, "max_new_tokens": 7, "ignore_eos": True}, stream=True),
        TokenizedGenerateReq("logprobs", ids("Once upon a time"),
                             {**greedy, "max_new_tokens": 20, "ignore_eos": True},
                             logprob=LogprobOptions(logprob_start_len=-1, top_logprobs_num=2)),
    ]
    return reqs


def _serve(server: ModelProcess, reqs: list[TokenizedGenerateReq],
           after_step: Any = None) -> dict[str, Any]:
    """rid -> (ids, finish reason, forward passes, completion tokens, output logprobs) once all
    are done."""
    res = {}
    for rid, outs in serve_all(server, reqs, after_step=after_step).items():
        lps = [x for t in outs if t.output_logprobs is not None
               for x in t.output_logprobs.logprobs]
        res[rid] = ([i for t in outs for i in t.new_ids], outs[-1].finish_reason["type"],
                    outs[-1].forward_passes, outs[-1].completion_tokens, lps)
    return res


def _retract_one_jumped(server: ModelProcess, done: list[str]) -> None:
    """Once, retract a running request right after it jumped inside the batch (its KV ends
    before its ids, at kv_valid), as a full pool would: its valid KV goes to the tree and its
    next fill computes the rest. The outputs must not change."""
    for r in server.running:
        if not done and r.kv_valid is not None:
            server.retract(r)
            done.append(r.rid)
            return


@pytest.fixture(scope="module")
def results(smollm2_dir: str, smollm2_tokenizer: Any) -> dict[str, Any]:
    mp = pytest.MonkeyPatch()
    out = {}
    try:
        for name, in_batch in (("batch", True), ("queue", False)):
            mp.setattr(constraints, "JUMP_IN_BATCH", in_batch)
            # The plain loop: the hook retracts between rounds, which needs no step in flight.
            # One decode step per round, so the hook sees every in-batch jump before the step
            # that computes its new ids (with several, a jump inside a round is extended within
            # it and the hook may never see one).
            mp.setattr(loop_module, "DECODE_STEPS_PER_ROUND", 1)
            server = cpu_model_server(smollm2_dir, disable_overlap_schedule=True)
            retracted: list[str] = []
            res = _serve(server, _requests(smollm2_tokenizer),
                         after_step=lambda s: _retract_one_jumped(s, retracted))
            out[name] = (res, server.stats(), kv_is_free(server), retracted)
    finally:
        mp.undo()
    return out


def test_same_ids_as_jumps_through_the_queue(results: dict[str, Any]) -> None:
    batch, queue = results["batch"][0], results["queue"][0]
    for rid in batch:
        assert batch[rid][:2] == queue[rid][:2], rid
        # the same tokens took the same number of forwards for the request itself
        assert batch[rid][2] == queue[rid][2], rid
        assert batch[rid][4] == pytest.approx(queue[rid][4], abs=1e-4), rid


def test_outputs_valid_and_jumps_taken(results: dict[str, Any], smollm2_tokenizer: Any) -> None:
    res, stats, free, retracted = results["batch"]
    assert len(retracted) == 1 and retracted[0] in ("schema", "regex0", "regex1"), retracted
    text = {rid: smollm2_tokenizer.decode(v[0]) for rid, v in res.items()}
    jsonschema.validate(json.loads(text["schema"]), LONG_KEYS)
    assert re.fullmatch(REGEXES[0], text["regex0"]), text["regex0"]
    assert re.fullmatch(REGEXES[1], text["regex1"]), text["regex1"]
    assert stats["jump_forwards"] >= 6
    assert stats["jump_forward_batch_steps"] >= 1
    assert free
    for rid in ("schema", "regex0", "regex1"):  # forced tokens took no forward of their own
        assert res[rid][2] + 4 < res[rid][3], (rid, res[rid][2:4])
    for rid in ("free0", "free1", "logprobs"):
        assert res[rid][2] == res[rid][3], rid
    assert len(res["logprobs"][4]) == 20


def test_fewer_fill_rounds_than_through_the_queue(results: dict[str, Any]) -> None:
    """Through the queue, every jump after a request's first fill admits it again; inside the
    batch only the retracted request is admitted twice. (Counted in admissions, not rounds:
    when the FSM compiles finish decides how admissions group into rounds.)"""
    batch, queue = results["batch"][1], results["queue"][1]
    assert batch["decode_step_times"]["fills"]["requests"] == len(results["batch"][0]) + 1
    assert queue["decode_step_times"]["fills"]["requests"] > len(results["queue"][0]) + 1
    assert queue["jump_forward_batch_steps"] == 0
    assert batch["jump_forwards"] == queue["jump_forwards"]
    assert results["queue"][2]


def test_min_tokens_skips_small_jumps(results: dict[str, Any], smollm2_dir: str,
                                      smollm2_tokenizer: Any) -> None:
    """--jump-forward-min-tokens 3: a running request jumps only for at least 3 new ids (each
    in-batch jump adds rows to the batch's next step); outputs stay valid and the KV is given
    back."""
    server = cpu_model_server(smollm2_dir, jump_forward_min_tokens=3)
    assert server.constraints.jump_min_tokens == 3
    gains: list[int] = []
    real = server.constraints.jump_forward

    def recording(req: Any) -> bool:
        before, in_batch = len(req.output_ids), req.req_pool_idx is not None
        queued = real(req)
        if in_batch and len(req.output_ids) != before:
            gains.append(len(req.output_ids) - before)
        return queued

    server.constraints.jump_forward = recording  # observe what each jump added
    res = _serve(server, _requests(smollm2_tokenizer))
    text = {rid: smollm2_tokenizer.decode(v[0]) for rid, v in res.items()}
    jsonschema.validate(json.loads(text["schema"]), LONG_KEYS)
    assert re.fullmatch(REGEXES[0], text["regex0"]), text["regex0"]
    assert re.fullmatch(REGEXES[1], text["regex1"]), text["regex1"]
    assert gains and min(gains) >= 3, gains
    assert server.stats()["jump_forwards"] < results["batch"][1]["jump_forwards"]
    assert kv_is_free(server)
    assert cpu_model_server(smollm2_dir).constraints.jump_min_tokens == 1  # the default: every jump
