"""Jump-forward through the real server (SmolLM2 float32 on the CPU): the session server has it
on (the default), a second server of this module runs with --disable-regex-jump-forward.

What is compared: outputs with jump-forward on and off are both valid; the number of forward
passes a request took part in (meta_info.forward_passes) drops where the pattern forces long
text; and greedy text is equal on and off in the cases where that can be argued: when the model,
decoding token by token, writes the forced text in the tokens the tokenizer would use (its ids
then equal the tokenizer's encoding of its text), jump-forward appends those same tokens and
every later logit is computed over the same ids, so the ids must be equal too.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import requests

from tests.conftest import BASE_ARGS, ServerProcess

LONG_KEYS = {"type": "object", "properties": {
    "first_name_of_the_person": {"type": "string", "maxLength": 12},
    "age_of_the_person_in_years": {"type": "integer"},
    "favourite_programming_language": {"enum": ["python", "rust", "c"]}},
    "required": ["first_name_of_the_person", "age_of_the_person_in_years",
                 "favourite_programming_language"]}

# Greedy regex cases: (prompt, regex). Their forced parts are ordinary words, which the model
# writes in the tokenizer's own tokens, or nearly.
REGEX_CASES = [
    ("Is the sky blue?", r"The answer is (yes|no)\."),
    ("Give me a date:", r"Date: (19|20)[0-9]{2}-[01][0-9]-[0-3][0-9]"),
    ("Name a colour.", r"My favourite colour is (red|green|blue)\. It is nice\."),
    ("Tell me about Paris.", r"Paris is the capital of France and [a-z ]{1,30}\."),
]
GREEDY = {"temperature": 0, "max_new_tokens": 64}


@pytest.fixture(scope="module")
def server_off(smollm2_dir: str) -> Any:
    srv = ServerProcess([*BASE_ARGS, "--max-total-tokens", "8192",
                         "--disable-regex-jump-forward"]).start()
    yield srv
    srv.stop()


def _one(srv: ServerProcess, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    return srv.generate({"text": prompt, "sampling_params": params})


def test_greedy_regex_on_and_off_equal(server: ServerProcess, server_off: ServerProcess,
                                       smollm2_tokenizer: Any) -> None:
    before = server.server_info()["jump_forwards"]
    canonical = 0
    for prompt, rx in REGEX_CASES:
        params = {**GREEDY, "regex": rx}
        # one request at a time: the same batch shapes on both servers
        on, off = _one(server, prompt, params), _one(server_off, prompt, params)
        for r in (on, off):
            assert re.fullmatch(rx, r["text"]), (rx, r["text"])
            assert r["meta_info"]["finish_reason"]["type"] == "stop"
            assert r["meta_info"]["completion_tokens"] == len(r["output_ids"])
        assert off["meta_info"]["forward_passes"] == off["meta_info"]["completion_tokens"]
        assert on["meta_info"]["forward_passes"] < off["meta_info"]["forward_passes"], rx
        # the argued case: the model's own ids are the tokenizer's ids of its text
        if off["output_ids"] == smollm2_tokenizer.encode(off["text"], add_special_tokens=False):
            canonical += 1
            assert on["output_ids"] == off["output_ids"], (rx, on["text"], off["text"])
        # observed for the others (the model split a forced word differently, e.g. "D" "ate",
        # and went on the same way)
        assert on["text"] == off["text"], rx
    assert canonical >= 2
    assert server.server_info()["jump_forwards"] > before


def test_long_keys_need_fewer_forward_passes(server: ServerProcess,
                                            server_off: ServerProcess) -> None:
    params = {**GREEDY, "max_new_tokens": 96, "json_schema": LONG_KEYS}
    prompt = "Describe a person as JSON:"
    on, off = _one(server, prompt, params), _one(server_off, prompt, params)
    for r in (on, off):
        assert r["meta_info"]["finish_reason"]["type"] == "stop", r
        jsonschema.validate(json.loads(r["text"]), LONG_KEYS)
        assert r["meta_info"]["completion_tokens"] == len(r["output_ids"])
    passes_on, passes_off = on["meta_info"]["forward_passes"], off["meta_info"]["forward_passes"]
    print(f"long keys: {passes_on} forward passes with jump-forward, {passes_off} without "
          f"({on['meta_info']['completion_tokens']} / {off['meta_info']['completion_tokens']} "
          "tokens)")
    # the three keys alone are over 20 tokens that no longer need a pass each
    assert passes_on + 15 < passes_off
    # appended ids are output ids: counted, and more ids than passes
    assert on["meta_info"]["completion_tokens"] > passes_on + 15


def test_streaming_never_changes_sent_text_or_ids(server: ServerProcess) -> None:
    params = {**GREEDY, "max_new_tokens": 96, "json_schema": LONG_KEYS}
    body = {"text": "Describe a person as JSON:", "sampling_params": params, "stream": True}
    chunks: list[dict[str, Any]] = []
    with requests.post(server.url + "/generate", json=body, stream=True, timeout=300) as resp:
        assert resp.status_code == 200, resp.text
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[len(b"data: "):]))
    assert len(chunks) > 3
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
        assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
    last = chunks[-1]
    jsonschema.validate(json.loads(last["text"]), LONG_KEYS)
    meta = last["meta_info"]
    assert meta["completion_tokens"] == len(last["output_ids"])
    assert meta["forward_passes"] + 15 < meta["completion_tokens"]


def test_length_and_stop_inside_forced_text(server: ServerProcess,
                                            server_off: ServerProcess) -> None:
    rx = r"The answer is (yes|no)\."
    cases = [({"max_new_tokens": 2}, "length"), ({"stop": ["answer"]}, "stop"),
             ({"stop": [" is "]}, "stop")]
    for extra, kind in cases:
        params = {**GREEDY, "regex": rx, **extra}
        on, off = _one(server, "Is the sky blue?", params), _one(server_off, "Is the sky blue?",
                                                                 params)
        assert on["meta_info"]["finish_reason"]["type"] == kind, on
        assert on["text"] == off["text"] and on["output_ids"] == off["output_ids"], (extra, on)
        assert on["meta_info"]["finish_reason"] == off["meta_info"]["finish_reason"]
        assert on["meta_info"]["forward_passes"] < off["meta_info"]["forward_passes"]
    # a fully fixed pattern needs no forward pass at all
    fixed = _one(server, "Say hi.", {**GREEDY, "regex": r"Hello there, how are you\?"})
    assert fixed["text"] == "Hello there, how are you?"
    assert fixed["meta_info"]["forward_passes"] == 0
    assert fixed["meta_info"]["finish_reason"]["type"] == "stop"


def test_samples_and_logprobs(server: ServerProcess) -> None:
    params = {"temperature": 1.0, "seed": 11, "max_new_tokens": 96, "json_schema": LONG_KEYS,
              "n": 2}
    results = server.generate({"text": "A person as JSON:", "sampling_params": params})
    assert len(results) == 2
    for r in results:
        jsonschema.validate(json.loads(r["text"]), LONG_KEYS)
        assert r["meta_info"]["forward_passes"] + 15 < r["meta_info"]["completion_tokens"]
    # a request that wants logprobs samples every token (forced ones would have none)
    rx = r"The answer is (yes|no)\."
    lp = server.generate({"text": "Is the sky blue?", "return_logprob": True,
                          "sampling_params": {**GREEDY, "regex": rx}})
    assert re.fullmatch(rx, lp["text"])
    meta = lp["meta_info"]
    assert meta["forward_passes"] == meta["completion_tokens"] >= 4
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
