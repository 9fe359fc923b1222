"""Speculative decoding with a draft model (STANDALONE) on a model process stepped in this
process, float32 on the CPU: greedy output equal to decoding without speculation (token ids,
finish reasons, logprobs) on a mixed workload with stops, logprobs, n = 2, penalties and
min_new_tokens, with the overlapped loop and without, with chunked prefill and mixed steps;
a draft that is the target itself has every greedy draft accepted (so the draft's own KV pool,
written by mirroring every target step, holds what the target's does); a different small draft
keeps the output; SmolLM2 with a layer-prefix draft equal to transformers; retraction under a
small pool; sampled outputs distributed as the model's (chi-square); start-up refusals."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import Any

import pytest
import torch

from srt.managers.io_struct import TokenizedGenerateReq
from srt.server_args import ServerArgs
from tests.model_process import cpu_model_server, kv_is_free, serve_all
from tests.overlap_cases import assert_same, late_stops, mixed_requests, serve
from tests.unit.test_speculative import COPY, _chat, _greedy_only, _repeating_requests


def _spec(draft: str, algorithm: str = "STANDALONE", **extra: Any) -> dict[str, Any]:
    return {"speculative_algorithm": algorithm, "speculative_draft_model_path": draft,
            **extra}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: Any) -> str:
    from tests.random_models import save_random_llama

    return save_random_llama(str(tmp_path_factory.mktemp("sa_target")))


@pytest.fixture(scope="module")
def small_draft_dir(tmp_path_factory: Any) -> str:
    """Another model of the same vocabulary: one layer, other sizes, other weights."""
    from tests.random_models import save_random_llama

    return save_random_llama(str(tmp_path_factory.mktemp("sa_draft")), seed=3,
                             num_hidden_layers=1, hidden_size=128, intermediate_size=256,
                             num_attention_heads=4, num_key_value_heads=2)


def _workload(vocab: int, stops: dict[str, int] | None) -> list[TokenizedGenerateReq]:
    return mixed_requests(vocab, 10, 3, stops) + _repeating_requests(vocab, stops)


def _check_equal(target_dir: str, draft_dir: str, algorithm: str = "STANDALONE",
                 **flags: Any) -> dict[str, Any]:
    """Greedy ids, finish reasons and logprobs with drafts equal to decoding without, on the
    mixed workload and again over its cached prefixes; the speculative counters."""
    plain = cpu_model_server(target_dir, **flags)
    vocab = plain.config.vocab_size
    stops = {k: v for k, v in late_stops(serve(plain, _workload(vocab, None))).items()
             if not k.startswith("rp")}
    want = serve(plain, _workload(vocab, stops))
    spec = cpu_model_server(target_dir, **flags, **_spec(draft_dir, algorithm))
    reqs = _workload(vocab, stops)
    outs = serve_all(spec, reqs)
    got = serve(spec, _workload(vocab, stops))  # a second pass: drafts over cached prefixes
    assert_same(_greedy_only(got, reqs), _greedy_only(want, reqs))
    first = {rid: [i for t in o for i in t.new_ids] for rid, o in outs.items()}
    assert {rid: first[rid] for rid in _greedy_only(got, reqs)} == \
        {rid: w[0] for rid, w in _greedy_only(want, reqs).items()}
    for rid in got:  # sampled requests: other draws, the same lengths
        assert got[rid][2] == want[rid][2], rid
    assert any(want[rid][1]["type"] == "stop" for rid in stops)
    assert kv_is_free(plain) and kv_is_free(spec)
    # greedy requests that ran to their length (a stop inside accepted drafts cuts them)
    greedy = {r.rid for r in reqs if r.sampling_params.get("temperature", 1.0) == 0}
    counts = [o[-1].spec for rid, o in outs.items() if rid in greedy and o[-1].spec
              and o[-1].finish_reason["type"] == "length"]
    return {"stats": spec.stats()["speculative"],
            "drafted": sum(c.draft_tokens for c in counts),
            "accepted": sum(c.accepted_tokens for c in counts)}


@pytest.mark.parametrize("overlap", [True, False])
def test_self_draft_accepts_every_greedy_draft(target_dir: str, overlap: bool) -> None:
    """The target as its own draft: greedy output unchanged and every draft of a greedy
    request accepted, which holds only if the draft's KV of every position (prompt, cached
    prefix, plain and verification steps) is the target's."""
    r = _check_equal(target_dir, target_dir, disable_overlap_schedule=not overlap)
    assert r["stats"]["verify_steps"] > 0
    assert r["drafted"] > 20 and r["accepted"] == r["drafted"], r


def test_self_draft_with_chunks_and_mixed_steps(target_dir: str) -> None:
    """Prompts computed in chunks of 16 with the running requests' tokens in the same steps:
    the draft mirrors those steps too."""
    r = _check_equal(target_dir, target_dir, chunked_prefill_size=16, enable_mixed_chunk=True)
    assert r["drafted"] > 20 and r["accepted"] == r["drafted"], r


def test_other_draft_keeps_the_output(target_dir: str, small_draft_dir: str) -> None:
    r = _check_equal(target_dir, small_draft_dir)
    s = r["stats"]
    assert s["verify_steps"] > 0 and s["draft_tokens"] > 0, s
    assert s["accepted_tokens"] < s["draft_tokens"], s


def test_smollm2_with_a_layer_prefix_draft(smollm2_dir: str, smollm2_tokenizer: Any,
                                           tmp_path: Any) -> None:
    """SmolLM2 drafted by its own first 25 layers (with its norm and LM head): a copy prompt's
    greedy tokens equal transformers' and decoding without drafts, some drafts accepted (a
    penalty's request drafts too); a regex's request drafts within its grammar (the slots of the
    drafts it cut given back)."""
    from transformers import AutoModelForCausalLM

    from benchmarks.common import save_layer_prefix

    draft = save_layer_prefix(smollm2_dir, str(tmp_path / "draft"), 25)
    tok = smollm2_tokenizer
    ids = _chat(tok, COPY[0])
    g = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    reqs = lambda: [TokenizedGenerateReq("copy", ids, dict(g)),
                    TokenizedGenerateReq("pen", _chat(tok, COPY[1]),
                                         {**g, "max_new_tokens": 6, "frequency_penalty": 0.3}),
                    # lower case only: drafts of the copy are cut at its capitals and stops
                    TokenizedGenerateReq("lower", ids, {**g, "max_new_tokens": 16,
                                                        "regex": r"[a-z ]{1,80}"})]
    spec = cpu_model_server(smollm2_dir, **_spec(draft))
    outs = serve_all(spec, reqs())
    got = {rid: [i for t in o for i in t.new_ids] for rid, o in outs.items()}
    want = serve(cpu_model_server(smollm2_dir), reqs())
    assert got == {rid: w[0] for rid, w in want.items()}
    c = outs["copy"][-1].spec
    assert c is not None and 0 < c.accepted_tokens < c.draft_tokens, c
    assert outs["pen"][-1].spec is not None and outs["pen"][-1].spec.draft_tokens > 0
    assert kv_is_free(spec)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    assert got["copy"] == ref[0, len(ids):].tolist()


def test_retraction_keeps_the_output(target_dir: str, small_draft_dir: str) -> None:
    reqs = lambda: [TokenizedGenerateReq(
        f"c{i}", ([7 + i, 40, 41, 42, 43] * 6)[: 20 + i], {"temperature": 0,
                                                         "max_new_tokens": 60,
                                                         "ignore_eos": True})
        for i in range(8)]
    want = serve(cpu_model_server(target_dir), reqs())
    for draft in (target_dir, small_draft_dir):
        small = cpu_model_server(target_dir, max_total_tokens=300, **_spec(draft))
        got = serve(small, reqs())
        assert small.stats()["retracted_reqs"] > 0
        assert {k: v[:3] for k, v in got.items()} == {k: v[:3] for k, v in want.items()}
        assert kv_is_free(small)


def test_sampling_keeps_the_model_distribution(tmp_path: Any) -> None:
    """The model drafting for itself (its greedy token) at temperature 1, top-k 3: the joint
    distribution of the first two tokens equals transformers' within a chi-square test at
    p = 0.001, and the same counts with every draft accepted would fail it."""
    from transformers import AutoModelForCausalLM

    from tests.random_models import save_random_llama

    vocab = 96
    path = save_random_llama(str(tmp_path / "m"), vocab_size=vocab, num_hidden_layers=2,
                             hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, init_std=0.05)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randperm(vocab - 2, generator=g).add(2).tolist()[:20]
    params = {"temperature": 1.0, "top_k": 3, "max_new_tokens": 3, "ignore_eos": True}
    n = 1500
    server = cpu_model_server(path, **_spec(path, speculative_disable_by_batch_size=4096))
    outs = serve_all(server, [TokenizedGenerateReq(f"s{i}", prompt, dict(params))
                              for i in range(n)])
    pairs = Counter(tuple([i for t in o for i in t.new_ids][:2]) for o in outs.values())
    assert all(o[-1].spec.draft_tokens > 0 for o in outs.values())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    def next_logits(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1]

    expected: dict[tuple[int, int], float] = {}
    draft_of: dict[int, int] = {}
    v, i = next_logits(prompt).topk(3)
    for a, pa in zip(i.tolist(), torch.softmax(v, -1).tolist()):
        logits = next_logits(prompt + [a])
        vb, ib = logits.topk(3)
        for b, pb in zip(ib.tolist(), torch.softmax(vb, -1).tolist()):
            expected[(a, b)] = pa * pb
        draft_of[a] = int(logits.argmax())  # the draft: the model's own greedy token

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


def test_start_up_refusals(target_dir: str, tmp_path: Any) -> None:
    base = dict(model_path=target_dir, tokenizer_path=target_dir)
    cases = [
        (dict(speculative_algorithm="STANDALONE"), "needs --speculative-draft-model-path"),
        (_spec(str(tmp_path)), "not a model directory"),
        (_spec(target_dir, speculative_eagle_topk=2), "--speculative-eagle-topk must be 1"),
        (_spec(target_dir, speculative_num_steps=3, speculative_num_draft_tokens=6),
         "must be --speculative-num-steps + 1"),
        (_spec(target_dir, speculative_num_steps=0), "--speculative-num-steps must be in"),
        (dict(speculative_algorithm="EAGLE3"),
         "needs --speculative-draft-model-path .an EAGLE3 head checkpoint"),
    ]
    for flags, message in cases:
        with pytest.raises(ValueError, match=message.replace("+", r"\+")):
            ServerArgs(**base, **flags).validate()
    args = ServerArgs(**base, **_spec(target_dir, speculative_num_steps=2))
    args.validate()
    assert args.speculative_draft_tokens == 2
    assert ServerArgs(**base, **_spec(target_dir)).speculative_draft_tokens == 3


def test_draft_of_another_vocabulary_is_refused(target_dir: str, tmp_path: Any) -> None:
    from tests.random_models import save_random_llama

    other = save_random_llama(str(tmp_path / "v"), vocab_size=128, num_hidden_layers=1)
    with pytest.raises(ValueError, match="does not cover the target's"):
        cpu_model_server(target_dir, **_spec(other))


def test_draft_with_a_smaller_vocabulary(target_dir: str, tmp_path: Any) -> None:
    """A draft whose vocabulary is a little smaller than the target's (as a differently padded
    embedding): prompt ids past it reach the draft as id 0 and the output is unchanged."""
    from tests.random_models import save_random_llama

    draft = save_random_llama(str(tmp_path / "d"), vocab_size=480, num_hidden_layers=1)
    reqs = lambda: [TokenizedGenerateReq(f"v{i}", [500 + i, 3, 490, 7, 500 + i, 3] * 3,
                                         {"temperature": 0, "max_new_tokens": 12,
                                          "ignore_eos": True}) for i in range(4)]
    want = serve(cpu_model_server(target_dir), reqs())
    spec = cpu_model_server(target_dir, **_spec(draft))
    got = serve(spec, reqs())
    assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in want.items()}
    assert spec.stats()["speculative"]["draft_tokens"] > 0
    assert kv_is_free(spec)


def test_reported_sizes_count_the_draft(target_dir: str, small_draft_dir: str) -> None:
    """The weights and KV pool a rank reports (the start-up log, /get_server_info) include the
    draft model's."""
    plain = cpu_model_server(target_dir, max_total_tokens=4096)
    spec = cpu_model_server(target_dir, max_total_tokens=4096, **_spec(small_draft_dir))
    draft = spec.runner.draft
    assert draft is not None and 0 < draft.weight_bytes < plain.runner.weight_bytes
    got, base = spec.runner.info(), plain.runner.info()
    assert got.weight_gb == pytest.approx((plain.runner.weight_bytes + draft.weight_bytes) / 1e9)
    per_token = (plain.runner.token_to_kv_pool.bytes_per_token
                 + draft.token_to_kv_pool.bytes_per_token)
    assert got.kv_gb == pytest.approx(4096 * per_token / 1e9) and got.kv_gb > base.kv_gb


def test_draft_checked_before_any_process_starts(target_dir: str, tmp_path: Any) -> None:
    """The launcher checks the draft's heads against --tp-size as it does the target's."""
    from srt.launcher import prepare_args
    from tests.random_models import save_random_llama

    odd = save_random_llama(str(tmp_path / "odd"), num_hidden_layers=1, hidden_size=96,
                            num_attention_heads=3, num_key_value_heads=3)
    args = ServerArgs(model_path=target_dir, tokenizer_path=target_dir, device="cpu",
                      tp_size=2, **_spec(odd))
    with pytest.raises(ValueError, match="tp-size"):
        prepare_args(args)
    prepare_args(dataclasses.replace(args, speculative_draft_model_path=target_dir))
