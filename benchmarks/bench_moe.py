"""The fused Triton MoE kernel against the torch expert loop and against its floors.

    python3 benchmarks/bench_moe.py                      # Mixtral-8x7B experts, bf16, on a GPU
    python3 benchmarks/bench_moe.py --sweep --out moe.json
    python3 benchmarks/bench_moe.py --hidden 64 --inter 96 --tokens 1 16   # CPU (interpreter)
    python3 benchmarks/bench_moe.py --configs 128,256,64,8,4 16,128,128,4,2 --breakdown

For each token count: the routing of random router logits (top 2 of 8, renormalized), the time
of `fused_moe_triton` with the tile sizes it picks, of `moe_forward_torch` (one pair of matmuls
per active expert), and the floor: max(bytes of the active experts' weights / copy bandwidth,
FLOPs / matmul rate), both measured in the same run. With `--sweep`, every tile configuration
of a small grid is timed too and the best is reported beside the default's.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from benchmarks.common import (  # noqa: E402
    copy_bandwidth, cuda_time_ms, default_device, hardware, matmul_rate, print_table, write_json)
import triton  # noqa: E402

from srt.layers import moe_triton  # noqa: E402
from srt.layers.fused_triton import silu_and_mul  # noqa: E402
from srt.layers.moe import moe_forward_torch, route_topk  # noqa: E402
from srt.layers.moe_triton import TileConfig, fused_moe_triton, tile_config  # noqa: E402

SWEEP = [TileConfig(m, n, k, w, s) for m in (16, 32, 64, 128)
         for n, k in ((64, 64), (64, 128), (128, 64), (128, 128)) for w, s in ((4, 3), (8, 3),
                                                                             (8, 4))]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=14336, help="intermediate size per rank")
    p.add_argument("--sweep", action="store_true", help="also time a grid of tile configs")
    p.add_argument("--group-m", type=int, nargs="*", default=[],
                   help="also time the picked tiles with these row-block groups "
                   "(moe_triton.GROUP_M; 1048576: every row block per column block, the "
                   "order before grouping)")
    p.add_argument("--configs", nargs="*", default=[], metavar="M,N,K,WARPS,STAGES",
                   help="also time these tile configurations at every token count")
    p.add_argument("--breakdown", action="store_true",
                   help="also time the pieces of the picked configuration: the expert "
                   "layout, the gate/up product, SiLU-and-mul, the down product, the sum")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    explicit = [TileConfig(*(int(v) for v in c.split(","))) for c in a.configs]
    device = default_device()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bw, rate = copy_bandwidth(device), matmul_rate(device)
    g = torch.Generator(device=device).manual_seed(0)
    e, h, i = a.experts, a.hidden, a.inter
    w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) * h**-0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g, device=device) * i**-0.5).to(dtype)
    expert_bytes = 3 * h * i * w13.element_size()
    rows = []
    for t in a.tokens:
        x = torch.randn(t, h, generator=g, device=device).to(dtype)
        weights, ids = route_topk(torch.randn(t, e, generator=g, device=device), a.top_k)
        active = int(ids.unique().numel())
        bytes_ms = active * expert_bytes / bw * 1e3
        flops_ms = 2 * t * a.top_k * 3 * h * i / rate * 1e3
        floor = max(bytes_ms, flops_ms)
        cfg = tile_config(t * a.top_k, e)
        fused = cuda_time_ms(lambda: fused_moe_triton(x, w13, w2, weights, ids))
        ref = cuda_time_ms(lambda: moe_forward_torch(x, w13, w2, weights, ids))
        row = {"tokens": t, "active_experts": active, "floor_ms": floor,
               "bound": "bytes" if bytes_ms >= flops_ms else "flops", "triton_ms": fused,
               "torch_ms": ref, "floor_pct": 100 * floor / fused, "vs_torch": ref / fused,
               "config": _name(cfg)}
        for gm in a.group_m:
            default_gm, moe_triton.GROUP_M = moe_triton.GROUP_M, gm
            row[f"group_m_{gm}_ms"] = cuda_time_ms(
                lambda: fused_moe_triton(x, w13, w2, weights, ids))
            moe_triton.GROUP_M = default_gm
        for c in explicit:
            row[_name(c)] = _time_or_none(
                lambda c=c: fused_moe_triton(x, w13, w2, weights, ids, cfg=c))
        if a.breakdown:
            row.update(_breakdown(x, w13, w2, weights, ids, cfg))
        if a.sweep:
            times = {}
            for c in SWEEP:
                if c.block_m > max(16, 2 * t * a.top_k / e):  # row blocks mostly padding
                    continue
                try:
                    times[_name(c)] = cuda_time_ms(
                        lambda c=c: fused_moe_triton(x, w13, w2, weights, ids, cfg=c),
                        warmup=2, iters=5)
                except Exception as exc:  # noqa: BLE001 - a tile too large for shared memory
                    print(f"{_name(c)}: {type(exc).__name__}", flush=True)
            best = min(times, key=times.get)
            row.update(best_ms=times[best], best_config=best, sweep=times)
        rows.append(row)
        print(f"tokens={t} done", flush=True)
    cols = ["tokens", "active_experts", "floor_ms", "bound", "triton_ms", "torch_ms",
            "floor_pct", "vs_torch", "config"] + [f"group_m_{gm}_ms" for gm in a.group_m] + (
                ["best_ms", "best_config"] if a.sweep else []) + [_name(c) for c in explicit] + (
                    list(BREAKDOWN) if a.breakdown else [])
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s; experts "
          f"{e} x top {a.top_k}, hidden {h}, intermediate {i}, {str(dtype).split('.')[-1]}")
    print_table(rows, cols)
    write_json(a.out, {"argv": vars(a), "hardware": hardware(), "copy_bandwidth": bw,
                       "matmul_rate": rate, "rows": rows})


BREAKDOWN = ("align_ms", "gate_up_ms", "act_ms", "down_ms", "sum_ms")


def _time_or_none(fn) -> float | None:
    """cuda_time_ms of fn, or None where the tiles do not fit (shared memory)."""
    try:
        return cuda_time_ms(fn, warmup=2, iters=10)
    except Exception as exc:  # noqa: BLE001 - a tile too large for shared memory
        print(f"{type(exc).__name__}: {str(exc)[:120]}", flush=True)
        return None


def _breakdown(x, w13, w2, weights, ids, cfg: TileConfig) -> dict[str, float]:
    """Device times of the pieces `fused_moe_triton` runs, one by one, with tiles `cfg`."""
    e, top_k = w13.shape[0], ids.shape[1]
    pairs = ids.numel()
    sorted_pairs, block_expert = moe_triton.align_pairs_by_expert(ids, e, cfg.block_m)
    flat_w = weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    act = silu_and_mul(gate_up.normal_())
    down = torch.empty(pairs, x.shape[1], dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    block = min(1024, triton.next_power_of_2(x.shape[1]))
    return {
        "align_ms": cuda_time_ms(lambda: moe_triton.align_pairs_by_expert(ids, e, cfg.block_m)),
        "gate_up_ms": cuda_time_ms(lambda: moe_triton._grouped_gemm(
            x, w13, gate_up, flat_w, sorted_pairs, block_expert, top_k, False, cfg)),
        "act_ms": cuda_time_ms(lambda: silu_and_mul(gate_up)),
        "down_ms": cuda_time_ms(lambda: moe_triton._grouped_gemm(
            act, w2, down, flat_w, sorted_pairs, block_expert, 1, True, cfg)),
        "sum_ms": cuda_time_ms(lambda: moe_triton._moe_sum_kernel[
            (x.shape[0], triton.cdiv(x.shape[1], block))](
                down, ids, out, x.shape[1], E=e, K=top_k, BLOCK=block, num_warps=4)),
    }


def _name(c: TileConfig) -> str:
    return f"m{c.block_m} n{c.block_n} k{c.block_k} w{c.num_warps} s{c.num_stages}"


if __name__ == "__main__":
    main()
