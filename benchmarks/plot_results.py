"""Charts from the benchmark JSON files (run on a CPU machine; needs matplotlib).

    python3 benchmarks/plot_results.py benchmarks/results/latest [--out-dir DIR]

Reads every `*.json` written by bench_offline, bench_prefix and bench_serving in the given
directories (or files) and writes:
- `throughput.png`: W1 output tok/s (srt, and transformers' generate_batch on its 64-request
  subset next to srt on the same subset), W2 requests/s with and without the radix cache, and
  serving output tok/s per configuration (HTTP, and srt.Engine where compared);
- `latency.png`: p50 / p90 / p99 of TTFT, inter-token latency and end-to-end latency per
  serving configuration;
- `host_overhead.png` (when bench_offline recorded it): host ms per decode step by batch size.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from typing import Any


def load_results(paths: list[str]) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """(file stem, JSON) per benchmark kind: offline_w1, prefix_w2, serving."""
    files: list[str] = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "*.json"))) if os.path.isdir(p) else [p]
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for f in files:
        with open(f) as fh:
            try:
                data = json.load(fh)
            except ValueError:
                continue
        if isinstance(data, dict) and "bench" in data:
            stem = os.path.splitext(os.path.basename(f))[0]
            out.setdefault(data["bench"], []).append((stem, data))
    return out


def _bars(ax: Any, labels: list[str], series: dict[str, list[float | None]], title: str,
          ylabel: str) -> None:
    """Grouped bars: one group per label, one bar per series (None: no bar)."""
    n = max(1, len(series))
    width = 0.8 / n
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(labels))]
        ys = [v if v is not None else 0.0 for v in values]
        bars = ax.bar(xs, ys, width, label=name)
        for b, v in zip(bars, values):
            if v is not None:
                ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def _serving_label(stem: str, run: dict[str, Any]) -> str:
    rate = run["request_rate"]
    rate_s = "inf" if rate == float("inf") else f"{rate:g}/s"
    conc = run["max_concurrency"]
    return f"{stem.replace('serving_', '')}\nrate {rate_s}" + (f", conc {conc}" if conc else "")


def plot_throughput(res: dict[str, list[tuple[str, dict[str, Any]]]], path: str) -> bool:
    import matplotlib.pyplot as plt

    panels = [k for k in ("offline_w1", "prefix_w2", "serving") if res.get(k)]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, kind in zip(axes[0], panels):
        if kind == "offline_w1":
            labels, w1, sub_srt, sub_hf = [], [], [], []
            for stem, d in res[kind]:
                labels.append(f"{d['shape']} tp{d['tp']}")
                w1.append(d["out_tok_per_s"])
                c = d.get("compare_hf") or {}
                sub_srt.append(c["srt"]["out_tok_per_s"] if c else None)
                sub_hf.append(c["hf"]["out_tok_per_s"] if c else None)
            _bars(ax, labels, {"srt W1": w1, "srt 64 req": sub_srt,
                               "transformers 64 req": sub_hf},
                  "offline (W1)", "output tokens/s")
        elif kind == "prefix_w2":
            labels, on, off = [], [], []
            for stem, d in res[kind]:
                runs = {r["radix_cache"]: r for r in d["runs"]}
                labels.append(f"{d['runs'][0]['shape']}\n{stem}")  # the file tells runs apart
                on.append(runs[True]["req_per_s"] if True in runs else None)
                off.append(runs[False]["req_per_s"] if False in runs else None)
            _bars(ax, labels, {"radix cache": on, "no cache": off},
                  "shared prefix (W2)", "requests/s")
        else:
            labels, http, eng = [], [], []
            for stem, d in res[kind]:
                for r in d["runs"]:
                    labels.append(_serving_label(stem, r))
                    http.append(r["out_tok_per_s"])
                    eng.append(r.get("engine_out_tok_per_s"))
            series: dict[str, list[float | None]] = {"HTTP": http}
            if any(v is not None for v in eng):
                series["srt.Engine"] = eng
            _bars(ax, labels, series, "serving", "output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_latency(res: dict[str, list[tuple[str, dict[str, Any]]]], path: str) -> bool:
    import matplotlib.pyplot as plt

    runs = [(_serving_label(stem, r), r) for stem, d in res.get("serving", []) for r in d["runs"]]
    if not runs:
        return False
    metrics = [("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"),
               ("e2e_ms", "end-to-end latency")]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), squeeze=False)
    labels = [lab for lab, _ in runs]
    for ax, (key, title) in zip(axes[0], metrics):
        _bars(ax, labels, {p: [r.get(f"{key}_{p}") for _, r in runs]
                           for p in ("p50", "p90", "p99")}, title, "ms")
        ax.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_host_overhead(res: dict[str, list[tuple[str, dict[str, Any]]]], path: str) -> bool:
    import matplotlib.pyplot as plt

    curves = []
    for stem, d in res.get("offline_w1", []):
        by = (d.get("decode_step_ms") or {}).get("by_batch") or {}
        if by:
            buckets = sorted(by, key=int)
            curves.append((f"{d['shape']} tp{d['tp']}", [int(b) for b in buckets],
                           [by[b]["host_ms"] for b in buckets],
                           [by[b]["forward_ms"] + by[b]["sample_ms"] for b in buckets]))
    if not curves:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for name, xs, host, dev in curves:
        ax.plot(xs, host, marker="o", label=f"{name}: host")
        ax.plot(xs, dev, marker="x", linestyle="--", label=f"{name}: forward + sample")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("decode batch size (bucket upper bound)")
    ax.set_ylabel("ms per decode step")
    ax.set_title("decode step: host time vs forward + sampling (W1)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("paths", nargs="+", help="result directories or JSON files")
    p.add_argument("--out-dir", default=None, help="default: the first path's directory")
    a = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    res = load_results(a.paths)
    first = a.paths[0]
    out_dir = a.out_dir or (first if os.path.isdir(first) else os.path.dirname(first) or ".")
    os.makedirs(out_dir, exist_ok=True)
    for name, fn in (("throughput.png", plot_throughput), ("latency.png", plot_latency),
                     ("host_overhead.png", plot_host_overhead)):
        target = os.path.join(out_dir, name)
        if fn(res, target):
            print(target)


if __name__ == "__main__":
    main()
