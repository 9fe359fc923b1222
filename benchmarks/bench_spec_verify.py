"""What verifying draft tokens costs, on a model shape with random weights: time per decode step
without drafts and per verification step with k drafts, at several batch sizes, and where
speculation stops paying (the crossover batch size).

    python3 benchmarks/bench_spec_verify.py --shape llama3-8b --batch 1 2 4 8 16 32 64 \\
        --num-draft-tokens 3 5 8 --out verify.json

Random weights make real drafts meaningless, so acceptance is forced: for each batch size the
same requests (`--input-len` random ids, `--output-len` tokens, greedy, ignore_eos) run first
without speculation, recording every output, and then once per `--num-draft-tokens` value with
NGRAM speculation whose drafter is replaced, in this benchmark only, by an oracle that proposes
the next tokens of the recorded output. (In bf16 a verification's rows may still disagree with
the recorded tokens at near-ties; the accept length column says how many were kept.) The model
process runs in this process (srt.model_process.loop.ModelProcess) on the GPU, CUDA graphs on.

`--algorithm eagle` prices an EAGLE round instead: a one-layer EAGLE head of the shape (random
weights) drafts n - 1 tokens per request in n - 2 head steps, its output replaced by the oracle's
after it ran (so the round costs what a real head's does and the acceptance is forced), the head
mirrors every target step, and the target's features come out of its CUDA graphs. Its plain
baseline is a second model process without a head, in the same run.

Per row: the decode time per step (plain) and per verification step (oracle), their ratio, the
accepted length (tokens per request and step), output tokens/s of both and the speedup; the
floor of a plain step (weight bytes over the copy bandwidth measured in the same run). With a
real draft of accept length L the speedup is about L / ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import tempfile
import time
from typing import Any

import torch

from benchmarks.common import SHAPES, Shape, copy_bandwidth, hardware, print_table, \
    write_json, write_shape_dir


class OracleDrafter:
    """Drafts the recorded continuation of each request (benchmark only)."""

    def __init__(self, recorded: dict[str, list[int]]) -> None:
        self.recorded = recorded

    def propose(self, req: Any, k: int) -> list[int]:
        out = self.recorded.get(req.rid, [])  # (none for warm-up requests)
        n = len(req.output_ids)
        return out[n : n + k]


def run(proc: Any, prompts: list[list[int]], output_len: int, tag: str
        ) -> tuple[dict[str, list[int]], float]:
    """Serve the prompts to the end; (outputs by rid, seconds from the end of the first round,
    the fill, to the last token)."""
    from srt.managers.io_struct import StepInput, TokenizedGenerateReq

    reqs = [TokenizedGenerateReq(f"{tag}{i}", p, {"temperature": 0, "ignore_eos": True,
                                                  "max_new_tokens": output_len})
            for i, p in enumerate(prompts)]
    outs: dict[str, list[int]] = {r.rid: [] for r in reqs}
    step = StepInput(reqs=reqs)
    t0 = None
    while True:
        res = proc.step(step)
        step = StepInput()
        if res.token_out is not None:
            for o in res.token_out.outs:
                outs[o.rid].extend(o.new_ids)
        if t0 is None:
            _sync()
            t0 = time.perf_counter()
            if proc.waiting:
                raise SystemExit(f"batch {len(prompts)}: not every request fits the first fill")
        if not res.has_work and not (proc.running or proc.waiting):
            break
    _sync()
    return outs, time.perf_counter() - t0


def _oracle_after(drafts: Any, oracle: OracleDrafter) -> Any:
    """Speculator.drafts whose drafts, once the draft model proposed them (and paid for it),
    are replaced by the oracle's where it has them."""
    def wrapped(batch: Any, room: int, alloc: Any, free: Any) -> Any:
        out = drafts(batch, room, alloc, free)
        if out is None:
            return None
        new = []
        for r, d in zip(batch.reqs, out.drafts):
            o = oracle.propose(r, len(d))
            new.append(o + d[len(o):])
        return dataclasses.replace(out, drafts=new)
    return wrapped


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    p.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--num-draft-tokens", type=int, nargs="+", default=[5],
                   help="tokens verified per request and step, the last accepted one included")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--cuda-graph-max-bs", type=int, default=512)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", help="float32 for a CPU smoke test")
    p.add_argument("--algorithm", default="ngram", choices=["ngram", "eagle"])
    p.add_argument("--out", default=None)
    a = p.parse_args()

    from srt.model_process.loop import ModelProcess
    from srt.model_process.speculative import Speculator
    from srt.server_args import ServerArgs

    bw = copy_bandwidth()
    shape = Shape.of(a.shape)
    path = write_shape_dir(a.shape, tempfile.mkdtemp(prefix="srt-spec-verify-"))
    args = ServerArgs(model_path=path, tokenizer_path=path, load_format="dummy",
                      dtype=a.dtype, device=a.device, attention_backend=a.attention_backend,
                      cuda_graph_max_bs=a.cuda_graph_max_bs, random_seed=0,
                      max_prefill_tokens=max(8192, max(a.batch) * a.input_len),
                      chunked_prefill_size=-1, speculative_algorithm="NGRAM",
                      speculative_disable_by_batch_size=1 << 20)
    eagle = None
    if a.algorithm == "eagle":
        # two processes share the device: each pool holds what the run needs
        cap = max(a.batch) * (a.input_len + a.output_len + max(a.num_draft_tokens) + 8)
        args = dataclasses.replace(args, max_total_tokens=cap)
    proc = ModelProcess(args, 0)
    if a.algorithm == "eagle":
        head = write_shape_dir(a.shape, tempfile.mkdtemp(prefix="srt-eagle-head-"),
                               num_hidden_layers=1)
        eagle = ModelProcess(dataclasses.replace(
            args, speculative_algorithm="EAGLE", speculative_draft_model_path=head,
            speculative_num_steps=max(a.num_draft_tokens) - 1), 0)
    weight_bytes = proc.runner.weight_bytes
    floor_ms = weight_bytes / bw * 1e3
    rng = random.Random(0)
    rows = []
    for bs in a.batch:
        prompts = [[rng.randrange(2, shape.vocab) for _ in range(a.input_len)]
                   for _ in range(bs)]
        proc.spec = None
        run(proc, prompts, 8, f"w{bs}-")  # warm-up
        recorded, plain_s = run(proc, prompts, a.output_len, f"b{bs}-")
        plain_steps = a.output_len - 1
        plain_ms = plain_s / plain_steps * 1e3
        for n in a.num_draft_tokens:
            oracle = OracleDrafter({rid.replace(f"b{bs}-", f"o{bs}-{n}-"): ids
                                    for rid, ids in recorded.items()})
            if eagle is not None:
                target = eagle
                spec = Speculator(dataclasses.replace(
                    eagle.args, speculative_num_steps=n - 1), proc.config.vocab_size,
                    eagle.runner.draft)
                spec.drafts = _oracle_after(spec.drafts, oracle)  # type: ignore[method-assign]
                if bs == a.batch[0] and n == a.num_draft_tokens[0]:
                    eagle.spec = spec
                    run(eagle, prompts, 8, f"o{bs}-{n}-w")  # warm-up of the head's kernels
            else:
                target = proc
                spec = Speculator(dataclasses.replace(args, speculative_num_draft_tokens=n),
                                  proc.config.vocab_size)
                spec.proposer = oracle
            target.spec = spec
            outs, spec_s = run(target, prompts, a.output_len, f"o{bs}-{n}-")
            t = spec.totals
            steps = t.verify_steps + t.plain_steps
            verify_ms = spec_s / max(1, steps) * 1e3
            same = sum(outs[f"o{bs}-{n}-{i}"] == recorded[f"b{bs}-{i}"] for i in range(bs))
            row = {"batch": bs, "num_draft_tokens": n, "plain_step_ms": round(plain_ms, 3),
                   "verify_step_ms": round(verify_ms, 3),
                   "ratio": round(verify_ms / plain_ms, 3),
                   "accept_length": round(t.emitted_tokens / max(1, t.request_steps), 3),
                   "plain_tok_s": round(bs * plain_steps / plain_s, 1),
                   "spec_tok_s": round(bs * plain_steps / spec_s, 1),
                   "speedup": round(plain_s / spec_s, 3), "steps": steps,
                   "same_as_plain": f"{same}/{bs}", "floor_ms": round(floor_ms, 3)}
            rows.append(row)
            print(row, flush=True)
        proc.spec = None
    crossover = {}
    for n in a.num_draft_tokens:
        paying = [r["batch"] for r in rows if r["num_draft_tokens"] == n and r["speedup"] > 1]
        crossover[n] = max(paying) if paying else None
    print_table(rows, list(rows[0]))
    print("largest batch where speculation (oracle drafts) pays, by num_draft_tokens:",
          crossover)
    write_json(a.out, {"bench": "spec_verify", "algorithm": a.algorithm, "argv": sys.argv,
                       "hardware": hardware(),
                       "shape": a.shape, "weight_bytes": weight_bytes,
                       "copy_bandwidth_bytes_s": bw, "input_len": a.input_len,
                       "output_len": a.output_len, "rows": rows, "crossover": crossover})


if __name__ == "__main__":
    main()
