"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import parallel_state as ps


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.vocab_size = vocab_size
        self.per_rank = (vocab_size + self.tp_size - 1) // self.tp_size
        self.start = self.tp_rank * self.per_rank
        self.end = min(self.start + self.per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.start : self.end]
        param.data[: shard.shape[0]].copy_(shard)
        param.data[shard.shape[0] :].zero_()  # padding rows of the last rank

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        mask = (ids >= self.start) & (ids < self.end)
        out = F.embedding((ids - self.start) * mask, self.weight) * mask.unsqueeze(-1)
        return ps.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Same sharding as the embedding; the logits processor gathers the slices."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - not an embedding
        raise RuntimeError("ParallelLMHead is applied by the logits processor")
