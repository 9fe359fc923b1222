"""From the last hidden states to float32 logits of each request's next token.

EXTEND/PREFILL: only the last new token of each request is projected (the others need no logits
until logprobs are asked for). DECODE: every row. Vocab-parallel slices are gathered across ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from srt.layers import parallel_state as ps
from srt.layers.forward_batch import ForwardBatch


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        if fb.forward_mode.is_extend():
            ends = torch.tensor(fb.extend_lens_cpu, device=hidden.device).cumsum(0) - 1
            hidden = hidden[ends]
        logits = torch.matmul(hidden, lm_head_weight.t())
        logits = ps.all_gather_last_dim(logits)
        return logits[:, : self.vocab_size].float()
