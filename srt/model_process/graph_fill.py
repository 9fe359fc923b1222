"""Short fills as decode rows: a fill of few tokens runs through the decode CUDA graphs.

An eager fill of a small model is bound by the host: every layer's kernels are launched one by
one from Python (SmolLM2-135M: 330 module calls and 151 Triton launches, about 20 ms of host
time, for 1.1 ms of GPU work). A DECODE step already computes several rows of one request, each
at its own position and attending to the KV before it and to the rows before it in the same
step (a verification step, the step after a jump-forward); a fill of n new tokens is exactly n
such rows. So a fill of at most `--graph-fill-max-tokens` tokens in all is planned as one
DECODE row per token (`as_decode_rows`), and a decode batch of that many rows replays a
captured graph: its first token costs one replay, not hundreds of launches.

Not taken (the plan stays an EXTEND/PREFILL step): mixed steps, image spans, prompt or output
logprobs (computed per fill row by the extend path), embeddings, a draft model that mirrors the
step (STANDALONE, EAGLE), a request whose KV would make its rows read more than
`KV_READ_BUDGET` cached tokens in all (each decode row reads its whole prefix, an extend reads
it once per tile of rows), and on the CPU unless the flag is set (there no graph saves
anything; setting it there runs the same rows eagerly, which is how the tests check them).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from srt.layers.forward_batch import ForwardMode
from srt.model_process.batch import StepPlan

# Cached tokens all rows of a decode-row fill may read together (each row reads its prefix).
KV_READ_BUDGET = 1 << 16
# --graph-fill-max-tokens where it is not set and decode graphs are captured
DEFAULT_MAX_TOKENS = 256


def as_decode_rows(plan: StepPlan) -> StepPlan:
    """The fill `plan` (EXTEND/PREFILL, no running requests in it) as a DECODE step: one row
    per new token, at its position of its request's row, each request sampling from its last
    row. The slots and ids are the fill's; `fill` marks it as a fill for the loop."""
    ext = np.asarray(plan.extend_lens, dtype=np.int64)
    positions = plan.positions
    return StepPlan(ForwardMode.DECODE, plan.reqs, positions, np.repeat(plan.rows, ext),
                    positions + 1, positions.tolist(), [1] * len(positions),
                    plan.out_cache_loc, input_ids=plan.input_ids,
                    sample_rows=(np.cumsum(ext) - 1).tolist(), fill=True)


class GraphFill:
    def __init__(self, max_tokens: int, graph_rows: int | None, has_draft: bool,
                 pooling: bool) -> None:
        """`max_tokens`: the flag (0: never); `graph_rows`: the largest captured decode batch
        (None: no graphs, on the CPU or with --disable-cuda-graph)."""
        self.max_tokens = max_tokens
        if graph_rows is not None:
            self.max_tokens = min(max_tokens, graph_rows)
        self.off = self.max_tokens <= 0 or has_draft or pooling

    @classmethod
    def of(cls, args: Any, runner: Any) -> "GraphFill":
        """From the server's flags and its model runner."""
        graphs = runner.graph_runner
        flag = args.graph_fill_max_tokens
        if flag is None:
            flag = DEFAULT_MAX_TOKENS if graphs is not None else 0
        return cls(flag, None if graphs is None else graphs.max_bs, runner.draft is not None,
                   runner.pooling is not None)

    def plan(self, plan: StepPlan, counters: Any) -> StepPlan:
        """`plan` as decode rows where that applies (counted in `counters.graph_fills`), else
        `plan` itself."""
        if (self.off or plan.n_fill is not None or plan.images
                or len(plan.positions) > self.max_tokens
                or int(plan.seq_lens.astype(np.int64) @ np.asarray(plan.extend_lens))
                > KV_READ_BUDGET
                or any(r.logprob is not None for r in plan.reqs)):
            return plan
        counters.graph_fills += 1
        return as_decode_rows(plan)
