"""The linear layers' products per weight format at the Llama-3-8B layer sizes, against the
weight-read floor.

    python3 benchmarks/bench_quant_gemm.py --out quant_gemm.json [--sweep]

For each layer (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and rows
M: device time per product of bf16 (`F.linear`), FP8 (per-token activation quantization +
`torch._scaled_mm`, srt/layers/fp8.py) and AWQ int4 group 128 (srt/layers/awq_triton.py).
Times are of 20 products replayed in one CUDA graph (no launch gaps; the median of 20 replays). The floor is the weight
bytes over the copy bandwidth measured in the same run. `--sweep` also times the fused AWQ
kernel's tile and split choices at M = 1 and prints the best per layer next to the default's.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.bench_attention import graph_time_ms
from benchmarks.common import copy_bandwidth, hardware, print_table, write_json

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
ROWS = [1, 8, 32, 128, 512, 2048]
REPS = 20


def graph_ms(fn: Callable[[], Any]) -> float:
    """Device ms per call of fn: REPS calls replayed from one CUDA graph."""
    ms = graph_time_ms(lambda: [fn() for _ in range(REPS)])
    if ms is None:
        raise RuntimeError("the product could not be captured in a CUDA graph")
    return ms / REPS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=ROWS)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_quant_gemm needs a CUDA GPU")
    from srt.layers.awq import quantize_awq
    from srt.layers.awq_triton import awq_gemm, awq_matmul
    from srt.layers.fp8 import Fp8Weight, quantize_per_channel

    bw = copy_bandwidth()
    rows_out: list[dict[str, Any]] = []
    sweep_out: list[dict[str, Any]] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in LAYERS.items():
        w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * k**-0.5
        fp8 = Fp8Weight(*quantize_per_channel(w))
        awq = [t.cuda() for t in quantize_awq(w.float().cpu(), 128)]
        floors = {"bf16": n * k * 2 / bw * 1e3, "fp8": n * k / bw * 1e3,
                  "awq": (n * k / 2 + n * k / 128 * 2.5) / bw * 1e3}
        for m in a.rows:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
            xh = x.half()
            row: dict[str, Any] = {"layer": name, "M": m}
            row["bf16_ms"] = graph_ms(lambda: F.linear(x, w))
            row["fp8_ms"] = graph_ms(lambda: fp8.matmul(x))
            row["awq_ms"] = graph_ms(lambda: awq_matmul(xh, *awq))
            for fmt in ("bf16", "fp8", "awq"):
                row[f"{fmt}_x_floor"] = row[f"{fmt}_ms"] / floors[fmt]
            row["fp8_vs_bf16"] = row["bf16_ms"] / row["fp8_ms"]
            row["awq_vs_bf16"] = row["bf16_ms"] / row["awq_ms"]
            rows_out.append(row)
        if a.sweep:
            x = torch.randn(1, k, device="cuda", generator=g, dtype=torch.float16)
            best: tuple[float, dict[str, int]] | None = None
            for bn, bk, split, warps in itertools.product((32, 64, 128), (64, 128),
                                                          (1, 2, 4, 8), (4,)):
                cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=warps)
                ms = graph_ms(lambda: awq_gemm(x, *awq, config=cfg))
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            default = graph_ms(lambda: awq_gemm(x, *awq))
            sweep_out.append({"layer": name, "default_ms": default, "best_ms": best[0],
                              "best": str(best[1]), "floor_ms": floors["awq"]})
    cols = ["layer", "M", "bf16_ms", "fp8_ms", "awq_ms", "bf16_x_floor", "fp8_x_floor",
            "awq_x_floor", "fp8_vs_bf16", "awq_vs_bf16"]
    print_table(rows_out, cols)
    if sweep_out:
        print_table(sweep_out, list(sweep_out[0]))
    write_json(a.out, {"bench": "quant_gemm", "argv": sys.argv, "hardware": hardware(),
                       "copy_bandwidth_Bps": bw, "rows": rows_out, "sweep_m1": sweep_out})


if __name__ == "__main__":
    main()
