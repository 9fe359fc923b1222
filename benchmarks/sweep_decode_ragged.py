"""Decode attention over a batch of unequal contexts, as a serving batch has them (GPU only).

    python benchmarks/sweep_decode_ragged.py [--bs 128] [--lens 100-1124] [--slots contiguous]
        [--kv-dtype bf16|fp8] [--shared P] [--splits 1 2 ...] [--block-n 32 64] [--warps 4 8]
        [--stages 2 3 4] [--backends triton,flashinfer] [--out sweep_decode_ragged.json]

Llama-3-8B heads (32 / 8, d 128, bf16 queries), or with `--mla` DeepSeek-V2-Lite's latent
attention (16 heads over one 576-wide latent a token, the values its first 512 channels; the
split count the backend picks for one KV head). `--bs` requests with context lengths drawn
uniformly from `--lens` (seeded), each request's slots one run of the pool (`contiguous`, as a
fresh pool hands out a prompt's slots) or anywhere (`random`); `--kv-dtype fp8` stores the pool
in float8_e4m3fn (scales 0.5 / 0.25). `--shared P` puts one P-token prefix (the same slots)
before every request's own tokens, as W2's batches of one system prompt have it, and times the
shared-prefix stage at its chosen split count with stage 1 over the own tokens (both at the
`--stages` depth). Times the Triton decode kernel at every split count and tile given, with the
split count the backend chooses marked, and the other `--backends` on the same batch (bf16
pool, no shared prefix only), all replayed from CUDA graphs. `frac_of_copy`: K/V bytes read
per second over a device-to-device copy's rate measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
from typing import Any, Callable

import torch

import benchmarks.bench_attention as ba
import srt.layers.attention.triton_ops.decode_attention as dec
import srt.layers.attention.triton_ops.decode_config as dcfg
from benchmarks.bench_attention import graph_time_ms, make_runner
from benchmarks.common import copy_bandwidth, print_table
from srt.layers.attention import create_attention_backend
from srt.layers.forward_batch import ForwardBatch, ForwardMode, forward_context
from srt.layers.radix_attention import RadixAttention
from srt.memory_pool import ReqToTokenPool, TokenToKVPool


class RaggedDecode:
    """One decode step of `lens.numel()` requests with the given context lengths."""

    def __init__(self, lens: list[int], contiguous: bool, kv_dtype: torch.dtype,
                 shared: int = 0, seed: int = 0, v_dim: int | None = None) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        dev, H, HKV, D, dt = ba.DEV, ba.H, ba.HKV, ba.D, ba.DTYPE
        self.lens, bs, self.shared = lens, len(lens), shared
        size = shared + sum(lens)
        self.req_pool = ReqToTokenPool(bs, shared + max(lens) + 1, dev)
        self.v_dim = v_dim  # latent attention: the values are the keys' first v_dim channels
        self.kv_pool = TokenToKVPool(size, 1, HKV, D, kv_dtype, dev, shared_kv=v_dim is not None)
        for buf in (self.kv_pool.k_buffer[0], self.kv_pool.v_buffer[0]):
            buf.copy_(torch.randn(buf.shape, device=dev))
        # contiguous: one run of slots per request, the runs in a shuffled order of requests;
        # random: every token's slot anywhere in the pool. The shared prefix: the first run.
        order = torch.randperm(bs, generator=g).tolist() if contiguous else range(bs)
        slots = (torch.arange(size) if contiguous else torch.randperm(size, generator=g)).to(
            dev, torch.int32)
        at = shared
        for i in order:
            self.req_pool.req_to_token[i, :shared] = slots[:shared]
            self.req_pool.req_to_token[i, shared:shared + lens[i]] = slots[at:at + lens[i]]
            at += lens[i]
        self.seq_lens = torch.tensor([shared + n for n in lens], dtype=torch.int64, device=dev)
        self.rows = torch.arange(bs, device=dev)
        self.q = torch.randn(bs, H, D, dtype=dt, device=dev)
        self.o = torch.empty_like(self.q)
        self.kv_bytes = size * HKV * D * (1 if v_dim else 2) * kv_dtype.itemsize
        self.scales = (0.5, 0.25) if kv_dtype != dt else (1.0, 1.0)
        self.layer = RadixAttention(H, D, D**-0.5, HKV, 0)

    def triton(self, splits: int) -> Callable[[], Any]:
        bs = len(self.lens)
        shared_splits = dec.choose_shared_splits(bs, ba.H // ba.HKV, ba.HKV, self.shared) \
            if self.shared else 0
        ws = dec.decode_workspace(bs, ba.H, ba.D, splits + shared_splits, ba.DEV)
        k, v = self.kv_pool.k_buffer[0], self.kv_pool.v_buffer[0]
        ks, vs = self.scales

        def run() -> None:
            dec.decode_attention_fwd(self.q, k, v, self.o, self.req_pool.req_to_token,
                                     self.rows, self.seq_lens, ba.D**-0.5, splits, ws,
                                     shared_len=self.shared, shared_splits=shared_splits,
                                     k_scale=ks, v_scale=vs, v_head_dim=self.v_dim)
        return run

    def backend(self, name: str) -> Callable[[], Any]:
        bs = len(self.lens)
        backend = create_attention_backend(name, runner=make_runner(bs))
        loc = self.req_pool.req_to_token[self.rows, self.seq_lens - 1].long()
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs,
            input_ids=torch.zeros(bs, dtype=torch.int64, device=ba.DEV),
            positions=self.seq_lens - 1, out_cache_loc=loc, req_pool_indices=self.rows,
            seq_lens=self.seq_lens, seq_lens_cpu=list(self.lens),
            prefix_lens_cpu=[n - 1 for n in self.lens], extend_lens_cpu=[1] * bs,
            req_to_token_pool=self.req_pool, token_to_kv_pool=self.kv_pool,
            attn_backend=backend)
        backend.init_forward_metadata(fb)
        q = self.q.view(bs, -1)
        k = torch.randn(bs, ba.HKV * ba.D, dtype=ba.DTYPE, device=ba.DEV)
        v = torch.randn_like(k)

        def run() -> torch.Tensor:
            with forward_context(fb):
                return self.layer(q, k, v)
        return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", type=int, nargs="+", default=[128])
    ap.add_argument("--lens", default="100-1124", help="LO-HI context lengths (uniform)")
    ap.add_argument("--slots", choices=("contiguous", "random"), default="contiguous")
    ap.add_argument("--backends", default="triton,flashinfer")
    ap.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--shared", type=int, default=0, help="shared prefix tokens (0: none)")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 16])
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--mla", action="store_true",
                    help="DeepSeek-V2-Lite's latent attention (16 heads, one 576-wide latent)")
    ap.add_argument("--out", default="sweep_decode_ragged.json")
    a = ap.parse_args()
    v_dim = None
    if a.mla:  # (the kernel takes 32-token blocks at this width: --block-n does not apply)
        ba.H, ba.HKV, ba.D, v_dim = 16, 1, 576, 512
    lo, hi = (int(x) for x in a.lens.split("-"))
    kv_dtype = torch.float8_e4m3fn if a.kv_dtype == "fp8" else ba.DTYPE
    # the other backends' runs here have no shared-prefix stage and no FP8 scales
    backends = "triton" if a.shared or a.kv_dtype == "fp8" or a.mla else a.backends
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows: list[dict[str, Any]] = []
    for bs in a.bs:
        g = torch.Generator().manual_seed(bs)
        lens = torch.randint(lo, hi + 1, (bs,), generator=g).tolist()
        case = RaggedDecode(lens, a.slots == "contiguous", kv_dtype, a.shared, v_dim=v_dim)
        chosen = dec.choose_num_kv_splits(bs, ba.HKV, 1 << 30, programs_per_sm=(
            dcfg.DECODE_MLA_PROGRAMS_PER_SM if a.mla else dcfg.DECODE_PROGRAMS_PER_SM))

        def add(name: str, fn: Callable[[], Any], **cfg: Any) -> None:
            ms = graph_time_ms(fn)
            if ms is not None:
                rows.append({"bs": bs, "shared": a.shared, "kv": a.kv_dtype,
                             "mean_len": sum(lens) / bs, "backend": name, **cfg,
                             "ms": ms, "frac_of_copy": case.kv_bytes / (ms / 1e3) / bw})
                print(rows[-1], flush=True)

        if "triton" in backends:
            saved = (dec.DECODE_BLOCK_N, dec.DECODE_NUM_WARPS, dec.DECODE_NUM_STAGES)
            for splits, block_n, warps, stages in itertools.product(
                    a.splits, a.block_n, a.warps, a.stages):
                for mod in (dec, dcfg):  # the launch reads dec's, the stage count dcfg's
                    mod.DECODE_BLOCK_N, mod.DECODE_NUM_WARPS, mod.DECODE_NUM_STAGES = (
                        block_n, warps, stages)
                add("triton", case.triton(splits), splits=splits, block_n=block_n,
                    warps=warps, stages=stages, chosen=splits == chosen)
            for mod in (dec, dcfg):
                mod.DECODE_BLOCK_N, mod.DECODE_NUM_WARPS, mod.DECODE_NUM_STAGES = saved
        for name in backends.split(","):
            if name != "triton":
                add(name, case.backend(name))
        case = None  # its buffers go before the next batch size's
    best = []
    for bs in a.bs:
        mine = [r for r in rows if r["bs"] == bs]
        tri = sorted((r for r in mine if r["backend"] == "triton"), key=lambda r: r["ms"])
        best += tri[:8] + [r for r in tri if r["chosen"] and r["block_n"] == dec.DECODE_BLOCK_N
                           and r["warps"] == dec.DECODE_NUM_WARPS
                           and r["stages"] == dec.DECODE_NUM_STAGES]
        best += [r for r in mine if r["backend"] != "triton"]
    print_table(best, ["bs", "shared", "kv", "mean_len", "backend", "splits", "block_n", "warps",
                       "stages", "chosen", "ms", "frac_of_copy"])
    with open(a.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
