"""Constrained requests in the overlapped loop: the step in flight is read between the next
step's forward and its sampling, so each mask sees the token before it. Against the plain loop
(each step read before the next is launched): the same ids without jump-forward, the same text
with it (a jump wanted while a step is in flight waits for that step), the KV all given back."""

from __future__ import annotations

import json
from typing import Any

import pytest

from srt.managers.io_struct import TokenizedGenerateReq
from tests.e2e.test_jump_forward import LONG_KEYS
from tests.model_process import cpu_model_server, kv_is_free, serve_all

REGEXES = [r"The answer is (yes|no)\. The colour is (red|green|blue)\.",
           r"[a-z ,.]{10,40}\."]


def _requests(tok: Any) -> list[TokenizedGenerateReq]:
    greedy = {"temperature": 0, "max_new_tokens": 48}
    return [
        TokenizedGenerateReq("schema", tok.encode("Describe a person as JSON:"),
                             {**greedy, "max_new_tokens": 96,
                              "json_schema": json.dumps(LONG_KEYS)}),
        TokenizedGenerateReq("regex0", tok.encode("Answer:"), {**greedy, "regex": REGEXES[0]}),
        TokenizedGenerateReq("regex1", tok.encode("Say something:"),
                             {**greedy, "regex": REGEXES[1]}, stream=True),
        TokenizedGenerateReq("free", tok.encode("The capital of France is"),
                             {**greedy, "max_new_tokens": 24, "ignore_eos": True}),
        # sampled, seeded: the mask and the sampling see the same state in both loops
        TokenizedGenerateReq("sampled", tok.encode("Pick:"),
                             {"temperature": 1.0, "seed": 7, "max_new_tokens": 32,
                              "regex": REGEXES[1]}),
    ]


def _run(path: str, tok: Any, overlap: bool, jump: bool) -> tuple[dict[str, Any], dict, bool]:
    server = cpu_model_server(path, disable_overlap_schedule=not overlap,
                              disable_regex_jump_forward=not jump)
    res = {}
    for rid, outs in serve_all(server, _requests(tok)).items():
        res[rid] = ([i for t in outs for i in t.new_ids], outs[-1].finish_reason["type"],
                    outs[-1].forward_passes, outs[-1].completion_tokens)
    return res, server.stats(), kv_is_free(server)


@pytest.mark.parametrize("jump", [False, True], ids=["no-jump", "jump"])
def test_overlapped_constrained_steps_match_the_plain_loop(smollm2_dir: str,
                                                           smollm2_tokenizer: Any,
                                                           jump: bool) -> None:
    tok = smollm2_tokenizer
    on, on_stats, on_free = _run(smollm2_dir, tok, True, jump)
    off, off_stats, off_free = _run(smollm2_dir, tok, False, jump)
    assert on_free and off_free
    assert on_stats["overlapped_decode_steps"] >= 20, on_stats["overlapped_decode_steps"]
    assert off_stats["overlapped_decode_steps"] == 0
    for rid in off:
        assert on[rid][1] == off[rid][1], rid
        assert tok.decode(on[rid][0]) == tok.decode(off[rid][0]), rid
        if not jump:  # masks only: the same ids, a forward pass per token
            assert on[rid][0] == off[rid][0], rid
            assert on[rid][2] == on[rid][3] == off[rid][2], rid
    if jump:
        assert on_stats["jump_forwards"] >= 3 and off_stats["jump_forwards"] >= 3
        assert on["schema"][2] + 4 < on["schema"][3]  # forced tokens took no forward
