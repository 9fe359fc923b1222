"""How long a new request waits while others decode: the latency of short probe requests
(one output token) arriving one by one while long streams run.

    python3 benchmarks/bench_admission.py [--streams 4] [--probes 20] [--interval 0.3]
        [--model-path DIR] [--out FILE] [ServerArgs flags, e.g. --device cpu]

Starts `python -m srt.server` (default: the default SmolLM2 model), starts --streams requests of
many output tokens, then sends --probes requests of one output token --interval seconds apart,
each alone, and reports their latency (the time to the first token) and the decode step time of
the same run (rank 0's counters). A probe that arrives during a round of several decode steps
waits for that round unless the round ends for it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

from benchmarks.common import hardware, parse_with_server_args, print_table, write_json
from benchmarks.launch import launch_server
from srt.model_process.step_timing import PHASES, per_step_ms
from srt.utils import free_port


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default=None)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--probes", type=int, default=20)
    p.add_argument("--interval", type=float, default=0.3)
    p.add_argument("--out")
    a = parse_with_server_args(p)
    if a.model_path is None:
        from srt.default_model import ensure_default_model

        a.model_path = ensure_default_model()
    log = os.path.join(tempfile.mkdtemp(), "server.log")
    srv = launch_server(a.model_path, a.server_args, free_port(), log)
    try:
        url = srv.url
        post(url + "/generate", {"text": "warm up", "sampling_params": {"max_new_tokens": 4}})

        def stream(k: int) -> None:
            post(url + "/generate", {"text": f"Write a long story number {k}.",
                                     "sampling_params": {"max_new_tokens": a.stream_tokens,
                                                         "ignore_eos": True,
                                                         "temperature": 0}})

        threads = [threading.Thread(target=stream, args=(k,), daemon=True)
                   for k in range(a.streams)]
        for t in threads:
            t.start()
        time.sleep(2.0)  # the streams are decoding
        before = post_info(url)
        lat = []
        for k in range(a.probes):
            t0 = time.perf_counter()
            post(url + "/generate", {"text": f"Probe {k}: say one word.",
                                     "sampling_params": {"max_new_tokens": 1}})
            lat.append((time.perf_counter() - t0) * 1e3)
            time.sleep(a.interval)
        steps = per_step_ms(before["decode_step_times"], post_info(url)["decode_step_times"])
    finally:
        srv.stop()
    total = steps["total"] or {}
    row = {"streams": a.streams, "probes": a.probes,
           "latency_p50_ms": round(statistics.median(lat), 1),
           "latency_p90_ms": round(sorted(lat)[int(0.9 * (len(lat) - 1))], 1),
           "latency_max_ms": round(max(lat), 1),
           "decode_step_ms": round(sum(total[f"{x}_ms"] for x in PHASES), 2)
           if total else None}
    print_table([row], list(row))
    write_json(a.out, {"bench": "admission", "argv": sys.argv, "hardware": hardware(),
                       **row, "latencies_ms": lat})


def post_info(url: str) -> dict:
    with urllib.request.urlopen(url + "/get_server_info", timeout=60) as r:
        return json.loads(r.read())


if __name__ == "__main__":
    main()
