"""Native logprobs on the real server: prompt and output logprobs and their top-k equal
transformers' log_softmax of its own logits (float32, within 1e-4), with a cold cache, with the
prompt already cached, and in batches with requests that ask for nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
import requests

TOL = 1e-4
PROMPT = "The quick brown fox jumps over the lazy dog because it"
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def hf_model(smollm2_dir: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def hf_logprobs(model: Any, ids: list[int]) -> Any:
    """[len(ids), vocab] float32: row i is log p(. | ids[:i + 1]) (teacher forcing)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def check_entries(ref: Any, ids: list[int], first: int, tokens: list[list[Any]],
                  tops: list[Any], k: int) -> None:
    """tokens[j] / tops[j] are the server's entries of token ids[first + j]; ref from
    hf_logprobs(ids). Top lists: the same values as transformers' top-k, and each listed id has
    the listed logprob (robust to near-ties swapping order)."""
    assert [t[1] for t in tokens] == ids[first : first + len(tokens)]
    for j, (tok, top) in enumerate(zip(tokens, tops)):
        p = first + j
        if p == 0:
            assert tok[0] is None and top is None
            continue
        row = ref[p - 1]
        assert tok[0] == pytest.approx(float(row[ids[p]]), abs=TOL), (p, tok)
        assert len(top) == k
        assert [v for v, _, _ in top] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
        for v, tid, _ in top:
            assert v == pytest.approx(float(row[tid]), abs=TOL)
        assert [v for v, _, _ in top] == sorted((v for v, _, _ in top), reverse=True)


def ask(server: Any, body: dict[str, Any]) -> Any:
    return server.generate({"return_logprob": True, "sampling_params": GREEDY, **body})


def test_logprobs_match_transformers_cold_and_cached(server: Any, hf_model: Any,
                                                      smollm2_tokenizer: Any) -> None:
    ids = smollm2_tokenizer.encode(PROMPT)
    L = len(ids)
    requests.post(server.url + "/flush_cache", timeout=30)
    cold = ask(server, {"input_ids": ids, "logprob_start_len": 0, "top_logprobs_num": 5})
    meta = cold["meta_info"]
    assert meta["cached_tokens"] == 0
    full = ids + cold["output_ids"]
    ref = hf_logprobs(hf_model, full)
    assert cold["output_ids"] == ref[L - 1 : -1].argmax(-1).tolist()  # greedy
    assert len(meta["input_token_logprobs"]) == L
    check_entries(ref, full, 0, meta["input_token_logprobs"], meta["input_top_logprobs"], 5)
    assert len(meta["output_token_logprobs"]) == 8
    check_entries(ref, full, L, meta["output_token_logprobs"], meta["output_top_logprobs"], 5)
    assert meta["normalized_prompt_logprob"] == pytest.approx(
        sum(float(ref[p - 1, ids[p]]) for p in range(1, L)) / (L - 1), abs=TOL)

    # The prompt is cached now. Asking from position 0 again must not let the cache hide it.
    again = ask(server, {"input_ids": ids, "logprob_start_len": 0, "top_logprobs_num": 5})
    assert again["meta_info"]["cached_tokens"] == 0
    check_entries(ref, full, 0, again["meta_info"]["input_token_logprobs"],
                  again["meta_info"]["input_top_logprobs"], 5)
    # From position 4: the match is cut to the 3 tokens before the first asked logit.
    mid = ask(server, {"input_ids": ids, "logprob_start_len": 4, "top_logprobs_num": 2})
    m = mid["meta_info"]
    assert m["cached_tokens"] == 3
    assert len(m["input_token_logprobs"]) == L - 4
    check_entries(ref, full, 4, m["input_token_logprobs"], m["input_top_logprobs"], 2)
    check_entries(ref, full, L, m["output_token_logprobs"], m["output_top_logprobs"], 2)
    assert m["normalized_prompt_logprob"] == pytest.approx(
        sum(float(ref[p - 1, ids[p]]) for p in range(4, L)) / (L - 4), abs=TOL)
    # Output logprobs only: the whole cached prefix is used, outputs still exact.
    out_only = ask(server, {"input_ids": ids})
    o = out_only["meta_info"]
    assert o["cached_tokens"] == L - 1
    assert o["input_token_logprobs"] == [] and o["normalized_prompt_logprob"] is None
    check_entries(ref, full, L, o["output_token_logprobs"], o["output_top_logprobs"], 0)


def test_batch_mixes_requests_with_and_without_logprobs(server: Any, hf_model: Any,
                                                         smollm2_tokenizer: Any) -> None:
    prompts = ["Water boils at", "My favourite colour is", "In 1969 the first man on the moon"]
    ids = [smollm2_tokenizer.encode(p) for p in prompts]
    plain = server.generate({"input_ids": ids, "sampling_params": GREEDY})
    mixed = server.generate({"input_ids": ids, "sampling_params": GREEDY,
                             "return_logprob": [True, False, True],
                             "logprob_start_len": [0, -1, 2], "top_logprobs_num": [3, 0, 1],
                             "return_text_in_logprobs": [True, False, False]})
    assert [r["output_ids"] for r in mixed] == [r["output_ids"] for r in plain]
    assert "output_token_logprobs" not in mixed[1]["meta_info"]
    for i, start, k in ((0, 0, 3), (2, 2, 1)):
        meta = mixed[i]["meta_info"]
        full = ids[i] + mixed[i]["output_ids"]
        ref = hf_logprobs(hf_model, full)
        check_entries(ref, full, start, meta["input_token_logprobs"], meta["input_top_logprobs"],
                      k)
        check_entries(ref, full, len(ids[i]), meta["output_token_logprobs"],
                      meta["output_top_logprobs"], k)
    # texts: each token decoded alone, only where asked
    meta = mixed[0]["meta_info"]
    for entry in meta["input_token_logprobs"] + meta["output_token_logprobs"]:
        assert entry[2] == smollm2_tokenizer.decode([entry[1]])
    for top in meta["output_top_logprobs"]:
        assert all(t[2] == smollm2_tokenizer.decode([t[1]]) for t in top)
    assert all(e[2] is None for e in mixed[2]["meta_info"]["output_token_logprobs"])


def test_normalized_prompt_logprob_picks_the_right_choice(server: Any,
                                                          smollm2_tokenizer: Any) -> None:
    prefix = "The capital of France is"
    choices = [" Paris", " Berlin", " Rome"]
    n = len(smollm2_tokenizer.encode(prefix))  # score only the choice's tokens
    results = server.generate({"text": [prefix + c for c in choices], "return_logprob": True,
                               "logprob_start_len": n, "sampling_params": {"max_new_tokens": 0}})
    scores = [r["meta_info"]["normalized_prompt_logprob"] for r in results]
    for r in results:
        assert r["output_ids"] == [] and len(r["meta_info"]["input_token_logprobs"]) >= 1
    assert scores[0] > scores[1] and scores[0] > scores[2], scores


def test_stream_carries_cumulative_logprobs(server: Any) -> None:
    body = {"text": PROMPT, "sampling_params": {**GREEDY, "max_new_tokens": 6},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    full = server.generate(body)
    chunks = []
    with requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True,
                       timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith(b"data: {"):
                chunks.append(json.loads(line[len(b"data: "):])["meta_info"])
    assert len(chunks) == 6
    for n, meta in enumerate(chunks, 1):
        assert len(meta["output_token_logprobs"]) == n == len(meta["output_top_logprobs"])
        assert meta["input_token_logprobs"] == chunks[0]["input_token_logprobs"]
    want = full["meta_info"]
    last = chunks[-1]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert [t[1] for t in last[key]] == [t[1] for t in want[key]]
        assert [t[0] for t in last[key]] == pytest.approx([t[0] for t in want[key]], abs=TOL)
