"""Short fills as decode rows (`--graph-fill-max-tokens`) on a model process stepped in this
process, float32 on the CPU (the rows run eagerly here; on a GPU the same plan replays a decode
graph): every output equals the server's without it, and the KV pool is whole afterwards.

Covered: one short prompt, several prompts in one fill, a prompt behind a cached prefix, a
prompt longer than the limit (an eager extend), prompt chunks of a long prompt (each a fill of
decode rows), a logprob request (the extend path) beside a plain one, and a sampled request with
a seed. Greedy outputs also equal transformers' through the plain server (the models tests).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from srt.layers.forward_batch import ForwardMode
from srt.managers.io_struct import LogprobOptions, TokenizedGenerateReq
from srt.model_process.batch import StepPlan
from srt.model_process.graph_fill import GraphFill, as_decode_rows
from srt.model_process.loop import ModelProcess
from tests.model_process import cpu_model_server, kv_is_free
from tests.overlap_cases import assert_same, serve

LIMIT = 48


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 5000) for _ in range(n)]


def _req(rid: str, ids: list[int], logprob: LogprobOptions | None = None,
         **params: Any) -> TokenizedGenerateReq:
    p = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True, **params}
    return TokenizedGenerateReq(rid, ids, p, logprob=logprob)


def _cases() -> list[list[TokenizedGenerateReq]]:
    """Rounds of requests, each round served to the end before the next."""
    shared = _ids(30, 1)
    return [
        [_req("short", _ids(12, 2))],
        [_req("a", _ids(9, 3)), _req("b", _ids(17, 4)), _req("c", _ids(5, 5))],
        [_req("prefix-1", shared + _ids(6, 6))],
        [_req("prefix-2", shared + _ids(8, 7))],  # 30 cached, 8 new
        [_req("long", _ids(LIMIT + 20, 8))],
        [_req("lp", _ids(10, 9), max_new_tokens=3,
              logprob=LogprobOptions(logprob_start_len=0, top_logprobs_num=2)),
         _req("plain", _ids(11, 10))],
        [_req("seeded", _ids(14, 11), temperature=0.8, top_p=0.9, seed=7)],
    ]


def _run(server: ModelProcess) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for reqs in _cases():
        out.update(serve(server, reqs))
        assert kv_is_free(server)
    return out


@pytest.fixture(scope="module")
def plain_outputs(smollm2_dir: str) -> dict[str, Any]:
    return _run(cpu_model_server(smollm2_dir))


def test_fills_as_decode_rows_equal_extends(smollm2_dir: str,
                                            plain_outputs: dict[str, Any]) -> None:
    server = cpu_model_server(smollm2_dir, graph_fill_max_tokens=LIMIT)
    got = _run(server)
    assert_same(got, plain_outputs)
    # every round but the long prompt's and the logprob round filled as decode rows
    assert server.stats()["graph_fill_steps"] == 5
    assert server.stats()["graph_fill_max_tokens"] == LIMIT


def test_prompt_chunks_as_decode_rows(smollm2_dir: str,
                                      plain_outputs: dict[str, Any]) -> None:
    server = cpu_model_server(smollm2_dir, graph_fill_max_tokens=LIMIT, chunked_prefill_size=24)
    got = serve(server, [_req("long", _ids(LIMIT + 20, 8))])
    assert kv_is_free(server)
    assert got["long"][:3] == plain_outputs["long"][:3]
    assert server.stats()["graph_fill_steps"] == 3  # chunks of 24, 24, 20 tokens


def test_decode_rows_plan() -> None:
    """Each request's tokens become rows at their positions of its row, sampled from its last;
    where the fill ends is the extend's."""
    plan = StepPlan(ForwardMode.EXTEND, ["r0", "r1"], np.array([3, 4, 5, 0, 1]),  # type: ignore
                    np.array([7, 2]), np.array([6, 2]), [3, 0], [3, 2],
                    _slots(5), input_ids=[11, 12, 13, 14, 15])
    rows = as_decode_rows(plan)
    assert rows.mode == ForwardMode.DECODE and rows.fill
    assert rows.rows.tolist() == [7, 7, 7, 2, 2]
    assert rows.seq_lens.tolist() == [4, 5, 6, 1, 2]
    assert rows.sample_rows == [2, 4]
    assert [rows.fill_end(i) for i in range(2)] == [plan.fill_end(i) for i in range(2)] == [6, 2]


def test_limits() -> None:
    plan = StepPlan(ForwardMode.PREFILL, [], np.arange(40), np.array([1]), np.array([40]),
                    [0], [40], _slots(40), input_ids=list(range(40)))
    counters = type("C", (), {"graph_fills": 0})()
    assert GraphFill(40, None, False, False).plan(plan, counters).fill
    assert not GraphFill(39, None, False, False).plan(plan, counters).fill
    assert not GraphFill(64, 32, False, False).plan(plan, counters).fill  # graphs of 32 rows
    assert not GraphFill(64, None, True, False).plan(plan, counters).fill  # a draft model
    assert not GraphFill(0, None, False, False).plan(plan, counters).fill
    assert counters.graph_fills == 1


def _slots(n: int) -> Any:
    import torch

    return torch.arange(100, 100 + n, dtype=torch.int64)
