"""Speculative decoding through the real server: NGRAM, STANDALONE and EAGLE3 (chains and
trees) at --tp-size 2 (gloo) give transformers' greedy tokens and logprobs on a random Llama with prompts that repeat
(most drafts accepted); meta_info, /get_server_info and /metrics report it; the OpenAI client
works unchanged; combinations srt does not support are refused at start-up."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import openai
import pytest
import requests
import torch

from tests.conftest import REPO, ServerProcess
from tests.random_models import save_random_llama

PATTERNS = [[5, 17, 99, 3, 42], [7, 250, 31, 64, 11, 8], [300, 12, 77]]
PROMPTS = [p * 4 + p[:2] for p in PATTERNS]
NEW = 32


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: Any) -> str:
    return save_random_llama(str(tmp_path_factory.mktemp("spec_serving")), num_hidden_layers=4,
                             hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=4, init_std=0.04)  # outputs with long runs


def _transformers(path: str) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy ids and the log-softmax of each chosen token, per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # as ignore_eos
    ids, lps = [], []
    with torch.no_grad():
        for p in PROMPTS:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            new = out.sequences[0, len(p):].tolist()
            ids.append(new)
            lps.append([torch.log_softmax(s[0].float(), -1)[t].item()
                        for s, t in zip(out.logits, new)])
    return ids, lps


def _greedy_meta(srv: ServerProcess, want_ids: list[list[int]],
                 want_lps: list[list[float]]) -> list[dict[str, Any]]:
    """Greedy outputs of PROMPTS with logprobs, checked against transformers'; their
    meta_info."""
    res = srv.generate({"input_ids": PROMPTS, "return_logprob": True, "sampling_params": {
        "temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})
    assert [r["output_ids"] for r in res] == want_ids
    for r, lp in zip(res, want_lps):
        assert [t[0] for t in r["meta_info"]["output_token_logprobs"]] == pytest.approx(
            lp, abs=1e-4)
    return [r["meta_info"] for r in res]


def test_ngram_tp2_equals_transformers(llama_dir: str) -> None:
    want_ids, want_lps = _transformers(llama_dir)
    srv = ServerProcess(["--model-path", llama_dir, "--tp-size", "2", "--device", "cpu",
                         "--dtype", "float32", "--random-seed", "0", "--max-total-tokens",
                         "2048", "--speculative-algorithm", "NGRAM"]).start()
    try:
        meta = _greedy_meta(srv, want_ids, want_lps)
        assert all(m["spec_verify_ct"] > 0 for m in meta), meta
        assert max(m["spec_accept_length"] for m in meta) > 2, meta
        assert all(m["spec_accept_token_num"] <= m["spec_draft_token_num"] for m in meta)
        assert all(m["forward_passes"] == 1 + m["spec_verify_ct"] for m in meta), meta
        info = srv.server_info()["speculative"]
        assert info["algorithm"] == "NGRAM" and info["accepted_tokens"] > 0, info
        metrics = requests.get(srv.url + "/metrics", timeout=30).text
        assert "srt_spec_accept_length" in metrics
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        c = client.completions.create(model=llama_dir, prompt=PROMPTS[0], max_tokens=NEW,
                                      temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True})
        assert c.usage.completion_tokens == NEW and len(c.choices[0].logprobs.tokens) == NEW
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def test_standalone_tp2_equals_transformers(llama_dir: str, tmp_path: Any) -> None:
    """A draft of the target's first two layers (its embeddings, norm and head) at --tp-size 2:
    transformers' greedy ids and logprobs; drafts verified and some accepted."""
    from benchmarks.common import save_layer_prefix

    draft = save_layer_prefix(llama_dir, str(tmp_path / "draft"), 2)
    want_ids, want_lps = _transformers(llama_dir)
    srv = ServerProcess(["--model-path", llama_dir, "--tp-size", "2", "--device", "cpu",
                         "--dtype", "float32", "--random-seed", "0", "--max-total-tokens",
                         "2048", "--speculative-algorithm", "STANDALONE",
                         "--speculative-draft-model-path", draft,
                         "--speculative-num-steps", "3"]).start()
    try:
        meta = _greedy_meta(srv, want_ids, want_lps)
        assert all(m["spec_verify_ct"] > 0 for m in meta), meta
        assert sum(m["spec_accept_token_num"] for m in meta) > 0, meta
        info = srv.server_info()["speculative"]
        assert info["algorithm"] == "STANDALONE" and info["num_draft_tokens"] == 4, info
        srv.assert_kv_invariant()
    finally:
        srv.stop()


@pytest.mark.parametrize("tree", [[], ["--speculative-eagle-topk", "3",
                                       "--speculative-num-draft-tokens", "8"]],
                         ids=["chain", "tree"])
def test_eagle3_tp2_equals_transformers(llama_dir: str, tmp_path: Any, tree: list[str]) -> None:
    """A random EAGLE3 head (its own LM head over 300 ids, d2t) at --tp-size 2, drafting
    chains or trees of top-k 3 (7 nodes, in scratch rows on both ranks): transformers' greedy
    ids and logprobs with drafts verified every step."""
    from tests.eagle_heads import save_eagle_head

    head, _ = save_eagle_head(str(tmp_path / "head"), llama_dir, "EAGLE3",
                              eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]})
    want_ids, want_lps = _transformers(llama_dir)
    srv = ServerProcess(["--model-path", llama_dir, "--tp-size", "2", "--device", "cpu",
                         "--dtype", "float32", "--random-seed", "0", "--max-total-tokens",
                         "2048", "--speculative-algorithm", "EAGLE3",
                         "--speculative-draft-model-path", head, *tree]).start()
    try:
        meta = _greedy_meta(srv, want_ids, want_lps)
        assert all(m["spec_verify_ct"] > 0 and m["spec_draft_token_num"] > 0 for m in meta), meta
        info = srv.server_info()["speculative"]
        assert info["algorithm"] == "EAGLE3" and info["num_draft_tokens"] == (8 if tree else 4)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


@pytest.mark.parametrize("flags,message", [
    (["--speculative-algorithm", "EAGLE"], "needs --speculative-draft-model-path (an EAGLE"),
    (["--speculative-algorithm", "STANDALONE"], "needs --speculative-draft-model-path"),
    (["--speculative-num-draft-tokens", "4"], "needs --speculative-algorithm"),
    (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "/x"],
     "does not apply"),
])
def test_unsupported_combinations_are_refused(flags: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "srt.server", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr + proc.stdout
