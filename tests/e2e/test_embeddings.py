"""Embeddings through the real server (`--is-embedding`), float32 on the CPU, small random Llama
checkpoints with a sentence-transformers configuration: the last token's state normalized
(Qwen3-Embedding's way) and the mean over the prompt without normalizing. Each vector equals
transformers' pooled last hidden state (after the final norm) within 1e-5 and cosine 0.99999:
through the official `openai` client (a string, a list, token ids, base64, `dimensions`) and
SGLang's /encode; over a cached prefix; with the prompt in chunks (the mean summed over them);
at --tp-size 2 (gloo). A text route of an embedding server, and /v1/embeddings of a text server,
are 400s that say which flag serves them."""

from __future__ import annotations

import base64
import json
import os
from typing import Any

import numpy as np
import openai
import pytest
import requests

from tests.conftest import ServerProcess
from tests.random_models import save_random_llama

IDS = [[5, 17, 99, 3, 42, 7, 250, 31], [8, 64, 11, 300, 2, 9], [5, 17, 99, 3, 42, 12, 13]]


def _save(path: str, mode: str, normalize: bool) -> str:
    save_random_llama(path, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": 64, "pooling_mode_lasttoken": mode == "last",
                   "pooling_mode_mean_tokens": mode == "mean"}, f)
    return path


def _reference(path: str, ids: list[int], mode: str, normalize: bool) -> np.ndarray:
    import torch
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0]
    v = h[-1] if mode == "last" else h.mean(0)
    if normalize:
        v = v / v.norm()
    return v.numpy().astype(np.float64)


def _close(got: Any, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5, np.abs(got - want).max()
    assert got @ want / (np.linalg.norm(got) * np.linalg.norm(want)) >= 0.99999


@pytest.fixture(scope="module")
def models(tmp_path_factory: Any) -> dict[str, str]:
    return {"last": _save(str(tmp_path_factory.mktemp("emb_last")), "last", True),
            "mean": _save(str(tmp_path_factory.mktemp("emb_mean")), "mean", False)}


def _serve(path: str, *extra: str) -> ServerProcess:
    return ServerProcess(["--model-path", path, "--device", "cpu", "--dtype", "float32",
                          "--max-total-tokens", "512", *extra]).start()


def test_last_token_normalized_through_openai(models: dict[str, str]) -> None:
    path = models["last"]
    want = [_reference(path, ids, "last", True) for ids in IDS]
    srv = _serve(path, "--is-embedding")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        one = client.embeddings.create(model=model, input=IDS[0])
        _close(one.data[0].embedding, want[0])
        assert one.usage.prompt_tokens == len(IDS[0]) and one.object == "list"
        many = client.embeddings.create(model=model, input=IDS)
        assert [d.index for d in many.data] == [0, 1, 2]
        for d, w in zip(many.data, want):
            _close(d.embedding, w)  # IDS[2] shares IDS[0]'s first 5 tokens: a cached prefix
        assert srv.server_info()["cache_hit_rate"] > 0
        # base64: the float32 bytes (the client decodes them itself when it asks)
        raw = requests.post(srv.url + "/v1/embeddings", json={
            "model": model, "input": IDS[1], "encoding_format": "base64"}, timeout=60).json()
        _close(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"), want[1])
        cut = client.embeddings.create(model=model, input=IDS[1], dimensions=8)
        _close(cut.data[0].embedding, want[1][:8] / np.linalg.norm(want[1][:8]))
        # text, tokenized as /generate does
        words = " ".join(f"t{i}" for i in IDS[1])
        ids = requests.post(srv.url + "/tokenize", json={"prompt": words}, timeout=60).json()
        text = client.embeddings.create(model=model, input=words)
        _close(text.data[0].embedding, _reference(path, ids["tokens"], "last", True))
        # SGLang's /encode
        enc = requests.post(srv.url + "/encode", json={"input_ids": IDS}, timeout=60).json()
        for e, w in zip(enc, want):
            _close(e["embedding"], w)
            assert e["meta_info"]["prompt_tokens"] > 0
        # errors: a text route, too many dimensions, an empty input
        r = requests.post(srv.url + "/generate", json={"input_ids": IDS[0]}, timeout=60)
        assert r.status_code == 400 and "--is-embedding" in r.text, r.text
        for bad in ({"dimensions": 65}, {"input": ""}, {"encoding_format": "int8"}):
            r = requests.post(srv.url + "/v1/embeddings",
                              json={"model": model, "input": IDS[0], **bad}, timeout=60)
            assert r.status_code == 400, (bad, r.text)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def test_mean_over_chunks_and_tp2(models: dict[str, str]) -> None:
    """The mean over a prompt computed in chunks of 3 (summed chunk by chunk, every token
    computed even where the radix cache holds a prefix); and at --tp-size 2."""
    path = models["mean"]
    want = [_reference(path, ids, "mean", False) for ids in IDS]
    srv = _serve(path, "--is-embedding", "--chunked-prefill-size", "3")
    try:
        for _ in range(2):  # the second time over cached prefixes
            enc = requests.post(srv.url + "/encode", json={"input_ids": IDS}, timeout=60).json()
            for e, w in zip(enc, want):
                _close(e["embedding"], w)
        srv.assert_kv_invariant()
    finally:
        srv.stop()
    srv = _serve(models["last"], "--is-embedding", "--tp-size", "2")
    try:
        enc = requests.post(srv.url + "/encode", json={"input_ids": IDS[0]}, timeout=60).json()
        _close(enc["embedding"], _reference(models["last"], IDS[0], "last", True))
    finally:
        srv.stop()


def test_text_server_refuses_embeddings(models: dict[str, str]) -> None:
    srv = _serve(models["last"])
    try:
        r = requests.post(srv.url + "/v1/embeddings", json={"model": "default", "input": "t5"},
                          timeout=60)
        assert r.status_code == 400 and "--is-embedding" in r.text, r.text
    finally:
        srv.stop()
