"""srt.Engine: the same processes in-process without HTTP give what /generate gives, refuse bad
input with the same error, and leave nothing running after shutdown."""

from __future__ import annotations

from typing import Any

import pytest

import srt
from srt.managers.tokenizer_manager import RequestError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def engine(smollm2_dir: str) -> Any:
    eng = srt.Engine(smollm2_dir, dtype="float32", device="cpu", random_seed=1234,
                     max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_generate_equals_http(engine: Any, server: Any) -> None:
    got = engine.generate(PROMPTS, GREEDY)
    want = server.generate({"text": PROMPTS, "sampling_params": GREEDY})
    assert [g["text"] for g in got] == [w["text"] for w in want]
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    one = engine.generate(PROMPTS[0], GREEDY)
    assert isinstance(one, dict) and one["text"] == want[0]["text"]
    assert one["meta_info"]["cached_tokens"] > 0  # the prompt's KV came from the radix cache
    ids = engine.generate(input_ids=want[1]["output_ids"][:4], sampling_params=GREEDY)
    assert ids["meta_info"]["prompt_tokens"] == 4
    lp = engine.generate(PROMPTS[2], GREEDY, return_logprob=True, top_logprobs_num=2)
    http = server.generate({"text": PROMPTS[2], "sampling_params": GREEDY,
                            "return_logprob": True, "top_logprobs_num": 2})
    got_lp = [x[0] for x in lp["meta_info"]["output_token_logprobs"]]
    want_lp = [x[0] for x in http["meta_info"]["output_token_logprobs"]]
    assert len(got_lp) == 12 and got_lp == pytest.approx(want_lp, abs=1e-5)


def test_bad_input_raises_request_error(engine: Any) -> None:
    with pytest.raises(RequestError) as e:
        engine.generate(PROMPTS[0], {"temperature": -1})
    assert e.value.param == "temperature"
    with pytest.raises(RequestError):
        engine.generate()
    stats = engine.get_server_info()  # still serving, nothing left behind
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0


def test_unknown_argument_and_shutdown(smollm2_dir: str) -> None:
    with pytest.raises(TypeError, match="no_such_flag"):
        srt.Engine(smollm2_dir, no_such_flag=1)
    with srt.Engine(smollm2_dir, dtype="float32", device="cpu", max_total_tokens=1024) as eng:
        procs = [c.process for c in eng._rt.supervisor.children]
        assert eng.generate("Hi", {"max_new_tokens": 2})["meta_info"]["completion_tokens"] == 2
    assert procs and not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate("Hi")
