"""--tp-size N on the CPU (gloo): the same greedy tokens as one rank, KV heads split per rank,
clear refusals, and a dead rank brings the server down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import pytest

from tests.conftest import BASE_ARGS, REPO, ServerProcess
from tests.random_models import save_random_llama

PROMPTS = [[5 + i, 17, 99, 3, 42 + i, 7, 250, 31, 64, 11][: 3 + i] for i in range(8)]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama_4l(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("llama_tp")), num_hidden_layers=4,
                             hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=4)


def _serve(args: list[str]) -> ServerProcess:
    return ServerProcess([*args, "--device", "cpu", "--dtype", "float32",
                          "--random-seed", "0"]).start()


def _greedy(srv: ServerProcess, prompts: list[list[int]], params: dict[str, Any]) -> list[Any]:
    return [r["output_ids"] for r in
            srv.generate({"input_ids": prompts, "sampling_params": params})]


def test_tp2_equals_tp1_on_random_llama(llama_4l: str) -> None:
    outs, pools = {}, {}
    for tp in (1, 2):
        srv = _serve(["--model-path", llama_4l, "--tp-size", str(tp), "--max-total-tokens",
                      "2048"])
        try:
            outs[tp] = _greedy(srv, PROMPTS, GREEDY)
            pools[tp] = srv.server_info()["kv_pool_per_rank"]
            srv.assert_kv_invariant()
        finally:
            srv.stop()
    assert outs[2] == outs[1]
    assert pools[1]["kv_heads"] == 4 and pools[2]["kv_heads"] == 2
    assert pools[1]["tokens"] == pools[2]["tokens"] == 2048


def test_tp2_overlap_equals_plain_loop(llama_4l: str) -> None:
    """--tp-size 2 (gloo): the overlapped loop (the default) gives the plain loop's ids, finish
    reasons and logprobs for a mixed batch: stop ids firing mid-way, n = 2, logprobs, requests
    finishing at every length, on a small pool (requests wait for room)."""
    lens = [1, 2, 3, 5, 9, 17, 40, 60]
    outs = {}
    for flags in ([], ["--disable-overlap-schedule"]):
        params = [{**GREEDY, "max_new_tokens": n} for n in lens]
        body = {"input_ids": PROMPTS, "sampling_params": params, "return_logprob": True,
                "top_logprobs_num": 2}
        srv = _serve(["--model-path", llama_4l, "--tp-size", "2", "--max-total-tokens", "100",
                      "--schedule-conservativeness", "0.01", *flags])
        try:
            first = srv.generate(body)
            # a stop id each output first writes at index 2 or later
            for p, r in zip(params, first):
                ids = r["output_ids"]
                late = [t for j, t in enumerate(ids) if j >= 2 and t not in ids[:j]]
                p["stop_token_ids"] = late[:1]
            twice = srv.generate({"input_ids": PROMPTS[0], "sampling_params": {
                **GREEDY, "n": 2, "max_new_tokens": 12}})
            res = srv.generate(body)
            outs[bool(flags)] = (first, res, twice, srv.server_info())
            srv.assert_kv_invariant()
        finally:
            srv.stop()
    for key in (0, 1, 2):
        got, want = outs[False][key], outs[True][key]
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in want]
        assert [r["meta_info"]["finish_reason"] for r in got] == \
            [r["meta_info"]["finish_reason"] for r in want]
    for g, w in zip(outs[False][1], outs[True][1]):
        assert [t[0] for t in g["meta_info"]["output_token_logprobs"]] == pytest.approx(
            [t[0] for t in w["meta_info"]["output_token_logprobs"]], abs=1e-4)
    assert any(r["meta_info"]["finish_reason"]["type"] == "stop" for r in outs[False][1])
    assert outs[False][3]["overlapped_decode_steps"] > 0
    assert outs[True][3]["overlapped_decode_steps"] == 0


def test_tp2_new_request_ends_the_decode_round(llama_4l: str) -> None:
    """--tp-size 2: a request that arrives while a round of decode steps runs ends the round
    on both ranks at the same step (rank 0 decides, gloo tells rank 1), so it is admitted after
    the step in flight; the stream running meanwhile loses nothing. Were the ranks to end it at
    different steps, their collectives would no longer pair up and the server would hang."""
    import threading

    srv = _serve(["--model-path", llama_4l, "--tp-size", "2", "--max-total-tokens", "4096"])
    try:
        long: list[Any] = []
        stream = threading.Thread(target=lambda: long.append(srv.generate({
            "input_ids": PROMPTS[7], "sampling_params": {**GREEDY, "max_new_tokens": 400}})))
        stream.start()
        time.sleep(1.0)
        probes = [srv.generate({"input_ids": p, "sampling_params": {**GREEDY,
                                                                    "max_new_tokens": 2}})
                  for p in PROMPTS[:6]]
        stream.join(timeout=300)
        info = srv.server_info()
        alone = srv.generate({"input_ids": PROMPTS[:6], "sampling_params": {
            **GREEDY, "max_new_tokens": 2}})
        srv.assert_kv_invariant()
    finally:
        srv.stop()
    assert len(long) == 1 and len(long[0]["output_ids"]) == 400
    assert [r["output_ids"] for r in probes] == [r["output_ids"] for r in alone]
    assert info["decode_rounds_ended_for_input"] > 0


def test_smollm2_tp3_equals_tp1(server: Any, smollm2_tokenizer: Any) -> None:
    prompts = [smollm2_tokenizer.encode(t) for t in (
        "The capital of France is", "def add(a, b):", "Three colors:", "Once upon a time",
        "The best way to learn", "Water boils at", "My favourite book is", "In 1969,")]
    params = {**GREEDY, "max_new_tokens": 12}
    # half of them with logprobs: every rank computes the same rows (the logits are gathered)
    body = {"input_ids": prompts, "sampling_params": params, "logprob_start_len": 0,
            "return_logprob": [i % 2 == 0 for i in range(len(prompts))], "top_logprobs_num": 3}
    reference = server.generate(body)
    srv = ServerProcess([*BASE_ARGS, "--tp-size", "3", "--max-total-tokens", "2048"]).start()
    try:
        got = srv.generate(body)
        assert [r["output_ids"] for r in got] == [r["output_ids"] for r in reference]
        for g, r in zip(got[::2], reference[::2]):
            for key in ("input_token_logprobs", "output_token_logprobs"):
                assert [t[1] for t in g["meta_info"][key]] == [t[1] for t in r["meta_info"][key]]
                assert [t[0] for t in g["meta_info"][key]] == pytest.approx(
                    [t[0] for t in r["meta_info"][key]], abs=1e-4)
            for top_g, top_r in zip(g["meta_info"]["output_top_logprobs"],
                                    r["meta_info"]["output_top_logprobs"]):
                assert [t[0] for t in top_g] == pytest.approx([t[0] for t in top_r], abs=1e-4)
        # Jump-forward: every rank plans the same jumps (the same ids as one rank).
        jump = {"text": ["Is the sky blue?", "A person as JSON:"], "sampling_params": [
            {"temperature": 0, "max_new_tokens": 16, "regex": r"The answer is (yes|no)\."},
            {"temperature": 0, "max_new_tokens": 48, "json_schema": {
                "type": "object", "properties": {"name_of_the_person": {"enum": ["Ann", "Bo"]}},
                "required": ["name_of_the_person"]}}]}
        got_jump, ref_jump = srv.generate(jump), server.generate(jump)
        assert [r["output_ids"] for r in got_jump] == [r["output_ids"] for r in ref_jump]
        for r in got_jump:
            assert r["meta_info"]["forward_passes"] < r["meta_info"]["completion_tokens"]
        info = srv.server_info()
        assert info["jump_forwards"] >= 2
        assert info["tp_size"] == 3 and info["kv_pool_per_rank"]["kv_heads"] == 1
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def test_tp_size_not_dividing_heads_is_refused(smollm2_dir: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "srt.server", "--tp-size", "2", "--device", "cpu", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    assert proc.returncode != 0
    assert "--tp-size 2 does not divide the model's 9 attention heads" in proc.stderr


def _named(pid: int, name: str) -> psutil.Process:
    for p in psutil.Process(pid).children(recursive=True):
        if p.name() == name:
            return p
    raise AssertionError(f"no child process named {name}")


def test_killing_rank1_brings_server_down(llama_4l: str) -> None:
    srv = _serve(["--model-path", llama_4l, "--tp-size", "2", "--max-total-tokens", "512"])
    try:
        procs = [psutil.Process(srv.proc.pid), *psutil.Process(srv.proc.pid).children(True)]
        start = time.monotonic()
        _named(srv.proc.pid, "srt-model-tp1").send_signal(signal.SIGKILL)
        code = srv.proc.wait(30)
        assert code != 0 and time.monotonic() - start < 30
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert alive == []
        assert "model process (TP rank 1) died" in srv.log()
    finally:
        srv.stop()
