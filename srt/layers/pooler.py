"""Embeddings (`--is-embedding`): a request's vector from the model's last hidden states (after
the final norm), pooled as its sentence-transformers configuration says.

`modules.json` with a `sentence_transformers.models.Pooling` module points at its config
(`1_Pooling/config.json`): `pooling_mode_lasttoken` pools the last token's state,
`pooling_mode_mean_tokens` the mean over the prompt's tokens, `pooling_mode_cls_token` the
first token's; a `Normalize` module scales the vector to length 1. A model without that
configuration pools its last token and normalizes (Qwen3-Embedding and GTE-Qwen2's way, and
SGLang's default).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

MODES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "last"  # one of MODES
    normalize: bool = True

    @classmethod
    def load(cls, path: str) -> "PoolingConfig":
        modules_file = os.path.join(path, "modules.json")
        if not os.path.isfile(modules_file):
            return cls()
        with open(modules_file) as f:
            modules = json.load(f)
        mode, normalize = "last", False
        for m in modules:
            kind = m.get("type", "")
            if kind.endswith(".Normalize"):
                normalize = True
            elif kind.endswith(".Pooling"):
                with open(os.path.join(path, m.get("path", ""), "config.json")) as f:
                    pooling = json.load(f)
                if pooling.get("pooling_mode_lasttoken"):
                    mode = "last"
                elif pooling.get("pooling_mode_mean_tokens"):
                    mode = "mean"
                elif pooling.get("pooling_mode_cls_token"):
                    mode = "cls"
                else:
                    on = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v]
                    raise ValueError(f"{path}: pooling {on} is not supported (last token, "
                                     "mean or CLS)")
        return cls(mode, normalize)

    def add(self, pooled: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """A request's pooled state after one more fill's `rows` (a chunk's sum, or its last
        row: the last chunk's replaces it)."""
        if self.mode == "last" or pooled is None:
            return rows.clone()
        return pooled + rows

    def vector(self, pooled: torch.Tensor, prompt_len: int) -> list[float]:
        """The finished vector: the mean over the prompt's `prompt_len` tokens where pooled
        so, normalized where the model's configuration says."""
        v = pooled / prompt_len if self.mode == "mean" else pooled
        if self.normalize:
            v = v / v.norm().clamp_min(1e-12)
        return v.tolist()


def pool_rows(hidden: torch.Tensor, extend_lens: list[int], prefix_lens: list[int],
              mode: str) -> torch.Tensor:
    """[requests, H] float32 of one fill step's rows (each request's extend_lens[i] rows, in
    order, from position prefix_lens[i]): its last row (last), the sum of its rows (mean: the
    caller divides once every chunk is in), or its first position's row where this step
    computes it (cls; zeros elsewhere)."""
    n = len(extend_lens)
    lens = torch.tensor(extend_lens, device=hidden.device)
    ends = lens.cumsum(0) - 1
    if mode == "last":
        return hidden.index_select(0, ends).float()
    if mode == "mean":
        owner = torch.repeat_interleave(torch.arange(n, device=hidden.device), lens)
        out = torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)
        return out.index_add_(0, owner, hidden.float())
    starts = ends - lens + 1
    first = torch.tensor([p == 0 for p in prefix_lens], device=hidden.device)
    return torch.where(first.unsqueeze(1), hidden.index_select(0, starts).float(), 0.0)
