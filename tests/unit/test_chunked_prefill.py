"""Chunked prefill (`--chunked-prefill-size`) and mixed steps (`--enable-mixed-chunk`) on a model
process stepped in this process, float32 on the CPU.

With a chunk of 64 tokens, prompts of 1x, 3x and 10.5x the chunk give transformers' greedy
tokens and prompt / output logprobs (SmolLM2), with and without mixing, and equal the unchunked
server's outputs; so do a prompt behind a cached prefix, a regex request, two samples of one
prompt, requests retracted under a small pool, and (a small random LLaVA) an image whose span
crosses chunk borders. After every run the KV pool is whole again (every slot free or
evictable, no lock, every row free).
"""

from __future__ import annotations

import random
import re
from typing import Any

import numpy as np
import pytest
import torch

from srt.managers.image_processor import to_image_input
from srt.managers.io_struct import LogprobOptions, TokenizedGenerateReq
from srt.model_process.loop import ModelProcess
from tests.model_process import cpu_model_server, kv_is_free
from tests.overlap_cases import serve

CHUNK = 64
NEW = 6
TOL = 1e-4


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 5000) for _ in range(n)]


def _greedy(n: int = NEW, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_new_tokens": n, "ignore_eos": True, **extra}


def _server(path: str, chunk: int, mixed: bool = False, **args: Any) -> ModelProcess:
    return cpu_model_server(path, chunked_prefill_size=chunk, enable_mixed_chunk=mixed, **args)


def _serve(server: ModelProcess, reqs: list[TokenizedGenerateReq]) -> dict[str, Any]:
    """rid -> (ids, finish reason, completion tokens, output logprobs, prompt logprobs, cached
    tokens); the KV pool is whole afterwards."""
    res = serve(server, reqs)
    assert kv_is_free(server)
    return res


def _assert_same(got: dict[str, Any], want: dict[str, Any], cached: bool = True) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        g, w = got[rid], want[rid]
        assert g[:2] == w[:2], (rid, g[:2], w[:2])
        if cached:
            assert g[5] == w[5], (rid, g[5], w[5])
        assert g[3] == pytest.approx(w[3], abs=TOL), rid
        assert len(g[4]) == len(w[4]), rid
        assert [x if x is not None else 0.0 for x in g[4]] == pytest.approx(
            [x if x is not None else 0.0 for x in w[4]], abs=TOL), rid


@pytest.fixture(scope="module")
def plain(smollm2_dir: str) -> ModelProcess:
    return _server(smollm2_dir, -1)


@pytest.fixture(scope="module")
def chunked(smollm2_dir: str) -> ModelProcess:
    return _server(smollm2_dir, CHUNK)


@pytest.fixture(scope="module")
def mixed(smollm2_dir: str) -> ModelProcess:
    return _server(smollm2_dir, CHUNK, mixed=True)


def _flushed(server: ModelProcess) -> ModelProcess:
    server.kv.tree.reset()
    server.reset_stats()
    return server


LENGTHS = {"x1": CHUNK, "x3": 3 * CHUNK, "x10.5": CHUNK * 21 // 2}


def _length_requests() -> list[TokenizedGenerateReq]:
    lp = LogprobOptions(logprob_start_len=0, top_logprobs_num=2)
    return [TokenizedGenerateReq(rid, _ids(n, seed), _greedy(), logprob=lp)
            for seed, (rid, n) in enumerate(LENGTHS.items())]


@pytest.mark.parametrize("mode", ["chunked", "mixed"])
def test_chunks_equal_transformers(mode: str, plain: ModelProcess, chunked: ModelProcess,
                                   mixed: ModelProcess, smollm2_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    server = _flushed(chunked if mode == "chunked" else mixed)
    got = _serve(server, _length_requests())
    stats = server.stats()
    # 1 + 3 + 11 chunks of at most 64 tokens: every prompt but the first was cut
    assert stats["prefill_chunks"] >= 2 + 10, stats["prefill_chunks"]
    if mode == "mixed":  # the short request decoded inside the long one's chunks
        assert stats["mixed_fill_steps"] > 0
    _assert_same(got, _serve(_flushed(plain), _length_requests()))

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, torch_dtype=torch.float32).eval()
    for r in _length_requests():
        ids, _, _, out_lp, in_lp, _ = got[r.rid]
        seq = list(r.input_ids)
        with torch.no_grad():
            for _ in range(NEW):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            ref = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
        assert ids == seq[len(r.input_ids):], r.rid
        n = len(r.input_ids)
        want_in = [ref[p - 1, seq[p]].item() for p in range(1, n)]
        want_out = [ref[p - 1, seq[p]].item() for p in range(n, len(seq))]
        assert in_lp[0] is None and len(in_lp) == n
        assert in_lp[1:] == pytest.approx(want_in, abs=TOL), r.rid
        assert out_lp == pytest.approx(want_out, abs=TOL), r.rid


def test_cached_prefix_then_chunks(plain: ModelProcess, chunked: ModelProcess) -> None:
    """A prompt whose first 150 tokens are cached computes the rest in chunks (from a border
    inside a chunk), and one whose prompt starts a logprob range inside a later chunk."""
    base = _ids(150, 7)

    def run(server: ModelProcess) -> dict[str, Any]:
        _flushed(server)
        first = _serve(server, [TokenizedGenerateReq("a", base, _greedy())])
        second = _serve(server, [
            TokenizedGenerateReq("b", base + _ids(300, 8), _greedy()),
            TokenizedGenerateReq("c", base + _ids(200, 9), _greedy(),
                                 logprob=LogprobOptions(logprob_start_len=230,
                                                        top_logprobs_num=1))])
        return {**first, **second}

    got, want = run(chunked), run(plain)
    assert got["b"][5] >= 150 and got["c"][5] >= 150
    assert len(got["c"][4]) == 350 - 230
    _assert_same(got, want)


def test_regex_and_two_samples(plain: ModelProcess, mixed: ModelProcess,
                               smollm2_tokenizer: Any) -> None:
    pattern = r"The answer is (yes|no)\."
    prompt = smollm2_tokenizer.encode("Read this. " * 70 + "Is the sky blue?")
    assert len(prompt) > 3 * CHUNK

    def reqs() -> list[TokenizedGenerateReq]:
        return [TokenizedGenerateReq("regex", prompt, _greedy(16, regex=pattern)),
                *[TokenizedGenerateReq(f"g-{k}", _ids(5 * CHUNK + 10, 11), _greedy(8),
                                       group="g") for k in range(2)],
                TokenizedGenerateReq("short", _ids(20, 12), _greedy(40))]

    got = _serve(_flushed(mixed), reqs())
    text = smollm2_tokenizer.decode(got["regex"][0])
    assert re.fullmatch(pattern, text), text
    assert got["g-0"][0] == got["g-1"][0]
    # the second sample waited for the first one's chunks and reused all of its prompt
    assert max(got["g-0"][5], got["g-1"][5]) >= 5 * CHUNK
    _assert_same(got, _serve(_flushed(plain), reqs()), cached=False)


def test_retraction_under_a_small_pool(smollm2_dir: str, plain: ModelProcess) -> None:
    def reqs() -> list[TokenizedGenerateReq]:
        return [TokenizedGenerateReq(f"r{i}", _ids(100 + 30 * i, 20 + i), _greedy(40))
                for i in range(6)]

    for mix in (False, True):
        small = _server(smollm2_dir, 48, mixed=mix, max_total_tokens=900,
                        schedule_conservativeness=0.05)
        got = _serve(small, reqs())
        stats = small.stats()
        assert stats["retracted_reqs"] > 0 and stats["prefill_chunks"] > 0, stats
        _assert_same(got, _serve(_flushed(plain), reqs()), cached=False)


def test_radix_cache_off(smollm2_dir: str, plain: ModelProcess) -> None:
    server = _server(smollm2_dir, CHUNK, mixed=True, disable_radix_cache=True)
    got = _serve(server, _length_requests())
    assert server.stats()["prefill_chunks"] > 0
    _assert_same(got, _serve(_flushed(plain), _length_requests()), cached=False)


def test_abort_between_chunks(chunked: ModelProcess) -> None:
    from srt.managers.io_struct import AbortReq, StepInput

    server = _flushed(chunked)
    out = server.step(StepInput(reqs=[TokenizedGenerateReq("long", _ids(5 * CHUNK, 30),
                                                           _greedy())]))
    assert out.token_out is None and any(r.prefilling for r in server.waiting)
    out = server.step(StepInput(aborts=[AbortReq("long")]))
    assert out.token_out.outs[0].finish_reason["type"] == "abort"
    assert not server.waiting and kv_is_free(server)


# ---------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: Any, smollm2_dir: str) -> str:
    from tests.random_models import save_random_llava

    return save_random_llava(str(tmp_path_factory.mktemp("llava-chunks")), smollm2_dir,
                             image_size=56)


def test_image_span_across_chunk_borders(llava_dir: str) -> None:
    """16 image positions from prompt position 5 on, chunks of 8: the span crosses two chunk
    borders; greedy ids and every prompt logprob (image positions too) equal the unchunked
    run's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llava_dir)
    image_id = tok.convert_tokens_to_ids("<image>")
    pixels = np.random.default_rng(0).normal(size=(3, 56, 56)).astype(np.float32)
    image = to_image_input(pixels)
    prompt = _ids(5, 40) + [image_id] + _ids(20, 41)
    lp = LogprobOptions(logprob_start_len=0)

    def run(chunk: int) -> dict[str, Any]:
        server = _server(llava_dir, chunk, mixed=True)
        got = _serve(server, [
            TokenizedGenerateReq("img", prompt, _greedy(8), logprob=lp, image=image),
            TokenizedGenerateReq("text", _ids(12, 42), _greedy(12))])
        return got, server.stats()["prefill_chunks"]

    (got, chunks), (want, none) = run(8), run(-1)
    assert chunks >= 4 and none == 0
    assert len(got["img"][4]) == len(prompt) - 1 + 16
    _assert_same(got, want)


# ---------------------------------------------------------------------------- Triton


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: Any) -> str:
    from tests.random_models import save_random_llama

    return save_random_llama(str(tmp_path_factory.mktemp("chunks-triton")), num_hidden_layers=2,
                             hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=600)


def test_triton_mixed_steps_decode_rows_through_the_decode_kernel(
        tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton attention (interpreted on the CPU): mixed steps compute their running requests'
    tokens with the decode kernel and the chunks with the extend kernel; the greedy ids and
    logprobs equal the torch backend's without chunking."""
    def reqs() -> list[TokenizedGenerateReq]:
        rng = random.Random(50)
        lp = LogprobOptions(logprob_start_len=0, top_logprobs_num=1)
        out = [TokenizedGenerateReq(f"s{i}", [rng.randrange(600) for _ in range(6 + i)],
                                    _greedy(12), logprob=lp if i == 1 else None)
               for i in range(3)]
        out.append(TokenizedGenerateReq("long", [rng.randrange(600) for _ in range(70)],
                                        _greedy(3), logprob=lp))
        return out

    triton = _server(tiny_llama, 16, mixed=True, attention_backend="triton")
    assert triton.runner.attn_backend.supports_decode_tail
    got = _serve(triton, reqs())
    assert triton.stats()["mixed_fill_steps"] >= 3
    want = _serve(_server(tiny_llama, -1), reqs())
    _assert_same(got, want, cached=False)
    # Per-step backends: a mixed step's chunks through the prefill backend, its decode rows
    # through the decode backend (each planned on its own part of the step).
    import srt.layers.attention.hybrid_backend as hybrid_backend

    splits: list[int] = []
    real_split = hybrid_backend.split_mixed
    monkeypatch.setattr(hybrid_backend, "split_mixed",
                        lambda fb: splits.append(fb.decode_tail) or real_split(fb))
    hybrid = _server(tiny_llama, 16, mixed=True, attention_backend="torch",
                     decode_attention_backend="triton")
    assert hybrid.runner.attn_backend.supports_decode_tail
    got = _serve(hybrid, reqs())
    assert hybrid.stats()["mixed_fill_steps"] >= 3
    assert len(splits) >= 3 and min(splits) >= 1, splits
    _assert_same(got, want, cached=False)
