"""Sweep the Triton attention kernels' tunables on the cases the targets name (GPU only).

    python benchmarks/sweep_triton_attention.py [--out sweep.json]
    # SmolLM2's heads (9 / 3, d 64), decode only, at batch 256 x 768 tokens
    python benchmarks/sweep_triton_attention.py --heads 9 --kv-heads 3 --head-dim 64 \
      --decode 256x768 --no-extend

Decode: batch 64 x context 2048 and batch 1 x context 8192. Extend: 512 new tokens over a
4096-token prefix at batch 1 and 8. Times are CUDA-graph replays (kernel time, no launch
overhead), as in bench_attention.py. Prints the configurations sorted by time per case.
"""

from __future__ import annotations

import argparse
import itertools
import json

import benchmarks.bench_attention as ba
import srt.layers.attention.triton_ops.decode_attention as dec
import srt.layers.attention.triton_ops.decode_config as dcfg
import srt.layers.attention.triton_ops.extend_attention as ext
from benchmarks.bench_attention import Case, copy_bandwidth, graph_time_ms, make_runner
from srt.layers.attention import create_attention_backend
from srt.layers.forward_batch import ForwardMode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sweep_triton_attention.json")
    ap.add_argument("--heads", type=int, default=ba.H)
    ap.add_argument("--kv-heads", type=int, default=ba.HKV)
    ap.add_argument("--head-dim", type=int, default=ba.D)
    ap.add_argument("--decode", default="64x2048,1x8192", help="decode cases BATCHxCONTEXT,...")
    ap.add_argument("--no-extend", action="store_true")
    a = ap.parse_args()
    ba.H, ba.HKV, ba.D = a.heads, a.kv_heads, a.head_dim
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; heads {a.heads} / {a.kv_heads}, d {a.head_dim}",
          flush=True)
    results = []
    decode_cases = [tuple(int(x) for x in c.split("x")) for c in a.decode.split(",") if c]
    for bs, ctx in decode_cases:
        case = Case(ForwardMode.DECODE, bs, ctx - 1, 1)
        for block_n, stages, per_sm, min_tok, warps in itertools.product(
                (32, 64), (2, 3, 4), (4, 8, 16), (32, 64, 128), (4, 8)):
            for mod in (dec, dcfg):  # the launch reads dec's, the sizing dcfg's
                mod.DECODE_BLOCK_N, mod.DECODE_NUM_STAGES = block_n, stages
                mod.DECODE_NUM_STAGES_SMALL_HEAD = stages
                mod.DECODE_PROGRAMS_PER_SM, mod.DECODE_MIN_TOKENS_PER_SPLIT = per_sm, min_tok
                mod.DECODE_NUM_WARPS = warps
            backend = create_attention_backend("triton", runner=make_runner(256))
            ms = graph_time_ms(case.runner(backend))
            if ms is None:
                continue
            results.append({"case": f"decode bs{bs} ctx{ctx}", "block_n": block_n,
                            "stages": stages, "programs_per_sm": per_sm,
                            "min_tokens_per_split": min_tok, "warps": warps, "ms": ms,
                            "frac_of_copy": case.bytes / (ms / 1e3) / bw})
        del case
    for bs in () if a.no_extend else (1, 8):
        case = Case(ForwardMode.EXTEND, bs, 4096, 512)
        backend = create_attention_backend("triton", runner=make_runner(256))
        for block_m, block_n, warps, stages in itertools.product(
                (32, 64, 128), (32, 64, 128), (4, 8), (2, 3)):
            if block_m % block_n:
                continue
            ext.EXTEND_NUM_WARPS, ext.EXTEND_NUM_STAGES = warps, stages
            orig = ext.extend_attention_fwd

            def patched(*args, _orig=orig, _m=block_m, _n=block_n, **kw):
                kw.update(block_m=_m, block_n=_n)
                return _orig(*args, **kw)

            ext.extend_attention_fwd = patched
            import srt.layers.attention.triton_backend as tb
            saved = tb.extend_attention_fwd
            tb.extend_attention_fwd = patched
            try:
                ms = graph_time_ms(case.runner(backend))
            finally:
                ext.extend_attention_fwd = orig
                tb.extend_attention_fwd = saved
            if ms is None:
                continue
            results.append({"case": f"extend bs{bs} prefix4096 new512", "block_m": block_m,
                            "block_n": block_n, "warps": warps, "stages": stages, "ms": ms})
        del case
    for name in sorted({r["case"] for r in results}):
        rows = sorted((r for r in results if r["case"] == name), key=lambda r: r["ms"])
        print(f"== {name}: best 6 of {len(rows)}")
        for r in rows[:6]:
            print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                         if k != "case"})
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
