"""Logprobs on the device, written into rows of one float64 buffer that goes to the host at once.

A logprob row is `[logprob of the given token, top-k logprobs (most likely first), their token
ids]`: width 1 + 2k. float64 holds float32 logprobs and token ids (< 2**53) exactly, so the
sampled ids, the output rows and the prompt rows of a step share one buffer and one
device-to-host copy.

Logprobs are those of the model's distribution: log_softmax of the raw float32 logits, before
penalties, temperature, top-p/top-k and masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def row_width(top_k: int) -> int:
    return 1 + 2 * top_k


def write_logprob_rows(logits: torch.Tensor, next_ids: torch.Tensor, top_k: int,
                       out: torch.Tensor) -> None:
    """logits [n, vocab] (any float dtype; computed in float32), next_ids [n] int64 ->
    out [n, 1 + 2 * top_k] float64, every entry written."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out[:, 0] = logprobs.gather(1, next_ids.view(-1, 1)).view(-1)
    if top_k > 0:
        values, ids = logprobs.topk(top_k, dim=-1)
        out[:, 1 : 1 + top_k] = values
        out[:, 1 + top_k :] = ids


@dataclass
class PromptLogprobRequest:
    """Prompt logprobs an EXTEND/PREFILL forward must compute (set on the ForwardBatch).

    rows: indices into the step's new tokens: the positions whose logits predict a prompt token;
    next_ids: the prompt token each of them predicts; out: [len(rows), row_width(top_k)] float64,
    written by the logits processor during the forward.
    """

    rows: torch.Tensor  # [n] int64
    next_ids: torch.Tensor  # [n] int64
    top_k: int
    out: torch.Tensor  # [n, row_width(top_k)] float64
