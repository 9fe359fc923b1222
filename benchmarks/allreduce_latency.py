"""Latency of one all-reduce between two processes over torch.distributed: what tensor
parallelism pays per call (a Llama-3-8B decode step makes 65 of them at batch 1, two per
layer plus the logits' gather).

    python3 benchmarks/allreduce_latency.py --backend gloo --sizes 8192 65536 --out ar.json

Two processes on this machine (127.0.0.1 by default, or --master-addr) each all-reduce a bf16
(gloo: float32) tensor of each byte size `--iters` times after `--warmup`; the median time of a
call on rank 0 is reported. gloo runs over TCP, so on one machine this is the loopback's cost,
a floor for the same call between two machines (which adds the network's round trips).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.common import hardware, print_table, write_json  # noqa: E402


def _worker(rank: int, a: argparse.Namespace, port: int, q: Any) -> None:
    dist.init_process_group(a.backend, init_method=f"tcp://{a.master_addr}:{port}",
                            rank=rank, world_size=2)
    device = torch.device("cuda", rank) if a.backend == "nccl" else torch.device("cpu")
    dtype = torch.bfloat16 if a.backend == "nccl" else torch.float32
    rows = []
    for size in a.sizes:
        x = torch.randn(max(1, size // dtype.itemsize), dtype=dtype, device=device)
        times = []
        for i in range(a.warmup + a.iters):
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(x)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= a.warmup:
                times.append(time.perf_counter() - t)
        times.sort()
        rows.append({"bytes": size, "median_us": times[len(times) // 2] * 1e6,
                     "p10_us": times[len(times) // 10] * 1e6,
                     "p90_us": times[len(times) * 9 // 10] * 1e6})
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 65536, 1 << 20])
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from srt.utils import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, a, port, q)) for r in range(2)]
    for pr in procs:
        pr.start()
    rows = q.get(timeout=600)
    for pr in procs:
        pr.join(60)
    for r in rows:
        r["per_token_ms_at_65_calls"] = r["median_us"] * 65 / 1e3
    write_json(a.out, {"bench": "allreduce_latency", "argv": sys.argv, "hardware": hardware(),
                       "backend": a.backend, "master_addr": a.master_addr, "runs": rows})
    print_table(rows, ["bytes", "median_us", "p10_us", "p90_us", "per_token_ms_at_65_calls"])


if __name__ == "__main__":
    main()
