"""The one-shot all-reduce over symmetric memory (srt/layers/parallel_state.py) against NCCL on
two GPUs: bitwise equal sums for random tensors of several sizes and dtypes, called directly and
replayed from a CUDA graph with new inputs; larger tensors fall back to NCCL."""

from __future__ import annotations

import socket

import pytest

pytestmark = pytest.mark.gpu


def _rank(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from srt.layers import parallel_state as ps

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    ps.init_tp_group(rank, 2, device, port)
    for dtype in (torch.bfloat16, torch.float32):
        ps._one_shot = None
        assert ps.init_one_shot_all_reduce(64 << 10, dtype, device)
        g = torch.Generator(device=device).manual_seed(rank + 1)
        for numel in (8, 4096, 3 * 4096, (64 << 10) // dtype.itemsize, (64 << 10)):
            x = torch.randn(numel, generator=g, device=device).to(dtype)
            ref = x.clone()
            dist.all_reduce(ref)
            out = ps.all_reduce(x.clone())
            assert torch.equal(out, ref), (dtype, numel)
        # under a CUDA graph: captured once, replayed on fresh inputs
        static = torch.empty(2 * 4096, dtype=dtype, device=device)
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ps.all_reduce(static.normal_())  # warm-up outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                out = ps.all_reduce(static)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            static.copy_(torch.randn(static.shape, generator=g, device=device).to(dtype))
            ref = static.clone()
            dist.all_reduce(ref)
            graph.replay()
            assert torch.equal(out, ref), dtype
    torch.cuda.synchronize()
    dist.destroy_process_group()


def test_one_shot_all_reduce_equals_nccl() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port,), nprocs=2)
