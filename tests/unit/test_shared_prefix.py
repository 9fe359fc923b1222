"""A decode batch's shared prefix: the radix tree finds it, the Triton backend reads it once.

`shared_prefix_len` against brute force on a real RadixCache; then a small random Llama served
in-process with Triton attention (the interpreter on the CPU) with the shared stage forced on:
the same greedy ids as the torch backend, and the shared stage really ran over the prefix.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from srt.model_process.radix_cache import RadixCache, shared_prefix_len
from tests.unit.test_radix_cache import RecordingPool


def _slots(n: int, base: int) -> torch.Tensor:
    return torch.arange(base, base + n, dtype=torch.int64)


def test_shared_prefix_len_is_the_common_matched_prefix() -> None:
    rng = random.Random(0)
    for trial in range(200):
        cache = RadixCache(RecordingPool())
        common = [rng.randrange(3) for _ in range(rng.randrange(0, 8))]
        keys = [common + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
                for _ in range(rng.randrange(2, 6))]
        nodes = []
        for i, k in enumerate(keys):
            cache.insert(k, _slots(len(k), 100 * i))
        for k in keys:  # match after all inserts: later splits must not matter
            nodes.append(cache.match_prefix(k)[1])
        # brute force: the longest common prefix of the keys, every one fully cached
        want = 0
        while all(len(k) > want for k in keys) and len({k[want] for k in keys}) == 1:
            want += 1
        if any(len(k) == want for k in keys):  # a key that is a prefix of the others
            want = min(len(k) for k in keys)
        assert shared_prefix_len(nodes) == want, (trial, keys)
        # the slots of those positions are the same for every key
        slots = [cache.match_prefix(k)[0][:want].tolist() for k in keys]
        assert all(s == slots[0] for s in slots)


def test_shared_prefix_len_edge_cases() -> None:
    cache = RadixCache(RecordingPool())
    cache.insert([1, 2, 3, 4], _slots(4, 0))
    node = cache.match_prefix([1, 2, 3, 4])[1]
    assert shared_prefix_len([node, node, node]) == 4
    assert shared_prefix_len([node]) == 4
    assert shared_prefix_len([node, None]) == 0
    assert shared_prefix_len([]) == 0
    assert shared_prefix_len([node, cache.root]) == 0
    cache.insert([1, 2, 9], _slots(3, 10))  # splits the node under the first request
    other = cache.match_prefix([1, 2, 9])[1]
    assert shared_prefix_len([node, other]) == 2


def test_served_shared_prefix_matches_torch(tmp_path: Any, monkeypatch: Any) -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from srt.layers.attention import triton_backend
    from srt.managers.io_struct import TokenizedGenerateReq
    from tests.model_process import cpu_model_server, kv_is_free, serve_all
    from tests.random_models import save_random_llama

    model = save_random_llama(str(tmp_path / "llama"), num_hidden_layers=2, hidden_size=128,
                              intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2)
    prefix = [(7 * i + 3) % 250 + 2 for i in range(40)]
    suffixes = [[11, 12], [200, 5, 6], [77], [90, 91, 92, 93]]
    params = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}

    def reqs() -> list[TokenizedGenerateReq]:
        return [TokenizedGenerateReq(f"r{i}", prefix + s, dict(params))
                for i, s in enumerate(suffixes)]

    def ids(outs: dict[str, list[Any]]) -> dict[str, list[int]]:
        return {rid: [i for o in out for i in o.new_ids] for rid, out in outs.items()}

    want = ids(serve_all(cpu_model_server(model), reqs()))

    monkeypatch.setattr(triton_backend, "SHARED_PREFIX_MIN_SAVED_TOKENS", 1)
    seen: list[int] = []
    real = triton_backend.decode_attention_fwd

    def recording(*a: Any, **kw: Any) -> None:
        seen.append(kw.get("shared_len", 0))
        real(*a, **kw)

    monkeypatch.setattr(triton_backend, "decode_attention_fwd", recording)
    server = cpu_model_server(model, attention_backend="triton")
    # the start-up compile of the eager decode kernels writes nothing but scratch
    k0, v0 = (b.clone() for b in server.kv.pool.get_kv_buffer(0))
    rows = server.kv.req_pool.req_to_token.clone()
    server.runner.attn_backend.warm_up_eager_decode(server.kv.req_pool.req_to_token,
                                                    *server.kv.pool.get_kv_buffer(0))
    assert seen == [0, 1]
    seen.clear()
    # bit for bit (the pool's unwritten slots may hold NaN, which == would never match)
    assert torch.equal(k0.view(torch.int32), server.kv.pool.get_kv_buffer(0)[0].view(torch.int32))
    assert torch.equal(v0.view(torch.int32), server.kv.pool.get_kv_buffer(0)[1].view(torch.int32))
    assert torch.equal(rows, server.kv.req_pool.req_to_token)
    got = ids(serve_all(server, reqs()))
    assert got == want
    assert seen and max(seen) == len(prefix), seen  # the whole prompt prefix read once
    assert kv_is_free(server)
