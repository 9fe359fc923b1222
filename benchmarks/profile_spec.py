"""Where a batch-1 NGRAM request's time goes: one model process driven in this process (no
router, no HTTP), the copy prompts of benchmarks/data/spec_prompts.json one after the other,
greedy, under torch.profiler; per mode (plain decoding, NGRAM verification steps that wait for
the host, chained NGRAM steps) the wall time, the GPU's kernel time over it (near the wall: the
steps are bound by the GPU; far below: by the host), the steps and the kernels that took most.

    python3 benchmarks/profile_spec.py --model-path /tmp/smollm2 [--modes off nochain chain]
    python3 benchmarks/profile_spec.py --model-path DIR --device cpu --dtype float32 \
        --prompts 1 --max-new-tokens 8                          # a CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

PROMPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "spec_prompts.json")


def serve(p: Any, reqs: list[Any]) -> None:
    from srt.managers.io_struct import StepInput

    out = p.step(StepInput(reqs=reqs))
    while out.has_work or p.running or p.waiting:
        out = p.step(StepInput())


def run(mode: str, a: Any, prompts: list[list[int]]) -> dict[str, Any]:
    import torch

    from srt.managers.io_struct import TokenizedGenerateReq
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    kw: dict[str, Any] = {}
    if mode != "off":
        kw = dict(speculative_algorithm="NGRAM", speculative_chain="on" if mode == "chain" else "off")
    p = ModelProcess(ServerArgs(model_path=a.model_path, tokenizer_path=a.model_path,
                                device=a.device, dtype=a.dtype, random_seed=0, **kw), 0)
    cuda = p.runner.device.type == "cuda"
    sp = {"temperature": 0, "max_new_tokens": a.max_new_tokens}

    def once(tag: str) -> None:
        for i, ids in enumerate(prompts):
            serve(p, [TokenizedGenerateReq(f"{tag}{i}", ids, dict(sp))])
        p.kv.tree.reset()

    once("warm")
    # unprofiled first: the profiler's own cost per launch would hide a host-bound loop
    t = time.perf_counter()
    before = p.output.generated
    once("bare")
    if cuda:
        torch.cuda.synchronize()
    bare = time.perf_counter() - t
    bare_tokens = p.output.generated - before
    p.reset_stats()
    before = p.output.generated
    acts = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        once("timed")
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t
    tokens = p.output.generated - before
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    gpu = sum(e.self_device_time_total for e in kernels) / 1e6
    launches = sum(e.count for e in kernels)
    stats = p.stats()
    res = {"mode": mode, "bare_s": round(bare, 4),
           "bare_tok_per_s": round(bare_tokens / bare, 1), "wall_s": round(wall, 4),
           "gpu_kernel_s": round(gpu, 4),
           "tokens": tokens, "tok_per_s": round(tokens / wall, 1), "kernels": launches,
           "speculative": stats.get("speculative"),
           "chained_steps": p.chain.steps if getattr(p, "chain", None) else 0,
           "chain_starts": p.chain.starts if getattr(p, "chain", None) else 0,
           "graphed_steps": p.chain.graphed if getattr(p, "chain", None) else 0,
           "decode_step_times": stats.get("decode_step_times")}
    print(f"== {mode}: unprofiled {bare_tokens} tokens in {bare:.3f} s "
          f"({bare_tokens / bare:.1f} tok/s); profiled {tokens} tokens in {wall:.3f} s "
          f"({tokens / wall:.1f} tok/s), GPU kernels {gpu:.3f} s ({100 * gpu / wall:.0f}% of "
          f"the wall), {launches} kernels, chained steps {res['chained_steps']} in "
          f"{res['chain_starts']} chains ({res['graphed_steps']} graphed), speculative "
          f"{res['speculative']}", flush=True)
    print(prof.key_averages().table(
        sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=a.rows),
        flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--modes", nargs="+", default=["off", "nochain", "chain"])
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--rows", type=int, default=18)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompts", type=int, default=8, help="copy prompts used (the first N)")
    ap.add_argument("--out")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from benchmarks.bench_speculative import chat_ids

    tok = AutoTokenizer.from_pretrained(a.model_path)
    with open(PROMPTS) as f:
        prompts = [chat_ids(tok, x) for x in json.load(f)["copy"][: a.prompts]]
    results = [run(m, a, prompts) for m in a.modes]
    print("mode     bare tok/s   tok/s   wall_s  gpu_kernel_s  kernels  chained  chains")
    for r in results:
        print(f"{r['mode']:8s} {r['bare_tok_per_s']:10.1f} {r['tok_per_s']:7.1f} "
              f"{r['wall_s']:8.3f} {r['gpu_kernel_s']:12.3f} {r['kernels']:8d} "
              f"{r['chained_steps']:8d} {r['chain_starts']:7d}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
