"""The LoRA kernels of one decoder layer against the layer's own products, on the GPU.

    python3 benchmarks/bench_lora_kernels.py --shape llama3-8b --slots 8 --rank 16 \\
        --rows 1 8 32 128 256 2048 4096 --out lora_kernels.json

For each step size T (rows spread round-robin over `--slots` adapters, every slot used when T
allows) and each adapted layer of the shape (qkv, o, gate_up, down: srt/lora/layers.py's
LoraLinear on the real tensor-parallel layers, random bf16 weights): the base product's time,
the LoRA shrink + expand's time (`LoraLinear.apply`, the grouping built as the model process
builds it) and their ratio; then the four layers summed, the extra a decoder layer pays. Steps
below 1,025 rows are timed as CUDA graphs (decode steps replay graphs), larger ones as eager
launches (fills). `--fill-block-m` and `--expand-block-n` try other block sizes. The floor of the
LoRA part is its bytes (the used slots' A and B, the shrink's partial sums, the output read and
written) at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from benchmarks.common import Shape, hardware, print_table, write_json


def copy_bandwidth() -> float:
    """Device-to-device copy rate, bytes/s (reads + writes)."""
    import triton

    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x))
    return 2 * x.numel() / (ms * 1e-3)


def layers(shape: Shape, slots: int, rank: int) -> dict[str, object]:
    """name -> (base layer, LoraLinear) at one rank, weights random."""
    from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from srt.lora.layers import LoraLinear, Slice

    h, q, kv, inter = shape.hidden, shape.heads * shape.head_dim, \
        shape.kv_heads * shape.head_dim, shape.intermediate
    dev, dt = torch.device("cuda"), torch.bfloat16
    out = {}
    qkv = QKVParallelLinear(h, shape.head_dim, shape.heads, shape.kv_heads)
    out["qkv"] = (qkv, [Slice("q_proj", "q", 0, q), Slice("k_proj", "k", q, kv),
                        Slice("v_proj", "v", q + kv, kv)], h, False)
    gu = MergedColumnParallelLinear(h, [inter, inter])
    out["gate_up"] = (gu, [Slice("gate_proj", 0, 0, inter), Slice("up_proj", 1, inter, inter)],
                      h, False)
    out["o"] = (RowParallelLinear(q, h), [Slice("o_proj", None, 0, h)], q, True)
    out["down"] = (RowParallelLinear(inter, h), [Slice("down_proj", None, 0, h)], inter, True)
    built = {}
    g = torch.Generator().manual_seed(0)
    for name, (base, slices, fan_in, row_par) in out.items():
        base.weight.data = (torch.randn(base.weight.shape, generator=g) * 0.02).to(dt)
        base = base.to(dev)
        lora = LoraLinear(base, slices, fan_in, row_par, slots, rank, dt, dev)
        for s in range(slots):  # at one rank a slice's B is its whole output
            lora.write_slot(s, {sl.module: (torch.randn(rank, fan_in, generator=g) * 0.01,
                                            torch.randn(sl.out_size, rank, generator=g) * 0.01)
                                for sl in slices})
        built[name] = (base, lora)
    return built


def grouping(t: int, slots: int, block_m: int) -> object:
    """The LoraBatchInfo of T rows, row i under slot i mod slots."""
    from srt.lora.layers import LoraBatchInfo
    from srt.lora.sgmv import row_blocks

    row_slots = np.arange(t) % slots
    rows = np.argsort(row_slots, kind="stable")
    counts = np.bincount(row_slots, minlength=slots)
    indptr = np.concatenate([[0], np.cumsum(counts)])
    slot, start = row_blocks(counts, indptr, block_m)
    dev = "cuda"
    return LoraBatchInfo(torch.from_numpy(rows).to(dev), torch.from_numpy(indptr).to(dev),
                         torch.from_numpy(slot).to(dev), torch.from_numpy(start).to(dev),
                         block_m, None)


def time_us(fn, graph: bool) -> float:  # noqa: ANN001
    import triton

    if graph:
        return triton.testing.do_bench_cudagraph(fn) * 1e3
    return triton.testing.do_bench(fn) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 256, 2048, 4096])
    p.add_argument("--fill-block-m", type=int, nargs="+", default=[0],
                   help="block sizes to try for steps of 1,025 rows or more (0: srt's own)")
    p.add_argument("--expand-block-n", type=int, nargs="+", default=[0],
                   help="expand column blocks to try (0: srt's own)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from srt.lora import sgmv

    shape = Shape.of(a.shape)
    bw = copy_bandwidth()
    built = layers(shape, a.slots, a.rank)
    default_bn = sgmv.EXPAND_BLOCK_N
    rows_out = []
    for t in a.rows:
        fill = t >= sgmv.FILL_ROWS
        for bm_try in (a.fill_block_m if fill else [0]):
            for bn_try in a.expand_block_n:
                bm = bm_try or sgmv.block_m_for(t)
                sgmv.EXPAND_BLOCK_N = bn_try or default_bn
                info = grouping(t, a.slots, bm)
                total_base = total_lora = total_bytes = 0.0
                row = {"rows": t, "block_m": bm, "expand_block_n": sgmv.EXPAND_BLOCK_N}
                for name, (base, lora) in built.items():
                    x = torch.randn(t, base.weight.shape[1], device="cuda",
                                    dtype=torch.bfloat16)
                    y = torch.nn.functional.linear(x, base.weight)
                    tb = time_us(lambda: torch.nn.functional.linear(x, base.weight), not fill)
                    tl_ = time_us(lambda: lora.apply(x, y, info), not fill)
                    used = min(t, a.slots)
                    nbytes = used * (lora.a[0].nbytes + lora.b[0].nbytes) + 2 * y.nbytes
                    total_base += tb
                    total_lora += tl_
                    total_bytes += nbytes
                    row[f"{name}_base_us"] = round(tb, 1)
                    row[f"{name}_lora_us"] = round(tl_, 1)
                row.update(base_us=round(total_base, 1), lora_us=round(total_lora, 1),
                           lora_over_base=round(total_lora / total_base, 3),
                           lora_floor_us=round(total_bytes / bw * 1e6, 1))
                rows_out.append(row)
    cols = ["rows", "block_m", "expand_block_n", "base_us", "lora_us", "lora_over_base",
            "lora_floor_us"] + [f"{n}_{k}_us" for n in built for k in ("base", "lora")]
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; shape {a.shape}, {a.slots} slots of rank "
          f"{a.rank}; per decoder layer (qkv + o + gate_up + down), microseconds")
    print_table(rows_out, cols)
    if a.out:
        write_json(a.out, {"bench": "bench_lora_kernels", "hardware": hardware(),
                           "shape": a.shape, "slots": a.slots, "rank": a.rank,
                           "copy_bytes_per_s": bw, "rows": rows_out})


if __name__ == "__main__":
    main()
