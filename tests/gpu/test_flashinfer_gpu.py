"""FlashInfer backend against the torch backend at real sizes (GPU only), on a model-dtype pool
and on an FP8 pool with per-tensor scales other than 1 (eager and in a captured CUDA graph), and
its per-step index arrays against the requests' req_to_token rows (runs anywhere)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srt.layers.attention.flashinfer_backend import build_kv_indices
from srt.layers.attention.torch_backend import TorchAttnBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode, forward_context
from srt.layers.kv_cache_dtype import quantize_kv
from srt.layers.radix_attention import RadixAttention
from srt.memory_pool import ReqToTokenPool, TokenToKVPool


def _batch(mode: ForwardMode, prefix: list[int], new: list[int], heads: int, kv_heads: int,
           d: int, dtype: torch.dtype, dev: str, seed: int = 0,
           kv_dtype: torch.dtype | None = None, scales: tuple[float, float] = (1.0, 1.0)):
    """Random q/k/v of this step and a pool of random context (in `kv_dtype`, quantized with
    `scales` when that is FP8), requests in shuffled req_to_token rows over shuffled slots."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    bs = len(prefix)
    seqs = [p + n for p, n in zip(prefix, new)]
    size = sum(seqs) + 64
    req_pool = ReqToTokenPool(bs + 3, max(seqs) + 4, dev)
    kv_dtype = kv_dtype or dtype
    kv_pool = TokenToKVPool(size, 1, kv_heads, d, kv_dtype, dev)
    for buf, scale in ((kv_pool.k_buffer[0], scales[0]), (kv_pool.v_buffer[0], scales[1])):
        x = torch.randn(buf.shape, generator=g)
        buf.copy_(quantize_kv(x, scale, kv_dtype) if kv_dtype.itemsize == 1 else x.to(dtype))
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
    k = (torch.randn(tokens, kv_heads * d, generator=g) * scales[0]).to(dev, dtype)
    v = (torch.randn(tokens, kv_heads * d, generator=g) * scales[1]).to(dev, dtype)
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
    runner = _runner(dtype, dtype, heads, kv_heads, d)
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


def _runner(dtype: torch.dtype, kv_dtype: torch.dtype, heads: int, kv_heads: int, d: int):
    """What FlashInferAttnBackend reads of a ModelRunner."""
    return SimpleNamespace(device=torch.device("cuda"), dtype=dtype, kv_cache_dtype=kv_dtype,
                           config=SimpleNamespace(head_dim=d), max_running_requests=16,
                           max_total_num_tokens=1 << 16,
                           num_heads_per_rank=lambda: heads, model_kv_heads=lambda: kv_heads,
                           attn_scaling=lambda: d**-0.5)


# (k_scale, v_scale): 1, and scales that put the N(0, 1) context near the top of e4m3's range
# (a kernel that forgets a scale is off by a factor of ~100)
FP8_SCALES = [(1.0, 1.0), (0.011, 0.0093)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,prefix,new", CASES)
@pytest.mark.parametrize("scales", FP8_SCALES, ids=str)
@pytest.mark.parametrize("dtype,kv_dtype", [  # each pair is a kernel FlashInfer compiles
    (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2),
    (torch.float16, torch.float8_e4m3fn)], ids=str)
def test_flashinfer_fp8_pool_matches_torch_backend(mode, prefix, new, scales, dtype,
                                                   kv_dtype) -> None:
    """Both backends read the same FP8 pool (this step's K/V quantized into it by the layer):
    FlashInfer's dequantization (k_scale folded into the softmax scale, v_scale on the output)
    must equal the torch backend's (stored * scale, then attention in the model dtype)."""
    pytest.importorskip("flashinfer")
    from srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    heads, kv_heads, d = 32, 8, 128
    q, k, v, args = _batch(mode, prefix, new, heads, kv_heads, d, dtype, "cuda",
                           kv_dtype=kv_dtype, scales=scales)
    layer = RadixAttention(heads, d, d**-0.5, kv_heads, 0)
    layer.k_scale, layer.v_scale = scales
    outs = []
    for backend in (TorchAttnBackend(),
                    FlashInferAttnBackend(_runner(dtype, kv_dtype, heads, kv_heads, d))):
        fb = ForwardBatch(**args, attn_backend=backend)
        backend.init_forward_metadata(fb)
        with forward_context(fb):
            outs.append(layer(q, k, v).float())
    ref, got = outs
    assert ref.isfinite().all()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-2, err


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_flashinfer_decode_in_cuda_graph(kv_dtype) -> None:
    """Decode captured in a CUDA graph with the backend's graph hooks, replayed on a second
    batch of the same size (new lengths, rows and contents): equal to the torch backend's eager
    result, on a bf16 and on an FP8 pool with scales other than 1."""
    pytest.importorskip("flashinfer")
    from srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    heads, kv_heads, d, dtype = 32, 8, 128, torch.bfloat16
    scales = (0.011, 0.0093) if kv_dtype.itemsize == 1 else (1.0, 1.0)
    layer = RadixAttention(heads, d, d**-0.5, kv_heads, 0)
    layer.k_scale, layer.v_scale = scales
    backend = FlashInferAttnBackend(_runner(dtype, kv_dtype, heads, kv_heads, d))
    batches = [_batch(ForwardMode.DECODE, prefix, [1] * 4, heads, kv_heads, d, dtype, "cuda",
                      seed=seed, kv_dtype=kv_dtype, scales=scales)
               for seed, prefix in ((1, [100, 7, 3000, 511]), (2, [2047, 64, 5, 1200]))]
    assert batches[1][3]["token_to_kv_pool"].size <= batches[0][3]["token_to_kv_pool"].size
    # the graph reads fixed buffers: inputs and pools are copied into those of the first batch
    q0, k0, v0, args0 = batches[0]
    fb = ForwardBatch(**args0, attn_backend=backend)
    backend.init_cuda_graph_capture(fb)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), forward_context(fb):
        layer(q0, k0, v0)  # warm-up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), forward_context(fb):
        out = layer(q0, k0, v0)
    for q, k, v, args in batches:
        ref_backend = TorchAttnBackend()
        ref_fb = ForwardBatch(**args, attn_backend=ref_backend)
        ref_backend.init_forward_metadata(ref_fb)
        with forward_context(ref_fb):
            ref = layer(q, k, v).float()
        if args is not args0:
            # the graph reads the first batch's buffers: this batch's pool, rows and inputs
            # are copied into them (its slots and rows fit: the first pool is the larger)
            for name in ("k_buffer", "v_buffer"):
                src = getattr(args["token_to_kv_pool"], name)[0]
                getattr(args0["token_to_kv_pool"], name)[0][: src.shape[0]].copy_(src)
            req0 = args0["req_to_token_pool"].req_to_token
            req = args["req_to_token_pool"].req_to_token
            req0[: req.shape[0], : req.shape[1]].copy_(req)
            for name in ("out_cache_loc", "req_pool_indices", "seq_lens"):
                args0[name].copy_(args[name])
            for dst, src in ((q0, q), (k0, k), (v0, v)):
                dst.copy_(src)
        replay_fb = ForwardBatch(**dict(args0, seq_lens_cpu=args["seq_lens_cpu"],
                                        prefix_lens_cpu=args["prefix_lens_cpu"]),
                                 attn_backend=backend)
        backend.init_cuda_graph_replay(replay_fb)
        out.fill_(float("nan"))
        graph.replay()
        err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, err
