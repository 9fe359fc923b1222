"""Chained NGRAM verification steps (srt.model_process.spec_chain), float32 on the CPU: the
device lookup drafts what the host's n-gram index drafts; a batch that chains gives the tokens,
finish reasons and lengths of decoding without drafts (stops mid-way, lengths past the drafts,
sampled requests beside greedy ones), with the chained steps counted and the KV pool whole
after; a pool too small for them retracts and keeps the tokens; SmolLM2 on a copy prompt
accepts most drafts and equals decoding without them."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from srt.managers.io_struct import TokenizedGenerateReq
from srt.model_process.ngram import NgramIndex
from srt.model_process.spec_chain_graph import lookup
from tests.model_process import cpu_model_server, kv_is_free
from tests.overlap_cases import assert_same, serve
from tests.unit.test_speculative import COPY, _chat, _greedy_only

SPEC = {"speculative_algorithm": "NGRAM", "speculative_chain": "on"}


@pytest.mark.parametrize("min_n,max_n,k,pad", [(1, 12, 4, 5), (2, 4, 4, 5), (1, 3, 7, 5),
                                               (3, 5, 1, 5), (2, 4, 4, 300)])
def test_lookup_drafts_as_the_host_index(min_n: int, max_n: int, k: int, pad: int) -> None:
    """`pad`: columns past the longest sequence, junk of the sequences' own alphabet there (the
    graphs' lookup reads a power-of-two width: nothing past a request's length may count)."""
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    seqs = []
    for i in range(40):
        alphabet = rng.randrange(2, 9)
        seq = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
        if i % 5 == 0:  # a run (an overlapping copy drafts it)
            seq += [seq[-1]] * rng.randrange(1, 4)
        seqs.append(seq)
    width = max(map(len, seqs)) + pad
    hist = torch.randint(0, 9, (len(seqs), width), dtype=torch.int32)  # junk past the end
    for i, s in enumerate(seqs):
        hist[i, : len(s)] = torch.tensor(s, dtype=torch.int32)
    lens = torch.tensor([len(s) for s in seqs])
    drafts, found = lookup(hist, lens, k, min_n, max_n)
    hits = 0
    for i, s in enumerate(seqs):
        index = NgramIndex(min_n, max_n)
        index.sync(s)
        want = index.propose(k)
        assert bool(found[i]) == bool(want), (s, want)
        if want:
            hits += 1
            assert drafts[i].tolist() == want, (s, drafts[i].tolist(), want)
        else:
            assert drafts[i].tolist() == [s[-1]] * k
    assert hits > 10


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: Any) -> str:
    from tests.random_models import save_random_llama

    return save_random_llama(str(tmp_path_factory.mktemp("chain_llama")))


def _requests(vocab: int, stops: dict[str, int] | None) -> list[TokenizedGenerateReq]:
    """Prompts that repeat a pattern, greedy with outputs of every length, and two sampled."""
    rng = random.Random(5)
    reqs = []
    for i in range(7):
        pattern = [rng.randrange(2, vocab) for _ in range(rng.randrange(2, 7))]
        params: dict[str, Any] = {"temperature": 0, "ignore_eos": True,
                                  "max_new_tokens": [2, 3, 7, 16, 29, 40, 9][i]}
        if i >= 5:
            params.update(temperature=0.8, top_p=0.9)
        rid = f"c{i}"
        if stops and rid in stops:
            params["stop_token_ids"] = [stops[rid]]
        reqs.append(TokenizedGenerateReq(rid, pattern * 5 + pattern[:1], params,
                                         stream=i % 2 == 0))
    # this random model's greedy output after these runs into repeats, which drafts predict
    for i, start in enumerate((5, 9)):
        params = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 20 + 5 * i}
        if stops and f"run{i}" in stops:
            params["stop_token_ids"] = [stops[f"run{i}"]]
        reqs.append(TokenizedGenerateReq(f"run{i}", list(range(start, start + 3)) * 5, params))
    return reqs


def test_chained_steps_equal_decoding_without_drafts(llama_dir: str) -> None:
    plain = cpu_model_server(llama_dir)
    vocab = plain.config.vocab_size
    ids = serve(plain, _requests(vocab, None))["run1"][0]
    # a stop id of run1 after its repeats (which drafts predict)
    stops = {"run1": next(t for j, t in enumerate(ids) if j >= 8 and t not in ids[:j])}
    want = serve(plain, _requests(vocab, stops))
    spec = cpu_model_server(llama_dir, **SPEC)
    assert spec.chain is not None
    reqs = _requests(vocab, stops)
    got = serve(spec, reqs)
    assert_same(_greedy_only(got, reqs), _greedy_only(want, reqs))
    for rid in got:  # sampled requests: other draws, the same lengths
        assert got[rid][2] == want[rid][2], rid
    assert spec.chain.steps > 0
    s = spec.stats()["speculative"]
    assert s["verify_steps"] >= spec.chain.steps and s["accepted_tokens"] > 0, s
    assert any(want[rid][1]["type"] == "stop" for rid in stops)
    assert kv_is_free(spec)
    # without the overlapped loop nothing chains (a chain is an overlap)
    assert cpu_model_server(llama_dir, disable_overlap_schedule=True, **SPEC).chain is None
    # auto (the default) chains only where decode graphs are captured: not on the CPU
    assert cpu_model_server(llama_dir, speculative_algorithm="NGRAM").chain is None
    assert cpu_model_server(llama_dir, speculative_algorithm="NGRAM",
                            speculative_chain="off").chain is None


def test_smollm2_copy_prompt_chains(smollm2_dir: str, smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    reqs = lambda: [TokenizedGenerateReq("copy", _chat(tok, COPY[0]), {  # noqa: E731
        "temperature": 0, "max_new_tokens": 40, "stop": [" lens"]})]
    want = serve(cpu_model_server(smollm2_dir), reqs())
    spec = cpu_model_server(smollm2_dir, **SPEC)
    got = serve(spec, reqs())
    assert got["copy"][:3] == want["copy"][:3]
    assert got["copy"][1]["type"] == "stop"
    s = spec.stats()["speculative"]
    assert spec.chain.steps > 0 and s["accept_length"] > 2.0, s
    assert kv_is_free(spec)


def test_small_pool_retracts_around_chains(llama_dir: str) -> None:
    """Under a pool too small for every request's chained step, chains give way to plain
    steps that retract and resume requests: the tokens of a large pool, the pool whole."""
    reqs = lambda: [TokenizedGenerateReq(  # noqa: E731
        f"c{i}", ([7 + i, 40, 41, 42, 43] * 6)[: 20 + i], {"temperature": 0,
                                                         "max_new_tokens": 60,
                                                         "ignore_eos": True})
        for i in range(8)]
    want = serve(cpu_model_server(llama_dir), reqs())
    small = cpu_model_server(llama_dir, max_total_tokens=300, **SPEC)
    got = serve(small, reqs())
    assert small.stats()["retracted_reqs"] > 0 and small.chain.steps > 0
    assert {k: v[:3] for k, v in got.items()} == {k: v[:3] for k, v in want.items()}
    assert kv_is_free(small)
