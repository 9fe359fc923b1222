"""The device side of a chained NGRAM verification step (`spec_chain`): the draft lookup, and
CUDA graphs of the whole step's device work, so that launching a step costs the host a few
replays instead of some eighty small launches (a batch-1 step of a small model is otherwise
bound by the host, not the GPU).

A graphed step is three replays on one stream:

  1. `pre[B, W]`: from the step's inputs (the requests' rows and the slots the host gave them, in
     `inp`) and the chain's device tokens (`hist[:B, :W]`, `dlen`): the lookup, and the rows'
     ids, positions, lengths, request rows and slots written straight into the decode graphs'
     static inputs (padding rows as `CudaGraphRunner.replay` pads them), and the slots into
     `req_to_token`;
  2. the decode graph of the padded row count (`CudaGraphRunner.replay_static`);
  3. `post[B]` (greedy rows only): each row's argmax, the accepted count, `hist` / `dlen` /
     `last_ids` advanced, and the step's result packed for the host (`packed`).

W is the lookup's width: the smallest power of two (at least 256) that holds every request's
tokens after the step, so one graph serves many steps and the lookup reads little past the
tokens. Graphs are captured when first needed; capture records without running, so the state
the host and device hold is not touched. Everything a graph reads or writes outside itself
lives in tensors made once here (or in the chain and the decode graphs), so its addresses stay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srt.model_process.cuda_graph_runner import CudaGraphRunner

MIN_WIDTH = 256


class CaptureFailed(RuntimeError):
    """A chain graph could not be captured (nothing ran; the caller runs the step eagerly)."""


def lookup(hist: torch.Tensor, lens: torch.Tensor, k: int, min_n: int,
           max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """NGRAM drafts on the device: `hist` [B, W] each request's tokens (the first lens[b] of
    its row count), k >= 1. Returns (drafts [B, k] int64, found [B] bool): the tokens after the
    latest occurrence of the longest recurring suffix of min_n .. max_n tokens (continued as an
    overlapping copy near the end), as `NgramIndex.propose` drafts them. A request whose suffix
    of min_n tokens never occurred before drafts its last token k times. Memory: a few [B, W]
    tensors (no [B, W, max_n] window tensor)."""
    B, W = hist.shape
    dev = hist.device
    last = (lens - 1).unsqueeze(1)  # [B, 1]
    # match[b, j]: how many tokens ending at j equal the suffix ending at last (up to max_n)
    run = torch.ones((B, W), dtype=torch.bool, device=dev)
    match = torch.zeros((B, W), dtype=torch.int32, device=dev)
    for t in range(max_n):
        s_t = hist.gather(1, (last - t).clamp(min=0))  # the suffix's t-th token from the end
        # hist[b, j - t] at column j (-1 before the start: never a token)
        shifted = torch.nn.functional.pad(hist[:, : W - t], (t, 0), value=-1) if t else hist
        run &= (shifted == s_t) & (t < lens).unsqueeze(1)
        match += run
    j = torch.arange(W, device=dev).unsqueeze(0)
    match = torch.where(j <= last - 1, match, 0)  # followed by a token
    score = torch.where(match >= min_n, match * W + j, -1)  # longest, then latest
    best, end = score.max(dim=1)
    found = best >= 0
    start = end + 1
    period = (lens - start).clamp(min=1).unsqueeze(1)
    i = torch.arange(k, device=dev)
    idx = start.unsqueeze(1) + i.unsqueeze(0) % period
    h = hist.to(torch.int64)
    drafts = h.gather(1, idx.clamp(max=W - 1))
    drafts = torch.where(found.unsqueeze(1), drafts, h.gather(1, last).expand(B, k))
    return drafts, found


def width_for(tokens: int, limit: int) -> int:
    """The lookup width for requests of at most `tokens` tokens (a power of two, >= MIN_WIDTH,
    at most `limit`)."""
    w = MIN_WIDTH
    while w < tokens:
        w *= 2
    return min(w, limit)


def step_inputs(hist: torch.Tensor, lens: torch.Tensor, rows: torch.Tensor, k: int, min_n: int,
                max_n: int) -> tuple[torch.Tensor, ...]:
    """A chained step's rows from the device tokens (`hist` [B, W], `lens` [B]) and the
    requests' rows of req_to_token (`rows` [B]): (input_ids, positions, req_idx) [B * (k + 1)]
    each, request by request, the root first; drafts [B, k]; found [B]."""
    B, R = hist.shape[0], k + 1
    drafts, found = lookup(hist, lens, k, min_n, max_n)
    root = hist.gather(1, (lens - 1).unsqueeze(1)).to(torch.int64)
    input_ids = torch.cat([root, drafts], dim=1).view(-1)
    positions = ((lens - 1).unsqueeze(1)
                 + torch.arange(R, device=lens.device).unsqueeze(0)).view(-1)
    req_idx = rows.unsqueeze(1).expand(B, R).reshape(-1)
    return input_ids, positions, req_idx, drafts, found


def step_outputs(out: torch.Tensor, lens: torch.Tensor, drafts: torch.Tensor,
                 found: torch.Tensor, rows: torch.Tensor, hist: torch.Tensor,
                 dlen: torch.Tensor, last_ids: torch.Tensor) -> torch.Tensor:
    """Book a chained step whose rows emitted `out` [B, k + 1] on the device: the accepted
    count (the leading drafts equal to the emitted tokens), every row's output into `hist`
    after the root (those past the accepted ones are overwritten later), `dlen` past the kept
    ones, the last kept token into `last_ids[rows]`. Returns the result for the host [B, k + 3]:
    the emitted ids, the accepted count, found."""
    B, R = out.shape
    accepted = (out[:, : R - 1] == drafts).to(torch.int64).cumprod(1).sum(1)
    cols = lens.unsqueeze(1) + torch.arange(R, device=lens.device).unsqueeze(0)
    hist[:B].scatter_(1, cols, out.to(hist.dtype))
    dlen[:B].copy_(lens + accepted + 1)
    last_ids.index_copy_(0, rows, out.gather(1, accepted.unsqueeze(1)).view(-1))
    return torch.cat([out, accepted.unsqueeze(1), found.to(torch.int64).unsqueeze(1)], 1)


class ChainGraphs:
    def __init__(self, hist: torch.Tensor, dlen: torch.Tensor, last_ids: torch.Tensor,
                 req_to_token: torch.Tensor, gr: CudaGraphRunner, k: int, min_n: int,
                 max_n: int) -> None:
        """`hist` / `dlen`: the chain's device tokens (rows = the most requests a chain
        holds); `last_ids`: the executor's per-row last sampled id; `gr`: the decode graphs."""
        self.hist, self.dlen, self.last_ids, self.req_to_token = hist, dlen, last_ids, req_to_token
        self.gr = gr
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.R = k + 1
        n = hist.shape[0]
        dev = hist.device
        self.slot_at = -(-n // 16) * 16  # the slots' offset in `inp` (rows first)
        self.inp = torch.zeros(self.slot_at + n * self.R, dtype=torch.int64, device=dev)
        self.lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.drafts = torch.zeros((n, k), dtype=torch.int64, device=dev)
        self.found = torch.zeros(n, dtype=torch.bool, device=dev)
        self.packed = torch.zeros((n, self.R + 2), dtype=torch.int64, device=dev)
        self.pool = torch.cuda.graph_pool_handle()
        self.pre: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.post: dict[int, torch.cuda.CUDAGraph] = {}
        self.captures = 0

    def fits(self, B: int) -> bool:
        return B <= self.hist.shape[0] and B * self.R <= self.gr.max_bs

    def padded(self, B: int) -> int:
        from srt.model_process.cuda_graph_runner import padded_size

        return padded_size(self.gr.sizes, B * self.R)

    # ---------------------------------------------------------------- the graphs' bodies

    def _pre_body(self, B: int, W: int) -> None:
        gr = self.gr
        n = B * self.R
        pbs = self.padded(B)
        loc = self.inp[self.slot_at: self.slot_at + n]
        lens = self.dlen[:B]
        self.lens[:B].copy_(lens)
        input_ids, positions, req_idx, drafts, found = step_inputs(
            self.hist[:B, :W], lens, self.inp[:B], self.k, self.min_n, self.max_n)
        self.drafts[:B].copy_(drafts)
        self.found[:B].copy_(found)
        gr.input_ids[:n].copy_(input_ids)
        gr.positions[:n].copy_(positions)
        gr.seq_lens[:n].copy_(positions + 1)
        gr.req_pool_indices[:n].copy_(req_idx)
        gr.out_cache_loc[:n].copy_(loc)
        if pbs > n:
            gr.input_ids[n:pbs].zero_()
            gr.positions[n:pbs].zero_()
            gr.out_cache_loc[n:pbs].fill_(gr.pad_slot)
            gr.req_pool_indices[n:pbs].zero_()
            gr.seq_lens[n:pbs].fill_(1)
        self.req_to_token[req_idx, positions] = loc.to(self.req_to_token.dtype)

    def _post_body(self, B: int) -> None:
        logits = self.gr.outputs[self.padded(B)][: B * self.R]
        out = logits.argmax(dim=-1).view(B, self.R)
        self.packed[:B].copy_(step_outputs(out, self.lens[:B], self.drafts[:B], self.found[:B],
                                           self.inp[:B], self.hist, self.dlen, self.last_ids))

    def _capture(self, body, *args) -> torch.cuda.CUDAGraph:  # type: ignore[no-untyped-def]
        # capture_begin / capture_end rather than `torch.cuda.graph`, whose entry synchronizes
        # the device and empties the allocator's caches: this runs while serving
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self.hist.device)
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream):
                g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    body(*args)
                finally:
                    g.capture_end()
        except RuntimeError as e:  # (recording runs nothing: no state has changed)
            raise CaptureFailed(str(e)) from e
        finally:
            torch.cuda.current_stream().wait_stream(stream)
        self.captures += 1
        return g

    # ---------------------------------------------------------------- one step

    def run_pre(self, B: int, W: int, inp: torch.Tensor) -> int:
        """Step 1 with `inp` (the rows, then at `slot_at` the slots, on the device) copied in;
        returns the padded row count whose decode graph runs next."""
        self.inp[: inp.shape[0]].copy_(inp)
        g = self.pre.get((B, W))
        if g is None:
            g = self.pre[(B, W)] = self._capture(self._pre_body, B, W)
        g.replay()
        return self.padded(B)

    def run_post(self, B: int) -> torch.Tensor:
        """Step 3 (greedy rows); the packed result [B, R + 2]: emitted ids, accepted, found."""
        g = self.post.get(B)
        if g is None:
            g = self.post[B] = self._capture(self._post_body, B)
        g.replay()
        return self.packed[:B]
