"""Speculative decoding (NGRAM) on a model process stepped in this process: greedy output equal
to decoding without speculation (token ids, finish reasons, logprobs) on a mixed workload with
copy-heavy prompts, stops, logprobs, n = 2, a regex and penalties, with the overlapped loop and
without; constrained requests drafting within their grammars; equal to transformers' greedy
tokens; unchanged by retraction under a small pool; the KV pool whole afterwards; and sampled
outputs distributed as the model's (chi-square)."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import pytest
import torch

from srt.managers.io_struct import LogprobOptions, TokenizedGenerateReq
from tests.model_process import branch_counter, cpu_model_server, kv_is_free, serve_all
from tests.overlap_cases import assert_same, late_stops, mixed_requests, serve

SPEC = {"speculative_algorithm": "NGRAM"}
TEXT = ("The old lighthouse stood at the edge of the cliff for more than two hundred years. "
        "Every night the keeper climbed the narrow stairs, cleaned the big glass lens and lit "
        "the lamp. Ships that passed the rocky coast could see the light from far away.")
COPY = [f"Copy the following text exactly.\n\n{TEXT}",
        "Rewrite this function with the variable x renamed to total.\n\ndef add(items):\n"
        "    x = 0\n    for item in items:\n        x = x + item.price\n    return x"]


def _chat(tok: Any, text: str) -> list[int]:
    s = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                tokenize=False)
    return tok.encode(s, add_special_tokens=False)


def _greedy_only(out: dict[str, Any], reqs: list[TokenizedGenerateReq]) -> dict[str, Any]:
    keep = {r.rid for r in reqs if r.sampling_params.get("temperature", 1.0) == 0}
    return {k: v for k, v in out.items() if k in keep}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: Any) -> str:
    from tests.random_models import save_random_llama

    return save_random_llama(str(tmp_path_factory.mktemp("spec_llama")))


def _repeating_requests(vocab: int, stops: dict[str, int] | None = None
                        ) -> list[TokenizedGenerateReq]:
    """Prompts that repeat a pattern (so drafts come from the prompt) with outputs of every
    length, logprobs, a penalty and min_new_tokens."""
    import random

    rng = random.Random(11)
    reqs = []
    for i in range(8):
        pattern = [rng.randrange(2, vocab) for _ in range(rng.randrange(3, 9))]
        params: dict[str, Any] = {"temperature": 0, "ignore_eos": True,
                                  "max_new_tokens": [2, 5, 9, 17, 30][i % 5]}
        if i == 5:
            params["frequency_penalty"] = 0.4
        if i == 6:
            params["min_new_tokens"] = 6
        rid = f"rp{i}"
        if stops and rid in stops:
            params["stop_token_ids"] = [stops[rid]]
        logprob = LogprobOptions(logprob_start_len=-1, top_logprobs_num=2) if i % 3 == 1 \
            else None
        reqs.append(TokenizedGenerateReq(rid, pattern * 4 + pattern[:2], params,
                                         stream=i % 2 == 0, logprob=logprob))
    return reqs


@pytest.mark.parametrize("overlap", [True, False])
def test_ngram_equals_decoding_without_drafts(llama_dir: str, overlap: bool) -> None:
    plain = cpu_model_server(llama_dir, disable_overlap_schedule=not overlap)
    vocab = plain.config.vocab_size

    def requests(stops: dict[str, int] | None) -> list[TokenizedGenerateReq]:
        return mixed_requests(vocab, 10, 3, stops) + _repeating_requests(vocab, stops)

    # stop ids that fire mid-way for the mixed requests; the repeating ones run long
    stops = {k: v for k, v in late_stops(serve(plain, requests(None))).items()
             if not k.startswith("rp")}
    want = serve(plain, requests(stops))
    spec = cpu_model_server(llama_dir, disable_overlap_schedule=not overlap, **SPEC)
    reqs = requests(stops)
    got = serve(spec, reqs)
    assert_same(_greedy_only(got, reqs), _greedy_only(want, reqs))
    for rid in got:  # sampled requests: other draws, the same lengths
        assert got[rid][2] == want[rid][2], rid
    s = spec.stats()["speculative"]
    assert s["verify_steps"] > 0 and 0 < s["accepted_tokens"] < s["draft_tokens"], s
    assert any(want[rid][1]["type"] == "stop" for rid in stops)
    assert kv_is_free(plain) and kv_is_free(spec)


def test_smollm2_copy_prompts(smollm2_dir: str, smollm2_tokenizer: Any) -> None:
    """SmolLM2 on copy prompts with a stop string, a regex and a penalty in the batch: the
    tokens of decoding without drafts and of transformers, most drafts accepted (also under a
    penalty); none past max_new_tokens."""
    from transformers import AutoModelForCausalLM

    tok = smollm2_tokenizer
    g = {"temperature": 0, "max_new_tokens": 32}
    reqs = lambda: [
        TokenizedGenerateReq("copy", _chat(tok, COPY[0]), {**g, "ignore_eos": True},
                             stream=True),
        TokenizedGenerateReq("stop", _chat(tok, COPY[0]), {**g, "stop": [" narrow"]}),
        TokenizedGenerateReq("max", _chat(tok, COPY[1]), {**g, "max_new_tokens": 6}),
        TokenizedGenerateReq("pen", _chat(tok, COPY[1]), {**g, "max_new_tokens": 8,
                                                          "frequency_penalty": 0.3}),
        TokenizedGenerateReq("regex", tok.encode("Is the sky blue?"), {
            **g, "max_new_tokens": 12, "regex": r"The answer is (yes|no)\."}),
    ]
    want = serve(cpu_model_server(smollm2_dir), reqs())
    spec = cpu_model_server(smollm2_dir, **SPEC)
    outs = serve_all(spec, reqs())
    got = {rid: [i for t in o for i in t.new_ids] for rid, o in outs.items()}
    assert got == {rid: w[0] for rid, w in want.items()}
    last = {rid: o[-1] for rid, o in outs.items()}
    c = last["copy"].spec
    assert c is not None and c.verify_ct < last["copy"].completion_tokens / 2, c
    assert c.accepted_tokens > 0.6 * c.draft_tokens, c
    assert last["copy"].forward_passes == 1 + c.verify_ct
    assert last["stop"].finish_reason["type"] == "stop"
    # a penalty's rows count the drafts before them: it drafts, with the same output
    assert last["pen"].spec is not None and last["pen"].spec.draft_tokens > 0
    assert last["max"].completion_tokens == 6
    assert kv_is_free(spec)
    ids = _chat(tok, COPY[0])
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    assert got["copy"] == ref[0, len(ids):].tolist()


def test_constrained_requests_draft_within_their_grammar(smollm2_dir: str,
                                                         smollm2_tokenizer: Any) -> None:
    """Copy prompts under a JSON schema and a regex whose count changes the grammar's state at
    every character, and a regex of fixed text, without jump-forward: drafts are cut where the
    grammar refuses them and each verification row is masked by the state after the drafts
    before it, so the ids and finish reasons are those of decoding without drafts; drafts of the
    constrained requests are accepted."""
    tok = smollm2_tokenizer
    lower = ("the old lighthouse stood at the edge of the cliff for more than two hundred "
             "years, and every night the keeper climbed the narrow stairs.")
    schema = json.dumps({"type": "object", "properties": {"text": {"type": "string"}},
                         "required": ["text"], "additionalProperties": False})
    g = {"temperature": 0, "max_new_tokens": 40}
    reqs = lambda: [
        TokenizedGenerateReq("json", _chat(tok, "Return this text as JSON with the key "
                                                f"\"text\".\n\n{TEXT}"),
                             {**g, "max_new_tokens": 80, "json_schema": schema}),
        TokenizedGenerateReq("lower", _chat(tok, f"Copy this text exactly.\n\n{lower}"),
                             {**g, "regex": r"[a-z ,.]{10,70}\."}),
        TokenizedGenerateReq("fixed", tok.encode("Answer:"), {
            **g, "regex": r"The answer is (yes|no)\. The colour is (red|green|blue)\."}),
    ]
    flags = {"disable_regex_jump_forward": True}
    want = serve(cpu_model_server(smollm2_dir, **flags), reqs())
    spec = cpu_model_server(smollm2_dir, **flags, **SPEC)
    outs = serve_all(spec, reqs())
    got = {rid: ([i for t in o for i in t.new_ids], o[-1].finish_reason["type"])
           for rid, o in outs.items()}
    assert got == {rid: (w[0], w[1]["type"]) for rid, w in want.items()}
    for rid in ("json", "lower"):
        c = outs[rid][-1].spec
        assert c is not None and c.accepted_tokens > 5, (rid, c)
    assert got["json"][1] == "stop" and json.loads(tok.decode(got["json"][0]))["text"]
    assert kv_is_free(spec)


def test_penalties_and_min_new_tokens_count_the_drafts(smollm2_dir: str,
                                                        smollm2_tokenizer: Any) -> None:
    """Copy prompts under strong penalties, and with min_new_tokens and a stop id that the
    copy reaches: requests with penalties and a pending min_new_tokens draft, with the ids of
    decoding without drafts (how each row counts the drafts before it is checked below)."""
    tok = smollm2_tokenizer
    ids = _chat(tok, COPY[0])
    (the,) = tok.encode(" the", add_special_tokens=False)
    g = {"temperature": 0, "max_new_tokens": 40}
    reqs = lambda: [
        TokenizedGenerateReq("freq", ids, {**g, "frequency_penalty": 0.8}),
        TokenizedGenerateReq("pres", ids, {**g, "presence_penalty": 1.2}),
        TokenizedGenerateReq("rep", ids, {**g, "repetition_penalty": 1.05}),
        TokenizedGenerateReq("min", ids, {**g, "min_new_tokens": 12, "stop_token_ids": [the]}),
    ]
    want = serve(cpu_model_server(smollm2_dir), reqs())
    spec = cpu_model_server(smollm2_dir, **SPEC)
    outs = serve_all(spec, reqs())
    got = {rid: ([i for t in o for i in t.new_ids], o[-1].finish_reason["type"])
           for rid, o in outs.items()}
    assert got == {rid: (w[0], w[1]["type"]) for rid, w in want.items()}
    assert got["min"][1] == "stop" and len(got["min"][0]) > 12
    for rid in ("freq", "pres", "min"):  # (the copy goes on under these penalties)
        c = outs[rid][-1].spec
        assert c is not None and c.accepted_tokens > 3, (rid, c)
    assert kv_is_free(spec)


def test_retraction_keeps_the_output(llama_dir: str) -> None:
    """Requests retracted and resumed under a small pool, drafts cut to the room left: the
    tokens of a large pool."""
    reqs = lambda: [TokenizedGenerateReq(
        f"c{i}", ([7 + i, 40, 41, 42, 43] * 6)[: 20 + i], {"temperature": 0,
                                                         "max_new_tokens": 60,
                                                         "ignore_eos": True})
        for i in range(8)]
    want = serve(cpu_model_server(llama_dir, **SPEC), reqs())
    small = cpu_model_server(llama_dir, max_total_tokens=300, **SPEC)
    got = serve(small, reqs())
    assert small.stats()["retracted_reqs"] > 0
    assert {k: v[:3] for k, v in got.items()} == {k: v[:3] for k, v in want.items()}
    assert kv_is_free(small)


def test_sampling_keeps_the_model_distribution(tmp_path: Any) -> None:
    """Tokens sampled at temperature 1 with top-k 3 after a prompt that holds every token, so
    that each first token has a draft for the second: the joint distribution of the first two
    equals transformers' within a chi-square test at p = 0.001, and the same counts with
    every draft accepted would fail it. (Three tokens are asked for: with one left after the
    first, nothing would be drafted.)"""
    from transformers import AutoModelForCausalLM

    from tests.random_models import save_random_llama

    vocab = 96
    path = save_random_llama(str(tmp_path / "m"), vocab_size=vocab, num_hidden_layers=2,
                             hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, init_std=0.05)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randperm(vocab - 2, generator=g).add(2).tolist() * 2
    params = {"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True}
    n = 1500
    server = cpu_model_server(path, speculative_disable_by_batch_size=4096, **SPEC)
    outs = serve_all(server, [TokenizedGenerateReq(f"s{i}", prompt, dict(params))
                              for i in range(n)])
    pairs = Counter(tuple([i for t in o for i in t.new_ids][:2]) for o in outs.values())
    # every second token was verified against a draft
    assert all(o[-1].spec.draft_tokens > 0 for o in outs.values())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def topk_probs(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        v, i = logits.topk(3)
        return dict(zip(i.tolist(), torch.softmax(v, -1).tolist()))

    expected: dict[tuple[int, int], float] = {}
    draft_of: dict[int, int] = {}
    for a, pa in topk_probs(prompt).items():
        for b, pb in topk_probs(prompt + [a]).items():
            expected[(a, b)] = pa * pb
        draft_of[a] = prompt[prompt.index(a) + 1]  # the token after a in the prompt

    def chi2(counts: Counter) -> float:
        if set(counts) - set(expected):
            return math.inf
        return sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in expected.items())

    critical = 27.88  # chi-square, 8 degrees of freedom, p = 0.001
    assert chi2(pairs) < critical, (pairs, expected)
    accept_all = Counter()
    for (a, _b), c in pairs.items():
        accept_all[(a, draft_of[a])] += c
    assert chi2(accept_all) > critical
    assert kv_is_free(server)


def test_rows_count_the_drafts_before_them() -> None:
    """A verification's sampling rows: row j of a request counts its drafts 0..j-1 as output
    (penalty counts, min_new_tokens' stop mask); the rows of the plan in order."""
    from srt.model_process.batch import Batch
    from srt.model_process.req import Req
    from srt.model_process.sampling_info import build_sampling_info
    from srt.sampling_params import SamplingParams

    def req(rid: str, **params: Any) -> Req:
        r = Req(rid, [5, 6, 7], SamplingParams.from_dict({"temperature": 0, **params}))
        r.output_ids = [9]
        r.req_pool_idx = len(rid)
        return r

    a = req("a", frequency_penalty=1.0)
    b = req("bb", min_new_tokens=3)
    batch = Batch.of([a, b])
    plan = batch.prepare_verify(torch.arange(6), [[11, 11], [4]])
    before = plan.verify.drafts_before()
    assert before == [[], [11], [11, 11], [], [4]]
    info, _ = build_sampling_info(plan.verify.row_reqs, 16, torch.device("cpu"),
                                  lambda r: {2}, before=before)
    assert info.output_counts[:3, 11].tolist() == [0.0, 1.0, 2.0]
    assert info.output_counts[:, 9].tolist() == [1.0] * 5
    # b has 1 output token: rows with 1 and 2 before min_new_tokens 3, not with 1 + 1 + 1
    assert info.forbidden[3:, 2].tolist() == [True, True]
    plan2 = Batch.of([b]).prepare_verify(torch.arange(3), [[4, 8]])
    info2, _ = build_sampling_info(plan2.verify.row_reqs, 16, torch.device("cpu"),
                                   lambda r: {2}, before=plan2.verify.drafts_before())
    assert info2.forbidden[:, 2].tolist() == [True, True, False]


def _echo_chain(path: str, start: int, n: int) -> list[int]:
    """The greedy tokens of an echo target (its next token a function of its last) from
    `start`: start, f(start), f(f(start)), ... (n ids)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out = [start]
    with torch.no_grad():
        for _ in range(n - 1):
            out.append(int(model(torch.tensor([out[-1:]])).logits[0, -1].argmax()))
    return out


@pytest.mark.parametrize("breadth", [1, 4])
def test_ngram_trees_keep_the_output(tmp_path: Any, monkeypatch: Any, breadth: int) -> None:
    """An echo target (its next token a function f of its last) after a prompt in which the
    output's next tokens occur three times: followed by a decoy, by what f gives, and last by
    another decoy. A chain drafts the latest (decoy) continuation; a tree of up to 4 children
    a node (11 nodes) also holds the true one, off its first-child path, and keeps it: more
    tokens per step, the ids of decoding without drafts either way."""
    from tests.eagle_heads import save_echo_llama

    target = save_echo_llama(str(tmp_path / "echo"))
    seen = branch_counter(monkeypatch)
    reqs = []
    for i, start in enumerate((300, 350, 410)):
        c = _echo_chain(target, start, 12)
        prompt = [c[1], c[2], 20 + i, 21 + i] + c[1:10] + [c[1], c[2], 40 + i, 41 + i] + [c[0]]
        reqs.append(TokenizedGenerateReq(f"e{i}", prompt, {"temperature": 0,
                                                           "max_new_tokens": 5,
                                                           "ignore_eos": True}))
    want = serve(cpu_model_server(target), reqs)
    spec = cpu_model_server(target, **SPEC, speculative_num_draft_tokens=12,
                            speculative_ngram_max_bfs_breadth=breadth)
    got = serve(spec, reqs)
    assert got == want
    assert kv_is_free(spec)
    s = spec.stats()["speculative"]
    if breadth == 1:
        assert seen["trees"] == 0 and seen["off_main"] == 0, seen
        assert s["accept_length"] == 2, s  # c2, then f's token where the decoy was
    else:
        assert seen["trees"] >= 3 and seen["off_main"] >= 3, seen
        assert s["accept_length"] == 4, s  # the 4 tokens after the first in one step
