"""Constrained decoding: time per output token against unconstrained decoding, and what
jump-forward gains on a JSON schema with long keys.

    python3 benchmarks/bench_constrained.py --out constrained.json              # SmolLM2, real
    python3 benchmarks/bench_constrained.py --shape llama3-8b --out c8b.json    # random weights

Every part runs once per `--grammar-backend` (xgrammar by default; give several to compare
their per-step mask cost: each gets its rows). Constrained decoding needs outlines-core and a byte-level tokenizer, so every run uses a real
tokenizer: the default model's (SmolLM2-135M-Instruct), with its real weights, or with
`--shape NAME` a model of that shape with random bf16 weights and SmolLM2's tokenizer (its vocab
size set to the tokenizer's). It runs on the CPU too (a smoke check: `--output-len 24
--batch-sizes 1 2`); where outlines-core is not installed only the unconstrained rows are
measured and the script says so.

Part 1, per batch size (default 1 and 16): `--output-len` tokens per request, unconstrained
(ignore_eos) and constrained by a regex that never forces text (`[a-z ,.]+`, min_new_tokens =
max_new_tokens so every request writes exactly that many tokens). Time per output token is
(time of the batch - time of the same batch with one output token) / (output_len - 1), the
median over `--runs`, so prefill and the compile (warmed up first) are not counted.

Part 2: greedy output under a JSON schema with long keys, the same batch with jump-forward on
and off (`--disable-regex-jump-forward`, a second engine), reported as output characters per
second; the speedup is on / off. With random weights the values are arbitrary but valid, and the
keys are what jump-forward appends.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import SHAPES, hardware, print_table, write_json

FREE_REGEX = r"[a-z ,.]+"
LONG_KEYS_SCHEMA = {"type": "object", "properties": {
    "full_name_of_the_customer": {"type": "string", "maxLength": 16},
    "customer_account_identifier": {"type": "string", "maxLength": 8},
    "preferred_contact_channel": {"enum": ["email", "phone", "letter"]},
    "is_subscribed_to_the_newsletter": {"type": "boolean"},
    "shipping_address_country_code": {"enum": ["FR", "DE", "US", "JP"]}},
    "required": ["full_name_of_the_customer", "customer_account_identifier",
                 "preferred_contact_channel", "is_subscribed_to_the_newsletter",
                 "shipping_address_country_code"]}
PROMPT = "Write a customer record as JSON:"


def _has_outlines() -> bool:
    try:
        import outlines_core  # noqa: F401
    except ImportError:
        return False
    return True


def _model_dir(shape: str | None, tokenizer_dir: str | None) -> tuple[str, dict[str, Any]]:
    """(model path, extra engine arguments): the default model, or a shape with random weights
    and the default model's tokenizer (or the one in `tokenizer_dir`)."""
    from srt.default_model import ensure_default_model

    if shape is None:
        if tokenizer_dir:
            raise SystemExit("--tokenizer-dir needs --shape (random weights)")
        return ensure_default_model(), {}
    default = tokenizer_dir or ensure_default_model()
    from transformers import AutoTokenizer, LlamaConfig

    tok = AutoTokenizer.from_pretrained(default)
    path = tempfile.mkdtemp(prefix=f"srt-constrained-{shape}-")
    cfg = LlamaConfig(**{**SHAPES[shape], "vocab_size": len(tok)}, rms_norm_eps=1e-5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(path)
    for name in os.listdir(default):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(default, name), path)
    return path, {"load_format": "dummy", "dtype": "bfloat16"}


def _engine(a: Any, path: str, extra: dict[str, Any], **kw: Any) -> Any:
    import srt

    args = {**extra, **kw, "random_seed": 0, "log_level": a.log_level}
    if a.device:
        args["device"] = a.device
    return srt.Engine(path, **args)


def _batch_time(engine: Any, n: int, params: dict[str, Any]) -> tuple[float, list[Any]]:
    t = time.perf_counter()
    outs = engine.generate([PROMPT] * n, [dict(params) for _ in range(n)])
    return time.perf_counter() - t, outs if isinstance(outs, list) else [outs]


def per_token(engine: Any, a: Any, bs: int, params: dict[str, Any]) -> float:
    """Seconds per output token of one request in a batch of bs (see the module docstring)."""
    long = {**params, "max_new_tokens": a.output_len}
    one = {**params, "max_new_tokens": 1}
    if "regex" in params:
        long["min_new_tokens"] = a.output_len
    _batch_time(engine, bs, long)  # warm-up (and the pattern's compile)
    runs = []
    for _ in range(a.runs):
        t1, _ = _batch_time(engine, bs, one)
        tn, outs = _batch_time(engine, bs, long)
        assert all(o["meta_info"]["completion_tokens"] == a.output_len for o in outs), outs[0]
        runs.append((tn - t1) / (a.output_len - 1))
    return statistics.median(runs)


def json_chars_per_s(engine: Any, a: Any, bs: int) -> tuple[float, float, int]:
    """(output characters per second, forward passes per request, characters per request)."""
    params = {"temperature": 0, "max_new_tokens": a.json_max_tokens,
              "json_schema": LONG_KEYS_SCHEMA}
    _batch_time(engine, bs, params)  # warm-up
    rates, passes, chars = [], [], []
    for _ in range(a.runs):
        t, outs = _batch_time(engine, bs, params)
        n_chars = sum(len(o["text"]) for o in outs)
        for o in outs:
            json.loads(o["text"])  # complete and valid
        rates.append(n_chars / t)
        passes.append(statistics.mean(o["meta_info"]["forward_passes"] for o in outs))
        chars.append(n_chars // bs)
    return statistics.median(rates), statistics.median(passes), int(statistics.median(chars))


def _measure(a: Any, path: str, extra: dict[str, Any],
             constrained: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Any]:
    """Per-token rows and jump-forward rows of one grammar backend (in `extra`)."""
    rows: list[dict[str, Any]] = []
    with _engine(a, path, extra) as engine:
        info = engine.model_info
        for bs in [] if a.jump_only else a.batch_sizes:
            row: dict[str, Any] = {"batch": bs}
            free = per_token(engine, a, bs, {"temperature": 0, "ignore_eos": True})
            row["free_ms_per_tok"] = free * 1e3
            if constrained:
                regex = per_token(engine, a, bs, {"temperature": 0, "regex": FREE_REGEX})
                row["regex_ms_per_tok"] = regex * 1e3
                row["regex_overhead"] = regex / free
            rows.append(row)
            print(f"measured {extra['grammar_backend']} {row}", flush=True)
        jump_rows: list[dict[str, Any]] = []
        if constrained:
            for bs in a.batch_sizes:
                rate, passes, chars = json_chars_per_s(engine, a, bs)
                jump_rows.append({"batch": bs, "jf_chars_per_s": rate, "jf_passes": passes,
                                  "chars": chars})
                print(f"measured {jump_rows[-1]}", flush=True)
    if constrained:
        with _engine(a, path, extra, disable_regex_jump_forward=True) as engine:
            for r in jump_rows:
                rate, passes, _ = json_chars_per_s(engine, a, r["batch"])
                r.update(off_chars_per_s=rate, off_passes=passes,
                         speedup=r["jf_chars_per_s"] / rate)
                print(f"measured {r}", flush=True)
        for m in a.jump_min_tokens:
            with _engine(a, path, extra, jump_forward_min_tokens=m) as engine:
                for r in jump_rows:
                    rate, passes, _ = json_chars_per_s(engine, a, r["batch"])
                    r[f"min{m}_speedup"] = rate / r["off_chars_per_s"]
                    r[f"min{m}_passes"] = passes
                    print(f"measured {r}", flush=True)
    return rows, jump_rows, info


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="random weights of this shape (default: SmolLM2's real weights)")
    p.add_argument("--tokenizer-dir", default=None,
                   help="with --shape: take SmolLM2's tokenizer files from this directory "
                   "instead of preparing the default model (a machine without its weights)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: the server's)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--json-max-tokens", type=int, default=256)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--jump-min-tokens", type=int, nargs="*", default=[],
                   help="also run jump-forward with each --jump-forward-min-tokens value")
    p.add_argument("--jump-only", action="store_true", help="skip the per-token part")
    p.add_argument("--grammar-backend", nargs="+", default=["xgrammar"],
                   choices=["xgrammar", "llguidance", "outlines"],
                   help="measure each of these grammar backends (one row each)")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    constrained = _has_outlines()
    if not constrained:
        print("outlines-core is not installed: only unconstrained decoding is measured")
    path, extra = _model_dir(a.shape, a.tokenizer_dir)
    rows: list[dict[str, Any]] = []
    jump_rows: list[dict[str, Any]] = []
    for backend in a.grammar_backend:
        b_rows, b_jump, info = _measure(a, path, {**extra, "grammar_backend": backend},
                                        constrained)
        rows += [{"backend": backend, **r} for r in b_rows]
        jump_rows += [{"backend": backend, **r} for r in b_jump]
    print(f"model {a.shape or 'SmolLM2-135M-Instruct'} on {info['device']} ({info['dtype']}, "
          f"{info['attention_backend']}, cuda graph {info['cuda_graph']})")
    if rows:
        print_table(rows, list(rows[0]))
    if constrained:
        print()
        print_table(jump_rows, ["backend", "batch", "chars", "jf_chars_per_s", "off_chars_per_s",
                                "speedup", "jf_passes", "off_passes"]
                    + [f"min{m}_{k}" for m in a.jump_min_tokens for k in ("speedup", "passes")])
    write_json(a.out, {"bench": "constrained", "argv": sys.argv, "hardware": hardware(),
                       "model": a.shape or "SmolLM2-135M-Instruct", "model_info": info,
                       "per_token": rows, "jump_forward": jump_rows})


if __name__ == "__main__":
    main()
