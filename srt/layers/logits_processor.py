"""From the last hidden states to float32 logits of each request's next token.

EXTEND/PREFILL: only the last new token of each request is projected, except the prompt positions
whose logprobs were asked for (`fb.prompt_logprobs`): those are projected too, in chunks, and
reduced on the device to logprob rows (srt/layers/logprobs.py). DECODE: every row.
Vocab-parallel slices are gathered across ranks, so every rank holds the same logits.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.layers import parallel_state as ps
from srt.layers.forward_batch import ForwardBatch
from srt.layers.logprobs import PromptLogprobRequest, write_logprob_rows

# Prompt positions are projected this many logits at a time (bounds the temporary [rows, vocab]).
_PROMPT_CHUNK_ELEMENTS = 1 << 25


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, soft_cap: float | None = None) -> None:
        """`soft_cap` c: logits become c * tanh(logits / c) (Gemma 2's final soft-capping)."""
        super().__init__()
        self.vocab_size = vocab_size
        self.soft_cap = float(soft_cap or 0.0)

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        """Float32 logits [batch, vocab] of each request's next token."""
        if fb.forward_mode.is_extend():
            if fb.prompt_logprobs is not None:
                self._prompt_logprobs(hidden, lm_head_weight, fb.prompt_logprobs)
            if fb.sample_rows is not None:
                hidden = hidden.index_select(0, fb.sample_rows)
            else:
                ends = torch.tensor(fb.extend_lens_cpu, device=hidden.device).cumsum(0) - 1
                hidden = hidden[ends]
        return self._logits(hidden, lm_head_weight)

    def _logits(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        logits = torch.matmul(hidden, lm_head_weight.t())
        logits = ps.all_gather_last_dim(logits)
        logits = logits[:, : self.vocab_size].float()
        if self.soft_cap:
            logits = self.soft_cap * torch.tanh(logits / self.soft_cap)
        return logits

    def _prompt_logprobs(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                         req: PromptLogprobRequest) -> None:
        # Every rank runs the same chunks: the all-gather inside _logits is a collective.
        chunk = max(1, _PROMPT_CHUNK_ELEMENTS // self.vocab_size)
        for start in range(0, len(req.rows), chunk):
            end = start + chunk
            logits = self._logits(hidden[req.rows[start:end]], lm_head_weight)
            write_logprob_rows(logits, req.next_ids[start:end], req.top_k, req.out[start:end])
