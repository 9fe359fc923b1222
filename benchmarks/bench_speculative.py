"""Speculative decoding on real weights (NGRAM prompt lookup; STANDALONE with a draft model):
output tokens/s with and without it, the mean accepted length, and whether greedy outputs stay
those of speculation off.

    python3 benchmarks/bench_speculative.py --model-path /tmp/smollm2 --out spec.json
    python3 benchmarks/bench_speculative.py --max-new-tokens 16 --prompts 2 --spec off \\
        --dtype float32                                    # CPU smoke test, the default model

The prompts are benchmarks/data/spec_prompts.json: 'copy' asks for an edited copy of a given text
(the output reuses the prompt, where prompt lookup pays), 'free' for new text. Each prompt is
put in the model's chat template as text and then encoded without special tokens, exactly as
vLLM's side (vllm_spec_bench.py of the peer kit) does; greedy, up to `--max-new-tokens` tokens,
EOS respected. Per mode of `--spec` (default both, each in its own srt.Engine, one after the
other) and per kind: batch 1 (each prompt alone, one after the other) and batch N (all N prompts
of the kind in one generate call, so they run concurrently; N is 8 with every prompt). A warm-up
(one prompt alone and one batch) comes first, then the radix cache is flushed.

Reported per (kind, batch): output tokens/s (completion tokens over wall time), the mean accepted
length (completion tokens / verify steps summed over the requests: tokens per verify step, the
bonus token included), and with both modes how many outputs equal speculation off's token for
token and the speedup ngram / off. `--vllm-json FILE...` adds vLLM's figures from
vllm_spec_bench.py's output files (one per method: off, ngram_gpu, ngram) as columns, the ratios
srt / vLLM for the same side (speculation off, or on), and how many of vLLM's batch-1 outputs
equal srt's. `--load FILE` reads an earlier `--out` of this script instead of running srt again
(to add vLLM's figures measured later in the same sitting).

`--spec standalone` adds STANDALONE with `--draft-model-path`, or without one a layer-prefix
draft of the model itself (its first `--draft-layers` layers with its norm and head: on
SmolLM2-135M the first 25 of 30 layers agree with the whole model's greedy token about half the
time, so this mode measures the machinery rather than a good draft).

The speculative flags are srt.ServerArgs flags and apply to the ngram mode only, e.g.
`--speculative-num-draft-tokens 5 --speculative-ngram-min-match-window-size 2
--speculative-ngram-max-match-window-size 4` (4 drafts, suffixes of 2-4 tokens: the settings of
vLLM's side); any other ServerArgs flag (`--cuda-graph-max-bs 16`, `--attention-backend triton`,
...) applies to both modes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from benchmarks.common import hardware, parse_with_server_args, print_table, write_json

KINDS = ("copy", "free")
PROMPTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                            "spec_prompts.json")
# vLLM's method names: which side of srt each one is compared with
VLLM_SIDE = {"off": "off", "ngram_gpu": "ngram", "ngram": "ngram"}


def chat_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt in the chat template as text, then its ids without special tokens (the
    template already holds them; apply_chat_template's tokenized return type varies)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def engine_args(a: Any, mode: str) -> dict[str, Any]:
    """ServerArgs fields of one mode: the speculative flags given only for ngram."""
    kw: dict[str, Any] = dict(dtype=a.dtype, device=a.device, log_level=a.log_level,
                              random_seed=0)
    for k, v in a.server_args.items():
        if not k.startswith("speculative_"):
            kw[k] = v
    if mode == "ngram":
        kw["speculative_algorithm"] = "NGRAM"
        kw.update({k: v for k, v in a.server_args.items() if k.startswith("speculative_")})
    elif mode == "standalone":
        kw.update(speculative_algorithm="STANDALONE", speculative_draft_model_path=a.draft_path,
                  speculative_num_steps=a.draft_steps)
    return kw


def finish_counts(outs: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for o in outs:
        fr = o["meta_info"].get("finish_reason")
        kind = fr.get("type") if isinstance(fr, dict) else str(fr)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def measure(engine: Any, ids: list[list[int]], batched: bool, sp: dict[str, Any],
            runs: int) -> dict[str, Any]:
    """One (kind, batch) cell: `runs` timed passes; figures of the median pass, outputs and
    verify counts of the first."""
    times: list[float] = []
    first: list[dict[str, Any]] = []
    for r in range(runs):
        t = time.perf_counter()
        if batched:
            outs = engine.generate(input_ids=ids, sampling_params=sp)
        else:
            outs = [engine.generate(input_ids=x, sampling_params=sp) for x in ids]
        times.append(time.perf_counter() - t)
        if r == 0:
            first = outs
    tokens = sum(o["meta_info"]["completion_tokens"] for o in first)
    verify = [o["meta_info"].get("spec_verify_ct") for o in first]
    s = statistics.median(times)
    cell: dict[str, Any] = {
        "out_tokens": tokens, "s": round(s, 4), "tok_per_s": round(tokens / s, 1),
        "s_runs": [round(x, 4) for x in times], "finish": finish_counts(first),
        "ids": [list(o["output_ids"]) for o in first],
    }
    if verify and all(v is not None for v in verify) and sum(verify) > 0:
        cell["verify_ct"] = sum(verify)
        cell["accept_length"] = round(tokens / sum(verify), 3)
    return cell


def run_mode(a: Any, mode: str, model_path: str, ids: dict[str, list[list[int]]]
             ) -> dict[str, Any]:
    import srt

    kw = engine_args(a, mode)
    t0 = time.perf_counter()
    engine = srt.Engine(model_path, **kw)
    startup = time.perf_counter() - t0
    sp = {"max_new_tokens": a.max_new_tokens, "temperature": 0}
    n = len(ids[KINDS[0]])
    results: dict[str, Any] = {}
    with engine:
        # Warm-up: a prompt alone and a batch, so every kernel is built before the timing;
        # then an empty cache, so the timed prompts are prefilled in full as they first come.
        engine.generate(input_ids=ids["copy"][0], sampling_params=sp)
        engine.generate(input_ids=ids["free"], sampling_params={**sp, "max_new_tokens": 16})
        engine.flush_cache()
        for kind in a.kinds:
            results[f"b1_{kind}"] = measure(engine, ids[kind], False, sp, a.runs)
            results[f"b{n}_{kind}"] = measure(engine, ids[kind], True, sp, a.runs)
        info = engine.model_info
        server = engine.get_server_info()  # the host's time per step phase, speculation counts
    return {"startup_s": round(startup, 1), "server_args": kw, "model_info": info,
            "speculative": server.get("speculative"),
            "decode_step_times": server.get("decode_step_times"), "results": results}


def cut_draft(model_path: str, layers: int | None) -> str:
    """A layer-prefix draft of the model in a temporary directory (a self-draft: its first
    layers with its head; no separate small checkpoint is needed)."""
    import tempfile

    from benchmarks.common import save_layer_prefix

    with open(os.path.join(model_path, "config.json")) as f:
        total = json.load(f)["num_hidden_layers"]
    n = layers or max(1, total * 5 // 6)
    path = save_layer_prefix(model_path, tempfile.mkdtemp(prefix="srt-draft-"), n)
    print(f"standalone draft: the first {n} of {total} layers -> {path}", flush=True)
    return path


def common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    for p, q in zip(x, y):
        if p != q:
            break
        n += 1
    return n


def equal_count(xs: list[list[int]], ys: list[list[int]]) -> str:
    return f"{sum(list(x) == list(y) for x, y in zip(xs, ys))}/{min(len(xs), len(ys))}"


def table_rows(modes: dict[str, Any], vllm: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (kind, batch) cell over srt's modes and vLLM's methods."""
    cells: list[str] = []
    for m in modes.values():
        cells += [c for c in m["results"] if c not in cells]
    rows = []
    for cell in cells:
        batch, kind = cell.split("_", 1)
        row: dict[str, Any] = {"kind": kind, "batch": int(batch[1:])}
        srt_cell = {mode: m["results"].get(cell) for mode, m in modes.items()}
        for mode, c in srt_cell.items():
            if c is None:
                continue
            row[f"{mode}_tok_s"] = c["tok_per_s"]
            if mode != "off":
                row[f"{mode}_accept"] = c.get("accept_length", "-")
        off = srt_cell.get("off")
        for mode in ("ngram", "standalone"):
            on = srt_cell.get(mode)
            if off and on:
                tag = "" if mode == "ngram" else "_sa"
                row[f"speedup{tag}"] = round(on["tok_per_s"] / off["tok_per_s"], 3)
                row[f"same_as_off{tag}"] = equal_count(on["ids"], off["ids"])
        on = srt_cell.get("ngram")
        for method, v in vllm.items():
            vc = v.get(cell)
            if not vc:
                continue
            row[f"vllm_{method}_tok_s"] = vc["tok_per_s"]
            if "accept_length" in vc:
                row[f"vllm_{method}_accept"] = vc["accept_length"]
            mine = srt_cell.get(VLLM_SIDE.get(method, method))
            if mine:
                row[f"srt/vllm_{method}"] = round(mine["tok_per_s"] / vc["tok_per_s"], 3)
            vids = v.get(f"ids_{kind}") if batch == "b1" else None
            ref = mine or off or on
            if vids and ref:  # greedy: srt's batch-1 outputs against vLLM's, token for token
                row[f"eq_vllm_{method}"] = equal_count(ref["ids"], vids)
                row[f"pfx_vllm_{method}"] = round(statistics.mean(
                    common_prefix(x, y) for x, y in zip(ref["ids"], vids)), 1)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default=None,
                   help="a Hugging Face directory with real weights (default: srt's default "
                   "model, SmolLM2-135M-Instruct, prepared into the cache)")
    p.add_argument("--spec", nargs="+", default=["off", "ngram"],
                   choices=["off", "ngram", "standalone"])
    p.add_argument("--draft-model-path", default=None,
                   help="standalone mode: the draft model (default: the model's first "
                   "--draft-layers layers, cut into a temporary directory)")
    p.add_argument("--draft-layers", type=int, default=None,
                   help="standalone mode without --draft-model-path: layers of the cut draft "
                   "(default: five sixths of the model's)")
    p.add_argument("--draft-steps", type=int, default=3,
                   help="standalone mode: draft tokens per verification")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompts", type=int, default=None,
                   help="the first N prompts of each kind (batch N; default all, 8)")
    p.add_argument("--prompts-file", default=PROMPTS_FILE)
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    p.add_argument("--runs", type=int, default=1, help="timed passes per cell (the median)")
    p.add_argument("--dtype", default="bfloat16", help="float32 is faster for a CPU smoke test")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--log-level", default="warning")
    p.add_argument("--vllm-json", nargs="+", default=[], metavar="FILE",
                   help="vllm_spec_bench.py outputs (their 'method' names the column)")
    p.add_argument("--load", default=None, metavar="FILE",
                   help="srt's figures from an earlier --out of this script (no engine runs)")
    p.add_argument("--out", default=None)
    a = parse_with_server_args(p)
    if "speculative_algorithm" in a.server_args:
        p.error("choose the modes with --spec (off, ngram), not --speculative-algorithm")

    vllm: dict[str, Any] = {}
    for path in a.vllm_json:
        with open(path) as f:
            v = json.load(f)
        vllm[v.get("method", os.path.basename(path))] = v

    if a.load:
        with open(a.load) as f:
            data = json.load(f)
        data["loaded_from"] = a.load
        data["argv_compare"] = sys.argv
    else:
        from transformers import AutoTokenizer

        model_path = a.model_path
        if model_path is None:
            from srt.default_model import ensure_default_model

            model_path = ensure_default_model()
        with open(a.prompts_file) as f:
            prompts = json.load(f)
        tok = AutoTokenizer.from_pretrained(model_path)
        ids = {kind: [chat_ids(tok, x) for x in prompts[kind][:a.prompts]] for kind in KINDS}
        data = {"bench": "speculative", "argv": sys.argv, "hardware": hardware(),
                "model_path": model_path, "max_new_tokens": a.max_new_tokens,
                "prompts_file": a.prompts_file, "prompts_per_kind": len(ids[KINDS[0]]),
                "prompt_tokens": {k: [len(x) for x in v] for k, v in ids.items()},
                "modes": {}}
        a.draft_path = a.draft_model_path
        if "standalone" in a.spec and a.draft_path is None:
            a.draft_path = cut_draft(model_path, a.draft_layers)
            data["draft"] = {"layer_prefix_of": model_path, "path": a.draft_path}
        for mode in a.spec:
            m = data["modes"][mode] = run_mode(a, mode, model_path, ids)
            print(f"{mode}: started in {m['startup_s']} s; "
                  + ", ".join(f"{c} {r['tok_per_s']} tok/s" for c, r in m["results"].items()),
                  flush=True)
            write_json(a.out, data)  # a later mode that fails leaves this one's figures

    rows = table_rows(data["modes"], vllm)
    data["rows"] = rows
    if vllm:
        data["vllm"] = {m: {k: x for k, x in v.items() if not k.startswith("ids_")}
                        for m, v in vllm.items()}
    cols: list[str] = []
    for r in rows:
        cols += [c for c in r if c not in cols]
    # srt's columns first, then srt against vLLM (the last table printed)
    ours = [c for c in cols if "vllm" not in c]
    print_table(rows, ours)
    if vllm:
        print()
        print_table(rows, ["kind", "batch"] + [c for c in cols if "vllm" in c])
    write_json(a.out, data)


if __name__ == "__main__":
    main()
