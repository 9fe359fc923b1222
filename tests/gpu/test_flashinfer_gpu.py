"""FlashInfer backend against the torch backend at real sizes (GPU only), and its per-step index
arrays against the requests' req_to_token rows (runs anywhere)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srt.layers.attention.flashinfer_backend import build_kv_indices
from srt.layers.attention.torch_backend import TorchAttnBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode, forward_context
from srt.layers.radix_attention import RadixAttention
from srt.memory_pool import ReqToTokenPool, TokenToKVPool


def _batch(mode: ForwardMode, prefix: list[int], new: list[int], heads: int, kv_heads: int,
           d: int, dtype: torch.dtype, dev: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    bs = len(prefix)
    seqs = [p + n for p, n in zip(prefix, new)]
    size = sum(seqs) + 64
    req_pool = ReqToTokenPool(bs + 3, max(seqs) + 4, dev)
    kv_pool = TokenToKVPool(size, 1, kv_heads, d, dtype, dev)
    kv_pool.k_buffer[0].copy_(torch.randn(kv_pool.k_buffer[0].shape, generator=g).to(dtype))
    kv_pool.v_buffer[0].copy_(torch.randn(kv_pool.v_buffer[0].shape, generator=g).to(dtype))
    req_pool.req_to_token.copy_(torch.randint(0, size, req_pool.req_to_token.shape, generator=g))
    perm = torch.randperm(size, generator=g)
    rows = torch.randperm(bs + 3, generator=g)[:bs]
    off, locs = 0, []
    for i, s in enumerate(seqs):
        req_pool.req_to_token[rows[i], :s] = perm[off:off + s].to(dev, torch.int32)
        locs.append(perm[off + prefix[i]:off + s])
        off += s
    tokens = sum(new)
    q = torch.randn(tokens, heads * d, generator=g).to(dev, dtype)
    k = torch.randn(tokens, kv_heads * d, generator=g).to(dev, dtype)
    v = torch.randn(tokens, kv_heads * d, generator=g).to(dev, dtype)
    fb_args = dict(
        forward_mode=mode, batch_size=bs,
        input_ids=torch.zeros(tokens, dtype=torch.int64, device=dev),
        positions=torch.zeros(tokens, dtype=torch.int64, device=dev),
        out_cache_loc=torch.cat(locs).to(dev), req_pool_indices=rows.to(dev),
        seq_lens=torch.tensor(seqs, device=dev), seq_lens_cpu=seqs, prefix_lens_cpu=prefix,
        extend_lens_cpu=new, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool,
    )
    return q, k, v, fb_args


def test_build_kv_indices_matches_rows() -> None:
    q, k, v, args = _batch(ForwardMode.EXTEND, [3, 0, 17], [5, 9, 2], 4, 2, 16, torch.float32,
                           "cpu")
    fb = ForwardBatch(**args, attn_backend=None)
    indptr, indices = build_kv_indices(fb)
    assert indptr.tolist() == [0, 8, 17, 36]
    table = args["req_to_token_pool"].req_to_token
    expect = torch.cat([table[r, :s] for r, s in zip(args["req_pool_indices"].tolist(),
                                                     args["seq_lens_cpu"])])
    assert torch.equal(indices, expect.to(torch.int32))


CASES = [
    (ForwardMode.PREFILL, [0, 0, 0], [700, 33, 1200]),
    (ForwardMode.EXTEND, [1024, 0, 4096], [512, 77, 3]),
    (ForwardMode.DECODE, [511, 2047, 4095, 7, 1000], [1, 1, 1, 1, 1]),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,prefix,new", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flashinfer_matches_torch_backend(mode, prefix, new, dtype) -> None:
    pytest.importorskip("flashinfer")
    from srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    heads, kv_heads, d = 32, 8, 128
    q, k, v, args = _batch(mode, prefix, new, heads, kv_heads, d, dtype, "cuda")
    runner = SimpleNamespace(device=torch.device("cuda"), dtype=dtype,
                             config=SimpleNamespace(head_dim=d), max_running_requests=16,
                             max_total_num_tokens=1 << 16,
                             num_heads_per_rank=lambda: heads, model_kv_heads=lambda: kv_heads,
                             attn_scaling=lambda: d**-0.5)
    layer = RadixAttention(heads, d, d**-0.5, kv_heads, 0)
    outs = []
    for backend in (TorchAttnBackend(), FlashInferAttnBackend(runner)):
        fb = ForwardBatch(**args, attn_backend=backend)
        backend.init_forward_metadata(fb)
        with forward_context(fb):
            outs.append(layer(q, k, v).float())
    ref, got = outs
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err
