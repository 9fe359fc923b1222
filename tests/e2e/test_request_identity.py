"""Request identity and samples: rids reused after an abort, duplicate rids inside one request,
per-sample seeds, and temperatures too small to divide by."""

from __future__ import annotations

from typing import Any

import requests

PROMPT = "Write a list of ten animals:"


def test_rid_reused_right_after_disconnect(server: Any) -> None:
    long = {"text": PROMPT, "rid": "reused", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 2000, "ignore_eos": True}}
    resp = requests.post(server.url + "/generate", json=long, stream=True, timeout=60)
    for line in resp.iter_lines():
        if line:
            break
    resp.close()  # abort of the first "reused" is on its way
    short = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    expect = server.generate(short)
    for _ in range(50):  # until the first one's state is gone and the rid is free again
        r = requests.post(server.url + "/generate", json={**short, "rid": "reused"}, timeout=60)
        if r.status_code == 200:
            break
        assert r.json()["error"]["code"] == "duplicate_rid"
    got = r.json()
    assert got["meta_info"]["id"] == "reused"
    assert got["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert got["output_ids"] == expect["output_ids"]


def test_duplicate_rids_after_expanding_n_are_refused(server: Any) -> None:
    body = {"input_ids": [[5, 6, 7], [8, 9, 10]], "rid": ["a", "a-0"],
            "sampling_params": [{"n": 2, "max_new_tokens": 2}, {"max_new_tokens": 2}]}
    r = requests.post(server.url + "/generate", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "rid"


def test_seeded_samples_differ_and_repeat(server: Any) -> None:
    body = {"text": PROMPT, "sampling_params": {"n": 3, "temperature": 1.0, "seed": 5,
                                                "max_new_tokens": 12}}
    first = [r["output_ids"] for r in server.generate(body)]
    second = [r["output_ids"] for r in server.generate(body)]
    assert first == second
    assert len({tuple(o) for o in first}) > 1


def test_tiny_temperature_is_greedy(server: Any) -> None:
    greedy = server.generate({"text": PROMPT, "sampling_params": {"temperature": 0,
                                                                  "max_new_tokens": 8}})
    tiny = server.generate({"text": PROMPT, "sampling_params": {"temperature": 1e-30,
                                                                "max_new_tokens": 8}})
    assert tiny["output_ids"] == greedy["output_ids"]
