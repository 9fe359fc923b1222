"""Sampling a batch at a temperature: the torch sequence against the one-pass kernel.

    python3 benchmarks/bench_sampler.py                          # on a GPU
    python3 benchmarks/bench_sampler.py --batch 2 --vocab 64     # CPU (interpreter), smoke

For each batch size and vocabulary: the device time of `srt.layers.sampler.sample` on random
float32 logits at temperature 0.6 (no top-k / top-p / min-p) through the torch sequence
(FUSED "never": argmax, division, softmax, exponential noise, division, argmax) and through
`srt.layers.sample_triton` (FUSED "always"), and the floor: one read of the logits at the copy
bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

from benchmarks.common import (  # noqa: E402
    copy_bandwidth, cuda_time_ms, default_device, hardware, print_table, write_json)
from srt.layers import sampler  # noqa: E402
from srt.layers.sampler import SamplingBatchInfo, sample  # noqa: E402


def _info(bs: int, vocab: int, device: str) -> SamplingBatchInfo:
    return SamplingBatchInfo(
        temperatures=torch.full((bs,), 0.6, device=device), top_ps=torch.ones(bs, device=device),
        top_ks=torch.full((bs,), vocab, device=device), min_ps=torch.zeros(bs, device=device),
        all_greedy=False, need_top_p_k=False, need_min_p=False, seeds=[None] * bs,
        positions=[0] * bs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 128, 200, 256])
    p.add_argument("--vocab", type=int, nargs="+", default=[102400, 128256, 151936])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = default_device()
    bw = copy_bandwidth(device)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for vocab in a.vocab:
        for bs in a.batch:
            logits = torch.randn(bs, vocab, generator=gen, device=device)
            info = _info(bs, vocab, device)
            times = {}
            for mode in ("never", "always"):
                sampler.FUSED = mode
                times[mode] = cuda_time_ms(lambda: sample(logits, info, gen))
            floor = logits.numel() * 4 / bw * 1e3
            rows.append({"vocab": vocab, "batch": bs, "floor_ms": floor,
                         "torch_ms": times["never"], "one_pass_ms": times["always"],
                         "speedup": times["never"] / times["always"],
                         "one_pass_of_floor": floor / times["always"]})
    sampler.FUSED = "gpu"
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print_table(rows, list(rows[0]))
    write_json(a.out, {"hardware": hardware(), "copy_bandwidth": bw, "rows": rows})


if __name__ == "__main__":
    main()
