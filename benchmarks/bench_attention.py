"""Attention kernels over the page-size-1 KV pool: time per call and achieved bandwidth.

    python benchmarks/bench_attention.py [--out results.json] [--backends torch,triton,flashinfer]

GPU only. 32 query heads, 8 KV heads, head dim 128, bf16, slots shuffled across the pool. Decode at
batch 1/8/64/256 x context 512/2048/8192; extend with prefix 0/1024/4096 and 512 new tokens.
Time: median of CUDA-event timings after warm-up. Bandwidth counts each K/V byte read once plus q
and o, and is compared with a device-to-device copy measured in the same run. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable

import torch

from benchmarks.common import copy_bandwidth, cuda_time_ms
from srt.layers.attention import create_attention_backend
from srt.layers.forward_batch import ForwardBatch, ForwardMode, forward_context
from srt.layers.radix_attention import RadixAttention
from srt.memory_pool import ReqToTokenPool, TokenToKVPool

H, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
DEV = torch.device("cuda")


def graph_time_ms(fn: Callable[[], Any]) -> float | None:
    """Median time of `fn` replayed from a CUDA graph (no host launch overhead), or None when
    it cannot be captured."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as e:  # report eager timings only for this backend and case
        print(f"  (no CUDA graph: {type(e).__name__}: {str(e)[:80]})", flush=True)
        torch.cuda.synchronize()
        return None
    return cuda_time_ms(graph.replay)


def make_runner(max_reqs: int) -> Any:
    return SimpleNamespace(
        device=DEV, dtype=DTYPE, config=SimpleNamespace(head_dim=D, num_heads=H),
        max_running_requests=max_reqs, max_total_num_tokens=1 << 20, num_heads_per_rank=lambda: H,
        model_kv_heads=lambda: HKV, attn_scaling=lambda: D**-0.5,
    )


class Case:
    """One batch laid out in a pool with shuffled slots; this step's tokens at the end of each."""

    def __init__(self, mode: ForwardMode, bs: int, prefix: int, new: int, seed: int = 0,
                 contiguous: bool = False) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.mode, self.bs = mode, bs
        seq = prefix + new
        size = bs * seq
        self.req_pool = ReqToTokenPool(bs, seq + 1, DEV)
        self.kv_pool = TokenToKVPool(size, 1, HKV, D, DTYPE, DEV)
        self.kv_pool.k_buffer[0].normal_()
        self.kv_pool.v_buffer[0].normal_()
        # random: every token's slot anywhere in the pool (the worst case for page size 1);
        # contiguous: each request's slots in one run, as a fresh pool hands them out
        perm = (torch.arange(size) if contiguous else torch.randperm(size, generator=g)).to(DEV)
        self.req_pool.req_to_token[:, :seq] = perm.view(bs, seq).to(torch.int32)
        rows = torch.arange(bs, device=DEV)
        self.out_cache_loc = self.req_pool.req_to_token[:, prefix:seq].reshape(-1).long()
        tokens = bs * new
        self.q = torch.randn(tokens, H * D, dtype=DTYPE, device=DEV)
        self.k = torch.randn(tokens, HKV * D, dtype=DTYPE, device=DEV)
        self.v = torch.randn(tokens, HKV * D, dtype=DTYPE, device=DEV)
        self.fb_args = dict(
            forward_mode=mode, batch_size=bs,
            input_ids=torch.zeros(tokens, dtype=torch.int64, device=DEV),
            positions=torch.zeros(tokens, dtype=torch.int64, device=DEV),
            out_cache_loc=self.out_cache_loc, req_pool_indices=rows,
            seq_lens=torch.full((bs,), seq, dtype=torch.int64, device=DEV),
            seq_lens_cpu=[seq] * bs, prefix_lens_cpu=[prefix] * bs, extend_lens_cpu=[new] * bs,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
        )
        self.layer = RadixAttention(H, D, D**-0.5, HKV, 0)
        self.bytes = (size * HKV * D * 2 + 2 * tokens * H * D) * DTYPE.itemsize

    def runner(self, backend: Any) -> Callable[[], torch.Tensor]:
        fb = ForwardBatch(**self.fb_args, attn_backend=backend)
        backend.init_forward_metadata(fb)

        def run() -> torch.Tensor:
            with forward_context(fb):
                return self.layer(self.q, self.k, self.v)

        return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_attention.json")
    ap.add_argument("--backends", default="torch,triton,flashinfer,flashinfer-cudacore")
    ap.add_argument("--torch-max-tokens", type=int, default=1 << 19,
                    help="skip the torch reference above this many KV tokens (it is slow)")
    ap.add_argument("--slots", choices=("random", "contiguous"), default="random")
    ap.add_argument("--only", choices=("all", "decode", "extend"), default="all")
    a = ap.parse_args()
    backends = a.backends.split(",")
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth: {bw / 1e12:.2f} TB/s",
          flush=True)
    cases = []
    if a.only in ("all", "decode"):
        cases += [(ForwardMode.DECODE, bs, ctx - 1, 1) for bs in (1, 8, 64, 256)
                  for ctx in (512, 2048, 8192)]
    if a.only in ("all", "extend"):
        cases += [(ForwardMode.EXTEND if p else ForwardMode.PREFILL, bs, p, 512)
                  for bs in (1, 8) for p in (0, 1024, 4096)]
    built = {}
    for name in backends:
        if name == "flashinfer-cudacore":  # FlashInfer decode without tensor cores
            built[name] = create_attention_backend("flashinfer", runner=make_runner(256),
                                                   decode_tensor_cores=False)
        else:
            built[name] = create_attention_backend(name, runner=make_runner(256))
    rows = []
    for mode, bs, prefix, new in cases:
        case = Case(mode, bs, prefix, new, contiguous=a.slots == "contiguous")
        ref = None
        for name in backends:
            row = {"mode": mode.name, "batch": bs, "prefix": prefix, "new": new,
                   "context": prefix + new, "backend": name}
            if name == "torch" and bs * (prefix + new) > a.torch_max_tokens:
                row["skipped"] = "too large for the torch reference"
                rows.append(row)
                continue
            run = case.runner(built[name])
            out = run().float()
            if ref is None:
                ref = out
            row["max_abs_diff_vs_first"] = (out - ref).abs().max().item()
            row["eager_ms"] = cuda_time_ms(run)
            graph_ms = graph_time_ms(run)
            row["graph_ms"] = graph_ms
            # bandwidth from the kernel time (graph replay) when capturable
            ms = graph_ms if graph_ms is not None else row["eager_ms"]
            row["ms"] = ms
            row["gbps"] = case.bytes / (ms / 1e3) / 1e9
            row["frac_of_copy"] = case.bytes / (ms / 1e3) / bw
            rows.append(row)
        del case
        torch.cuda.empty_cache()
    hdr = (f"{'mode':8} {'bs':>4} {'prefix':>6} {'new':>4} {'backend':>19} {'eager ms':>9} "
           f"{'graph ms':>9} {'GB/s':>8} {'%copy':>6} {'maxdiff':>8}")
    print(hdr)
    for r in rows:
        if "skipped" in r:
            print(f"{r['mode']:8} {r['batch']:>4} {r['prefix']:>6} {r['new']:>4} "
                  f"{r['backend']:>19}   skipped")
            continue
        graph = f"{r['graph_ms']:9.4f}" if r["graph_ms"] is not None else f"{'-':>9}"
        print(f"{r['mode']:8} {r['batch']:>4} {r['prefix']:>6} {r['new']:>4} {r['backend']:>19} "
              f"{r['eager_ms']:9.4f} {graph} {r['gbps']:8.0f} {100 * r['frac_of_copy']:6.1f} "
              f"{r['max_abs_diff_vs_first']:8.4f}")
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
            "copy_bandwidth_Bps": bw, "torch": torch.__version__, "argv": sys.argv,
            "heads": H, "kv_heads": HKV, "head_dim": D, "dtype": str(DTYPE), "slots": a.slots}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
