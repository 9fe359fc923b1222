"""Logprobs of one forward step: which rows need them, the step's one host transfer, and the
per-request results.

Used only when some request of the batch asked for logprobs; otherwise the step copies its
sampled ids to the host as before and nothing here runs.

One float64 device buffer holds, in order: the sampled ids [bs], the prompt logprob rows and the
output logprob rows (layout in srt/layers/logprobs.py). The logits processor writes the prompt
rows during the forward; `collect` writes the ids and the output rows, then copies the buffer to
the host once.

Prompt logprobs (contract of `logprob_start_len = s`): entries for prompt tokens s .. L-1; the
entry of token p needs the logits at position p - 1, so the scheduler computes the prompt from
position max(s - 1, 0) on (the radix-cache match is cut there). Token 0 has no logprob (None).
They are computed once, at the request's first fill; a chunked prompt gets, at each chunk, the
entries whose logits that chunk computes (tokens pre + 1 .. pre + ext of a chunk computing
positions pre .. pre + ext - 1), which the model process appends in order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.layers.forward_batch import ForwardMode
from srt.layers.logprobs import PromptLogprobRequest, row_width, write_logprob_rows
from srt.managers.io_struct import TokenLogprobs
from srt.model_process.req import Req


@dataclass
class _PromptSpan:
    batch_index: int
    lead_none: bool  # the entry of token 0 (no logprob) comes first
    first_pos: int  # the prompt position of the first computed entry
    first_row: int  # its first row among the step's prompt rows
    n_rows: int
    top_k: int


def prefix_limit(req: Req) -> int:
    """How many leading tokens of the request may come from the radix cache at this fill."""
    if req.pool_all:
        return 0  # an embedding pooled over every token: all of them computed
    limit = len(req.fill_ids) - 1  # at least one token is computed: its logits give the next
    if req.wants_prompt_logprobs:
        limit = min(limit, max(req.logprob.logprob_start_len - 1, 0))
    return limit


class StepLogprobs:
    """Plan and buffer of one step. Build it before the forward (it sets the prompt request),
    call `launch` after sampling and `collect` when the step's results are needed."""

    def __init__(self, batch: list[Req], mode: ForwardMode, prefix_lens: list[int],
                 extend_lens: list[int], device: torch.device) -> None:
        self.bs = len(batch)
        self.reqs = batch
        self.spans: list[_PromptSpan] = []
        rows: list[int] = []
        next_ids: list[int] = []
        if mode.is_extend():
            offset = 0
            for i, (r, pre, ext) in enumerate(zip(batch, prefix_lens, extend_lens)):
                if r.wants_prompt_logprobs:
                    s = r.logprob.logprob_start_len
                    prompt = r.origin_input_ids
                    first = max(s, 1)  # token 0 has no logprob
                    # The first chunk (or the whole prompt) must compute position first - 1;
                    # a later chunk starts after entries an earlier one computed.
                    if first - 1 < pre and r.input_logprobs is None:
                        raise RuntimeError(f"prompt position {first - 1} of {r.rid} is cached "
                                           "but its logprobs were asked for")
                    lo, hi = max(first, pre + 1), min(len(prompt), pre + ext + 1)
                    n = max(0, hi - lo)
                    self.spans.append(_PromptSpan(i, s == 0 and pre == 0, lo, len(rows), n,
                                                  r.logprob.top_logprobs_num))
                    rows.extend(offset + p - 1 - pre for p in range(lo, lo + n))
                    next_ids.extend(prompt[lo : lo + n])
                offset += ext
        self.out_rows = [i for i, r in enumerate(batch) if r.logprob is not None]
        self.prompt_k = max((sp.top_k for sp in self.spans), default=0)
        self.out_k = max((batch[i].logprob.top_logprobs_num for i in self.out_rows), default=0)
        self.prompt_shape = (len(rows), row_width(self.prompt_k))
        self.out_shape = (len(self.out_rows), row_width(self.out_k))
        n_prompt = self.prompt_shape[0] * self.prompt_shape[1]
        n_out = self.out_shape[0] * self.out_shape[1]
        self.buffer = torch.empty(self.bs + n_prompt + n_out, dtype=torch.float64, device=device)
        self._prompt_view, self._out_view = self._split(self.buffer)
        self.prompt_request: PromptLogprobRequest | None = None
        if rows:
            self.prompt_request = PromptLogprobRequest(
                rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
                next_ids=torch.tensor(next_ids, dtype=torch.int64).to(device, non_blocking=True),
                top_k=self.prompt_k,
                out=self._prompt_view,
            )

    def launch(self, logits: torch.Tensor, next_ids: torch.Tensor) -> None:
        """After sampling: write the ids and the output rows into the buffer and start its copy
        to the host (logits [bs, vocab] raw, next_ids [bs]). Must run before the next forward
        is launched: a CUDA graph's logits are overwritten by its next replay."""
        self.buffer[: self.bs] = next_ids
        if self.out_rows:
            rows = torch.tensor(self.out_rows, dtype=torch.int64).to(logits.device,
                                                                    non_blocking=True)
            write_logprob_rows(logits[rows], next_ids[rows], self.out_k, self._out_view)
        self.done: torch.cuda.Event | None = None
        if self.buffer.device.type == "cuda":
            self.host = torch.empty(self.buffer.shape, dtype=self.buffer.dtype, pin_memory=True)
            self.host.copy_(self.buffer, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = self.buffer

    def collect(self) -> tuple[list[int], list[TokenLogprobs | None], list[TokenLogprobs | None]]:
        """After `launch`: wait for the copy -> (next ids, prompt logprobs per request,
        logprobs of each request's sampled token); None where not asked."""
        if self.done is not None:
            self.done.synchronize()
        host = self.host
        ids = [int(t) for t in host[: self.bs].tolist()]
        prompt_host, out_host = self._split(host)
        prompt_rows, out_rows = prompt_host.tolist(), out_host.tolist()
        inputs: list[TokenLogprobs | None] = [None] * self.bs
        for sp in self.spans:
            prompt = self.reqs[sp.batch_index].origin_input_ids
            lp = TokenLogprobs()
            if sp.lead_none:
                lp.logprobs.append(None)
                lp.token_ids.append(prompt[0])
                lp.top_logprobs.append(None)
                lp.top_ids.append(None)
            for j in range(sp.n_rows):
                _append_row(lp, prompt[sp.first_pos + j], prompt_rows[sp.first_row + j],
                            self.prompt_k, sp.top_k)
            inputs[sp.batch_index] = lp
        outputs: list[TokenLogprobs | None] = [None] * self.bs
        for j, i in enumerate(self.out_rows):
            lp = TokenLogprobs()
            _append_row(lp, ids[i], out_rows[j], self.out_k,
                        self.reqs[i].logprob.top_logprobs_num)
            outputs[i] = lp
        return ids, inputs, outputs

    def _split(self, buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt rows and the output rows of the buffer (device or host copy)."""
        n_prompt = self.prompt_shape[0] * self.prompt_shape[1]
        prompt = buffer[self.bs : self.bs + n_prompt].view(self.prompt_shape)
        return prompt, buffer[self.bs + n_prompt :].view(self.out_shape)


def _append_row(lp: TokenLogprobs, token_id: int, row: list[float], width_k: int,
                top_k: int) -> None:
    """One host row (layout of srt/layers/logprobs.py, with width_k top columns) -> one entry
    keeping the request's own top_k."""
    lp.logprobs.append(row[0])
    lp.token_ids.append(token_id)
    lp.top_logprobs.append(row[1 : 1 + top_k])
    lp.top_ids.append([int(t) for t in row[1 + width_k : 1 + width_k + top_k]])
