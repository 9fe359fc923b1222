"""The linear layers' products per weight format at the Llama-3-8B layer sizes, against the
weight-read floor.

    python3 benchmarks/bench_quant_gemm.py --out quant_gemm.json [--rows 1 8 ...] [--sweep]

For each layer (qkv 4096->6144, o 4096->4096, gate_up 4096->28672, down 14336->4096) and rows
M: device time per product of bf16 (`F.linear`), FP8 as srt runs it (srt/layers/fp8.py: the
weight-only kernel up to WEIGHT_ONLY_MAX_ROWS rows, else per-token activation quantization +
the split-K kernel up to FP8_GEMM_MAX_ROWS or `torch._scaled_mm`), FP8 through `_scaled_mm` at
every M (`fp8_smm`), `_scaled_mm` with unit tensor-wise scales and both scale vectors applied
to its product afterwards (`fp8_smm_tw`: cuBLASLt's FP8 kernels instead of the row-wise
path), the split-K kernel at every M (`fp8_gemm`), and AWQ int4 group 128
(srt/layers/awq.py AwqKernelWeight). Times are of 20 products replayed in one CUDA graph (no
launch gaps; the median of 20 replays), each on its own copy of the weight (copies of at
least 200 MB together, so that weights come from memory, not the L2). The floor is the weight bytes over the copy bandwidth
measured in the same run. `--sweep` also times the weight-only kernel's tiles (both formats)
at each M and prints the best per layer, format and M next to the default's (`--formats
fp8gemm`: the split-K FP8 x FP8 kernel's tiles and splits, activation quantization
included). `--dtype
float16` runs activations and the dense weight (the `bf16` columns) in float16.
`awq_values_ms`: the int4 kernel at its default tiles with X_WORDS off (x read one value at a
time rather than as words of two channels; packed path, M <= 4), which the sweep also tries.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from dataclasses import replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.bench_attention import graph_time_ms
from benchmarks.common import copy_bandwidth, hardware, print_table, write_json

LAYERS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]
REPS = 20
# Each product reads one of several copies of its weight, together at least this many bytes,
# so that the weight comes from memory (as a model's layers do), not from the 50 MB L2.
ROTATE_BYTES = 200 << 20


def graph_ms(fn: Callable[[int], Any]) -> float:
    """Device ms per call of fn: fn(0) .. fn(REPS - 1) replayed from one CUDA graph."""
    ms = graph_time_ms(lambda: [fn(i) for i in range(REPS)])
    if ms is None:
        raise RuntimeError("the product could not be captured in a CUDA graph")
    return ms / REPS


def sweep_configs(m: int, int4: bool, gemv_only: bool = False,
                  x_words: bool = False) -> list[Any]:
    """The weight-only kernel's tiles tried at m rows (int4: BLOCK_K divides the group, 128;
    x_words: each packed int4 tile also with X_WORDS)."""
    configs = _sweep_configs(m, int4, gemv_only)
    if x_words:
        configs += [replace(c, X_WORDS=1) for c in configs if c.PACKED]
    return configs


def fp8gemm_configs(m: int) -> list[Any]:
    """The split-K FP8 kernel's configurations tried at m rows: row tiles of the batch rounded
    up (16-128) and half that, 32-128 columns, 1-8 parts of K; 8 warps for 128 rows, else 4."""
    from srt.layers.fp8_gemm_triton import Fp8GemmConfig

    bm = min(max(1 << (m - 1).bit_length(), 16), 128)
    return [Fp8GemmConfig(b, bn, 128, sp, 8 if b == 128 else 4)
            for b, bn, sp in itertools.product(sorted({bm, max(bm // 2, 16)}), (32, 64, 128),
                                               (1, 2, 3, 4, 6, 8))]


def _sweep_configs(m: int, int4: bool, gemv_only: bool) -> list[Any]:
    from srt.layers.quant_gemm_triton import WoConfig

    if int4:
        gemv = [WoConfig(1, bn, bk, sp, w, UNROLL_N=2, PACKED=p)
                for bn, bk, sp, w, p in itertools.product((32, 64), (64, 128), (8, 16), (2, 4),
                                                          (0, 1))]
        gemv += [WoConfig(1, 32, 128, sp, w, PACKED=p)
                 for sp, w, p in itertools.product((8, 16), (2, 4), (0, 1))]
        gemv += [WoConfig(1, bn, bk, sp, w, PACKED=1) for bn, bk, sp, w in (
            (16, 128, 8, 1), (32, 128, 8, 1), (32, 128, 4, 2), (64, 128, 8, 2), (64, 128, 16, 2),
            (32, 64, 8, 2), (32, 64, 16, 2), (16, 128, 16, 1), (32, 128, 32, 2))]
        if m > 1:
            gemv += [WoConfig(1, 32, 128, sp, w, UNROLL_N=u, ROWS=2, PACKED=p)
                     for sp, w, u, p in itertools.product((8, 16), (2, 4), (1, 2), (0, 1))]
    else:
        gemv = [WoConfig(1, bn, bk, 1, w) for bn, bk, w in itertools.product(
            (4, 8, 16, 32), (256, 512), (2, 4))]
        gemv += [WoConfig(1, bn, 512, 2, 4) for bn in (16, 32)]
        gemv += [WoConfig(1, bn, bk, 1, w, REDUCE=1) for bn, bk, w in itertools.product(
            (4, 8, 16, 32), (256, 512, 1024), (2, 4, 8))]
    dot = [WoConfig(bm, bn, bk, sp, 4) for bm, bn, bk, sp in itertools.product(
        (16,) if m <= 16 else (16, 64), (32, 64, 128), (64, 128), (1, 2, 4))]
    if m == 1 and gemv_only:
        return gemv
    return (gemv if m <= 4 else []) + dot


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=ROWS)
    p.add_argument("--layers", nargs="+", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--sweep-rows", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--formats", nargs="+", default=["fp8", "awq"],
                   choices=["fp8", "awq", "fp8gemm"],
                   help="the formats --sweep tries (without awq, no AWQ column either)")
    p.add_argument("--gemv-only", action="store_true",
                   help="--sweep: only the CUDA-core kernel's tiles at M = 1")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="of the activations and the dense weight")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    if not torch.cuda.is_available():
        sys.exit("bench_quant_gemm needs a CUDA GPU")
    from srt.layers.attention.triton_ops.decode_config import device_num_sms
    from srt.layers.awq import AwqKernelWeight, AwqWeight, quantize_awq
    from srt.layers.fp8 import Fp8Weight, quantize_per_channel
    from srt.layers.fp8_gemm_triton import default_fp8_gemm_config, fp8_gemm
    from srt.layers.fp8_triton import quantize_per_token_triton
    from srt.layers.quant_gemm_triton import default_config, wo_matmul

    bw = copy_bandwidth()
    rows_out: list[dict[str, Any]] = []
    sweep_out: list[dict[str, Any]] = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in a.layers:
        n, k = LAYERS[name]
        w0 = torch.randn(n, k, device="cuda", generator=g, dtype=dtype) * k**-0.5
        fp80 = Fp8Weight(*quantize_per_channel(w0))
        awq = "awq" in a.formats  # (its CPU quantization of each layer takes a while)
        awq0 = AwqKernelWeight.from_checkpoint(AwqWeight(*(
            t.cuda() for t in quantize_awq((w0 if awq else w0[:128]).float().cpu(), 128))))
        ws = [w0] + [w0.clone() for _ in range(-(-ROTATE_BYTES // (n * k * 2)) - 1)]
        fp8s = [fp80] + [Fp8Weight(fp80.qweight.clone(), fp80.scale.clone())
                         for _ in range(-(-ROTATE_BYTES // (n * k)) - 1)]
        awqs = [awq0] + [AwqKernelWeight(awq0.w.clone(), awq0.scales.clone(), awq0.zeros.clone())
                         for _ in range(-(-ROTATE_BYTES // (n * k // 2)) - 1 if awq else 0)]
        floors = {"bf16": n * k * 2 / bw * 1e3, "fp8": n * k / bw * 1e3,
                  "awq": (n * k / 2 + n * k / 128 * 3) / bw * 1e3}

        def smm(x: torch.Tensor, fp8: Fp8Weight) -> torch.Tensor:
            xq, xs = quantize_per_token_triton(x)
            return torch._scaled_mm(xq, fp8.qweight.t(), scale_a=xs, scale_b=fp8.scale_row,
                                    out_dtype=x.dtype)

        one = torch.ones((), device="cuda")

        def smm_tensorwise(x: torch.Tensor, fp8: Fp8Weight) -> torch.Tensor:
            # unit tensor-wise scales (cuBLASLt's FP8 kernels rather than the row-wise path),
            # the scale vectors applied to the product afterwards (two passes: an upper bound
            # on what a fused epilogue would cost)
            xq, xs = quantize_per_token_triton(x)
            out = torch._scaled_mm(xq, fp8.qweight.t(), scale_a=one, scale_b=one,
                                   out_dtype=x.dtype)
            return out.mul_(xs).mul_(fp8.scale_row)

        def gemm(x: torch.Tensor, fp8: Fp8Weight, cfg: Any = None) -> torch.Tensor:
            xq, xs = quantize_per_token_triton(x)
            return fp8_gemm(xq, xs, fp8.qweight, fp8.scale, x.dtype, config=cfg)

        for m in a.rows:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=dtype)
            row: dict[str, Any] = {"layer": name, "M": m}
            row["bf16_ms"] = graph_ms(lambda i: F.linear(x, ws[i % len(ws)]))
            row["fp8_ms"] = graph_ms(lambda i: fp8s[i % len(fp8s)].matmul(x))
            row["fp8_smm_ms"] = (graph_ms(lambda i: smm(x, fp8s[i % len(fp8s)]))
                                 if fp80.scaled_mm else float("nan"))
            row["fp8_smm_tw_ms"] = (graph_ms(lambda i: smm_tensorwise(x, fp8s[i % len(fp8s)]))
                                    if fp80.scaled_mm else float("nan"))
            row["fp8_gemm_ms"] = (graph_ms(lambda i: gemm(x, fp8s[i % len(fp8s)]))
                                  if fp80.scaled_mm else float("nan"))
            row["awq_ms"] = (graph_ms(lambda i: awqs[i % len(awqs)].matmul(x)) if awq
                             else float("nan"))
            if m <= 4 and awq:
                wcfg = replace(default_config(m, n, k, True, 128), X_WORDS=0)
                row["awq_values_ms"] = graph_ms(lambda i: wo_matmul(
                    x, awqs[i % len(awqs)].w, awqs[i % len(awqs)].scales,
                    awqs[i % len(awqs)].zeros, config=wcfg))
            for fmt in ("bf16", "fp8", "awq"):
                row[f"{fmt}_x_floor"] = row[f"{fmt}_ms"] / floors[fmt]
            row["fp8_vs_bf16"] = row["bf16_ms"] / row["fp8_ms"]
            row["gemm_vs_smm"] = row["fp8_smm_ms"] / row["fp8_gemm_ms"]
            row["awq_vs_bf16"] = row["bf16_ms"] / row["awq_ms"]
            rows_out.append(row)
        if not a.sweep:
            continue
        for m in a.sweep_rows if "fp8gemm" in a.formats and fp80.scaled_mm else []:
            x = torch.randn(m, k, device="cuda", generator=g, dtype=dtype)
            timed = []
            for cfg in fp8gemm_configs(m):
                try:
                    timed.append((graph_ms(lambda i: gemm(x, fp8s[i % len(fp8s)], cfg)), cfg))
                except Exception as e:  # a tile the compiler refuses (resources)
                    print(f"skip {cfg}: {type(e).__name__}", file=sys.stderr)
            if not timed:
                continue
            timed.sort(key=lambda t: t[0])
            smm_ms = graph_ms(lambda i: smm(x, fp8s[i % len(fp8s)]))
            sms = device_num_sms()
            sweep_out.append({"layer": name, "fmt": "fp8gemm", "M": m,
                              "default_ms": graph_ms(lambda i: gemm(x, fp8s[i % len(fp8s)])),
                              "default": str(default_fp8_gemm_config(m, n, k, sms)),
                              "best_ms": timed[0][0], "best": str(timed[0][1]),
                              "next": "; ".join(f"{c} {ms:.4f}" for ms, c in timed[1:4]),
                              "floor_ms": floors["fp8"], "smm_ms": smm_ms})
            print(sweep_out[-1], flush=True)
        for m, int4 in itertools.product(a.sweep_rows, [f == "awq" for f in a.formats
                                                        if f != "fp8gemm"]):
            x = torch.randn(m, k, device="cuda", generator=g, dtype=dtype)
            args = ([(a_.w, a_.scales, a_.zeros) for a_ in awqs] if int4
                    else [(f.qweight, f.scale) for f in fp8s])
            timed: list[tuple[float, Any]] = []
            for cfg in sweep_configs(m, int4, a.gemv_only, x_words=int4):
                try:
                    ms = graph_ms(lambda i: wo_matmul(x, *args[i % len(args)], config=cfg))
                except Exception as e:  # a tile the compiler refuses (resources)
                    print(f"skip {cfg}: {type(e).__name__}", file=sys.stderr)
                    continue
                timed.append((ms, cfg))
            timed.sort(key=lambda t: t[0])
            best = timed[0] if timed else None
            default = graph_ms(lambda i: wo_matmul(x, *args[i % len(args)]))
            fmt = "awq" if int4 else "fp8"
            sweep_out.append({"layer": name, "fmt": fmt, "M": m, "default_ms": default,
                              "default": str(default_config(m, n, k, int4, 128)),
                              "best_ms": best[0] if best else float("nan"),
                              "best": str(best[1]) if best else "",
                              "next": "; ".join(f"{c} {ms:.4f}" for ms, c in timed[1:4]),
                              "floor_ms": floors[fmt]})
            print(sweep_out[-1], flush=True)  # kept if the run is cut short
    cols = ["layer", "M", "bf16_ms", "fp8_ms", "fp8_smm_ms", "fp8_smm_tw_ms", "fp8_gemm_ms",
            "awq_ms", "awq_values_ms", "bf16_x_floor", "fp8_x_floor", "awq_x_floor", "fp8_vs_bf16",
            "gemm_vs_smm", "awq_vs_bf16"]
    for r in rows_out:
        r.setdefault("awq_values_ms", float("nan"))
    print_table(rows_out, cols)
    for fmt in ("fp8gemm", "fp8", "awq"):  # (the formats' rows have different keys)
        part = [r for r in sweep_out if r["fmt"] == fmt]
        if part:
            print_table(part, list(part[0]))
    write_json(a.out, {"bench": "quant_gemm", "argv": sys.argv, "hardware": hardware(),
                       "copy_bandwidth_Bps": bw, "dtype": a.dtype, "rows": rows_out,
                       "sweep": sweep_out})


if __name__ == "__main__":
    main()
