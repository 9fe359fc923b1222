"""Host cost of one streamed request in the HTTP process, per output token: the StrOut's
msgpack round trip (detokenizer -> HTTP process) and folding it into the request's state
(`ReqState.add`, the cumulative answer of SGLang's /generate stream; `add_delta`, what an
OpenAI stream sends). One token per StrOut, as a stream at stream_interval 1 receives them.

    python3 benchmarks/bench_stream_host.py [--tokens 1024 4096 16384] [--out FILE]

Rows: `cumulative wire` sends the whole text in every StrOut (as srt did before the text
travelled as deltas), `deltas` sends only the new text; each with and without logprobs. A
per-token cost that grows with the length is the O(n^2) of a stream.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.common import hardware, print_table, write_json
from srt.managers.io_struct import BatchStrOut, StrOut, TokenLogprobs, decode, encode
from srt.managers.request_state import LogprobState, ReqState


def run(n: int, logprobs: bool, wire: str, answer: str) -> float:
    """Microseconds per token of a stream of n tokens."""
    state = ReqState("r", logprobs=LogprobState() if logprobs else None)
    text = ""
    t = time.perf_counter()
    for i in range(n):
        piece = f"tok{i} "
        start = len(text)
        text += piece
        lp = TokenLogprobs([-0.5], [i], [[]], [[]]) if logprobs else None
        out = StrOut("r", text if wire == "cumulative" else piece, [i], 10, 0, i + 1,
                     output_logprobs=lp, text_start=0 if wire == "cumulative" else start)
        got = decode(encode(BatchStrOut([out]))).outs[0]
        state.add(got) if answer == "cumulative" else state.add_delta(got)
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--out")
    a = p.parse_args()
    rows = []
    for wire, answer, what in (("cumulative", "cumulative", "before: cumulative wire"),
                               ("delta", "cumulative", "deltas, /generate answer"),
                               ("delta", "delta", "deltas, OpenAI stream")):
        for lp in (False, True):
            row = {"path": what, "logprobs": lp}
            for n in a.tokens:
                row[f"us_per_token_{n}"] = round(run(n, lp, wire, answer), 2)
            rows.append(row)
    print_table(rows, list(rows[0]))
    write_json(a.out, {"bench": "stream_host", "argv": sys.argv, "hardware": hardware(),
                       "rows": rows})


if __name__ == "__main__":
    main()
