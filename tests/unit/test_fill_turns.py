"""Running requests never wait for two fills in a row (a model process stepped in this process,
a small random Llama, float32 on the CPU).

While requests decode, a new request arrives every round and a long prompt is prefilled in
chunks: without mixed steps, every fill round with requests running is followed by a round
that decodes them (before, fills of new arrivals ran back to back, and a stream waited for all
of them: on one H100 with the Llama-3-8B shape, 165 ms behind chunks of 68 ms); with
`--enable-mixed-chunk` every fill round carries their token itself. Outputs equal those of
the same requests served without arrivals in between.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from srt.managers.io_struct import StepInput, TokenizedGenerateReq
from tests.model_process import cpu_model_server, kv_is_free, serve_all
from tests.random_models import save_random_llama

CHUNK = 16


def _req(rid: str, n: int, new: int, rng: random.Random) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid, [rng.randrange(5, 250) for _ in range(n)],
                                {"temperature": 0, "max_new_tokens": new, "ignore_eos": True})


@pytest.fixture(scope="module")
def model(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("fill-turns")), vocab_size=256)


def _requests() -> tuple[list[TokenizedGenerateReq], list[TokenizedGenerateReq]]:
    """Two streams, then the arrivals: a prompt of 5 chunks and 12 short requests."""
    rng = random.Random(7)
    streams = [_req(f"s{i}", 4, 40, rng) for i in range(2)]
    return streams, [_req("long", 5 * CHUNK, 2, rng)] + [
        _req(f"a{i}", 6, 3, rng) for i in range(12)]


def _rounds(path: str, mixed: bool) -> tuple[list[tuple[bool, int, bool]], dict[str, list[int]]]:
    """Each round: (a fill, running requests before it, a mixed step); every request's ids."""
    server = cpu_model_server(path, chunked_prefill_size=CHUNK, enable_mixed_chunk=mixed)
    ids: dict[str, list[int]] = {}
    rounds = []
    streams, arrivals = _requests()
    inp = StepInput(reqs=streams)
    for _ in range(500):
        fills = server.stats()["decode_step_times"]["fills"]["rounds"]
        mixes = server.counters.mixed_fills
        running = len(server.running)
        out = server.step(inp)
        for t in out.token_out.outs if out.token_out is not None else []:
            ids.setdefault(t.rid, []).extend(t.new_ids)
        rounds.append((server.stats()["decode_step_times"]["fills"]["rounds"] > fills,
                       running, server.counters.mixed_fills > mixes))
        if not (out.has_work or server.running or server.waiting):
            break
        # from the third round on, one arrival per round while the streams run
        inp = StepInput(reqs=[arrivals.pop(0)] if len(rounds) > 2 and arrivals else [])
    assert kv_is_free(server)
    return rounds, ids


@pytest.mark.parametrize("mixed", [False, True], ids=["chunked", "mixed"])
def test_running_requests_step_between_fills(model: str, mixed: bool) -> None:
    rounds, ids = _rounds(model, mixed)
    fills_while_running = [i for i, (fill, running, _) in enumerate(rounds) if fill and running]
    assert len(fills_while_running) >= 10, rounds  # the long prompt's chunks and the arrivals
    for i in fills_while_running:
        if mixed:
            assert rounds[i][2], (i, rounds)  # the fill carried the running requests' token
        else:
            assert not rounds[i + 1][0], (i, rounds)  # the next round decodes them

    streams, arrivals = _requests()
    want = {rid: [i for t in outs for i in t.new_ids] for rid, outs in serve_all(
        cpu_model_server(model, chunked_prefill_size=CHUNK), streams + arrivals).items()}
    assert ids == want


def test_fills_while_decoding_are_capped(model: str) -> None:
    """--max-fill-tokens-while-decoding (chunking off otherwise): a prompt that arrives with
    nothing running is filled whole; while requests decode, every fill computes at most the
    cap, and the outputs stay those of the plain server."""
    rng = random.Random(11)
    first = [_req("first", 3 * CHUNK, 30, rng)] + [_req(f"s{i}", 4, 40, rng) for i in range(2)]
    later = [_req("long", 5 * CHUNK, 2, rng)] + [_req(f"a{i}", 6, 3, rng) for i in range(6)]
    server = cpu_model_server(model, chunked_prefill_size=-1,
                              max_fill_tokens_while_decoding=CHUNK)
    fills = server.counters.timer.fills
    ids: dict[str, list[int]] = {}
    sizes: list[tuple[int, int]] = []  # (running requests before the round, tokens filled)
    inp = StepInput(reqs=first)
    for _ in range(500):
        running, tokens = len(server.running), fills.tokens
        out = server.step(inp)
        for t in out.token_out.outs if out.token_out is not None else []:
            ids.setdefault(t.rid, []).extend(t.new_ids)
        if fills.tokens > tokens:
            sizes.append((running, fills.tokens - tokens))
        if not (out.has_work or server.running or server.waiting):
            break
        inp = StepInput(reqs=later[:2] if len(sizes) >= 1 and later else [])
        del later[:2]
    assert kv_is_free(server)
    assert sizes[0] == (0, 3 * CHUNK + 8), sizes  # the first round fills whole
    while_running = [n for running, n in sizes if running]
    assert len(while_running) >= 5 and max(while_running) <= CHUNK, sizes  # "long" chunked
    assert sum(while_running) >= 5 * CHUNK, sizes

    rng = random.Random(11)
    first = [_req("first", 3 * CHUNK, 30, rng)] + [_req(f"s{i}", 4, 40, rng) for i in range(2)]
    later = [_req("long", 5 * CHUNK, 2, rng)] + [_req(f"a{i}", 6, 3, rng) for i in range(6)]
    want = {rid: [i for t in outs for i in t.new_ids] for rid, outs in serve_all(
        cpu_model_server(model, chunked_prefill_size=-1), first + later).items()}
    assert ids == want
