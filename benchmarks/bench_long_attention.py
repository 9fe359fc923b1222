"""Attention kernels at long contexts (GPU only): the cases behind T30, W3 and D30.

    python benchmarks/bench_long_attention.py [--backends triton,flashinfer,...] [--out F]
    python benchmarks/bench_long_attention.py --sweep   # the Triton kernels' tiles, long cases

Cases (Llama-3-8B heads: 32 / 8, d 128, bf16, one layer, slots shuffled over the pool as a
long-running server hands them out):
  * PREFILL of 8,192 new tokens (the first chunk of a long prompt);
  * EXTEND of a chunk over a cached prefix: 8,192 over 8,192 / 16,384 / 21,808 (T30's chunks),
    2,048 over 6,144;
  * DECODE at batch 1 x 30,000 (D30) and batch 64 x 4,352 (W3's decode).
Backends: `triton`, `flashinfer` (FlashInfer's paged prefill, its default kernel choice),
`flashinfer-fa2` / `flashinfer-fa3` (that kernel family forced). Times are device times of eager
calls (CUDA events; the kernels run for milliseconds, launch overhead is noise); every backend's
output is compared with the first backend's. Attention FLOPs count the causal triangle only.
Prints a table and writes JSON; the bf16 matmul rate of the same run is the floor's yardstick.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

import benchmarks.bench_attention as ba
from benchmarks.bench_attention import Case, make_runner
from benchmarks.common import cuda_time_ms, matmul_rate
from srt.layers.attention import create_attention_backend
from srt.layers.forward_batch import ForwardMode


def attention_flops(prefix: int, new: int, bs: int) -> float:
    """QK^T and PV multiply-adds of `new` causal queries over `prefix` + themselves."""
    pairs = new * prefix + new * (new + 1) / 2
    return 4.0 * ba.H * ba.D * pairs * bs


def build_backend(name: str) -> Any:
    runner = make_runner(256)
    if not name.startswith("flashinfer-"):
        return create_attention_backend(name, runner=runner)
    import flashinfer

    backend = create_attention_backend("flashinfer", runner=runner)
    kind = name.split("-", 1)[1]  # fa2 / fa3
    backend.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        backend.workspace, "NHD", backend=kind)
    return backend


CASES = [
    (ForwardMode.PREFILL, 1, 0, 8192),
    (ForwardMode.EXTEND, 1, 8192, 8192),
    (ForwardMode.EXTEND, 1, 16384, 8192),
    (ForwardMode.EXTEND, 1, 21808, 8192),
    (ForwardMode.EXTEND, 1, 6144, 2048),
    (ForwardMode.DECODE, 1, 29999, 1),
    (ForwardMode.DECODE, 64, 4351, 1),
]


# (BLOCK_M, BLOCK_N, warps, stages) tried by --sweep for the PREFILL and EXTEND kernels
SWEEP = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
         (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2), (128, 128, 8, 4), (128, 64, 8, 4)]


def sweep(out_rows: list[dict[str, Any]]) -> None:
    """Time the Triton PREFILL / EXTEND kernels over SWEEP on the long cases."""
    import srt.layers.attention.triton_backend as tb
    import srt.layers.attention.triton_ops.extend_attention as ext
    import srt.layers.attention.triton_ops.prefill_attention as pre

    cases = [c for c in CASES if c[0] != ForwardMode.DECODE and c[1:] != (1, 16384, 8192)]
    saved = (tb.extend_attention_fwd, tb.context_attention_fwd, ext.EXTEND_NUM_WARPS,
             ext.EXTEND_NUM_STAGES, pre.PREFILL_NUM_WARPS, pre.PREFILL_NUM_STAGES)
    backend = create_attention_backend("triton", runner=make_runner(256))
    for mode, bs, prefix, new in cases:
        case = Case(mode, bs, prefix, new)
        for bm, bn, warps, stages in SWEEP:
            ext.EXTEND_NUM_WARPS = pre.PREFILL_NUM_WARPS = warps
            ext.EXTEND_NUM_STAGES = pre.PREFILL_NUM_STAGES = stages
            tb.extend_attention_fwd = lambda *x, **k: saved[0](*x, block_m=bm, block_n=bn, **k)
            tb.context_attention_fwd = lambda *x, **k: saved[1](*x, block_m=bm, block_n=bn, **k)
            row: dict[str, Any] = {"sweep": True, "mode": mode.name, "prefix": prefix,
                                   "new": new, "block_m": bm, "block_n": bn, "warps": warps,
                                   "stages": stages}
            try:
                run = case.runner(backend)
                ms = cuda_time_ms(run, warmup=2, iters=10)
                row.update(ms=ms, tflop_per_s=attention_flops(prefix, new, bs) / ms / 1e9)
                print(f"  sweep {mode.name} {prefix}+{new} {bm}x{bn} w{warps} s{stages}: "
                      f"{ms:.3f} ms {row['tflop_per_s']:.0f} TFLOP/s", flush=True)
            except Exception as e:  # out of shared memory / registers: skip the config
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                print(f"  sweep {mode.name} {bm}x{bn} w{warps} s{stages}: {row['error']}",
                      flush=True)
            out_rows.append(row)
        del case
    (tb.extend_attention_fwd, tb.context_attention_fwd, ext.EXTEND_NUM_WARPS,
     ext.EXTEND_NUM_STAGES, pre.PREFILL_NUM_WARPS, pre.PREFILL_NUM_STAGES) = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="triton,flashinfer,flashinfer-fa2,flashinfer-fa3")
    ap.add_argument("--sweep", action="store_true", help="also sweep the Triton kernels' tiles")
    ap.add_argument("--out", default="bench_long_attention.json")
    a = ap.parse_args()
    rate = matmul_rate()
    print(f"device: {torch.cuda.get_device_name()}  bf16 matmul {rate / 1e12:.0f} TFLOP/s",
          flush=True)
    sweep_rows: list[dict[str, Any]] = []
    if a.sweep:
        sweep(sweep_rows)
    rows: list[dict[str, Any]] = []
    built: dict[str, Any] = {}
    for name in a.backends.split(","):
        try:
            built[name] = build_backend(name)
        except Exception as e:  # report and go on with the others
            print(f"  {name}: not available ({type(e).__name__}: {str(e)[:100]})", flush=True)
    for mode, bs, prefix, new in CASES:
        case = Case(mode, bs, prefix, new)
        ref = None
        for name, backend in built.items():
            row: dict[str, Any] = {"mode": mode.name, "batch": bs, "prefix": prefix, "new": new,
                                   "backend": name}
            try:
                run = case.runner(backend)
                out = run()
                torch.cuda.synchronize()
                ms = cuda_time_ms(run, warmup=2, iters=10)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                print(f"  {name} {mode.name} {prefix}+{new}: {row['error']}", flush=True)
                rows.append(row)
                continue
            if ref is None:
                ref = out.float()
            row["max_abs_diff"] = float((out.float() - ref).abs().max())
            row["ms"] = ms
            if mode == ForwardMode.DECODE:
                row["tb_per_s"] = case.bytes / (ms / 1e3) / 1e12
            else:
                row["tflop_per_s"] = attention_flops(prefix, new, bs) / (ms / 1e3) / 1e12
            rows.append(row)
            print(f"  {name:15s} {mode.name:7s} bs {bs:3d} {prefix:6d}+{new:5d}: {ms:8.3f} ms  "
                  + (f"{row['tb_per_s']:.2f} TB/s" if "tb_per_s" in row
                     else f"{row['tflop_per_s']:.0f} TFLOP/s")
                  + f"  diff {row['max_abs_diff']:.3g}", flush=True)
        del case
        torch.cuda.empty_cache()
    print("\n| case | " + " | ".join(built) + " |")
    print("|---|" + "---|" * len(built))
    for mode, bs, prefix, new in CASES:
        cells = []
        for name in built:
            r = next(r for r in rows if r["backend"] == name and r["mode"] == mode.name
                     and r["batch"] == bs and r["prefix"] == prefix and r["new"] == new)
            if "ms" not in r:
                cells.append("error")
            elif "tb_per_s" in r:
                cells.append(f"{r['ms']:.3f} ms ({r['tb_per_s']:.2f} TB/s)")
            else:
                cells.append(f"{r['ms']:.3f} ms ({r['tflop_per_s']:.0f} TFLOP/s)")
        print(f"| {mode.name} bs{bs} {prefix}+{new} | " + " | ".join(cells) + " |")
    with open(a.out, "w") as f:
        json.dump({"matmul_tflops": rate / 1e12, "rows": rows, "sweep": sweep_rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
