"""Tensor-parallel linear layers. Each rank holds its shard; `weight_loader` cuts the shard out of
the full checkpoint tensor while loading, so no rank keeps a full copy.

Column-parallel: output features split across ranks. Row-parallel: input features split, outputs
all-reduced. QKV and gate/up are merged column-parallel layers whose loaders place each part.
With `--quantization fp8` each rank's loaded shard is then quantized (`srt/layers/fp8.py`): the
layer's `fp8` holds the FP8 weight and its scales and `weight` is gone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import parallel_state as ps
from srt.layers.fp8 import Fp8Weight


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.out_per_rank = _divide(out_features, self.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None
        )
        self.fp8: Fp8Weight | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.out_per_rank
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            out = self.fp8.matmul(x)
            return out + self.bias if self.bias is not None else out
        return F.linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up). shard_id indexes `sizes`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(sizes), bias)
        self.sizes_per_rank = [_divide(s, self.tp_size, "output features") for s in sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        n = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, each split by whole heads.

    When there are fewer KV heads than ranks, KV heads are replicated so each rank holds whole heads.
    """

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        tp = ps.tp_size()
        self.num_heads = _divide(num_heads, tp, "attention heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "ranks per KV head")
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src = param.data.narrow(0, 0, q), loaded.narrow(0, self.tp_rank * q, q)
        else:
            offset = q if shard_id == "k" else q + kv
            kv_rank = self.tp_rank // self.kv_replicas
            dst, src = param.data.narrow(0, offset, kv), loaded.narrow(0, kv_rank * kv, kv)
        dst.copy_(src)


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.in_per_rank = _divide(in_features, self.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.fp8: Fp8Weight | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param is self.bias or param is getattr(self, "weight_scale", None):
            param.data.copy_(loaded[:])  # one per output row: whole on every rank
            return
        n = self.in_per_rank
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = ps.all_reduce(self.fp8.matmul(x) if self.fp8 is not None
                            else F.linear(x, self.weight))
        # Bias after the reduction, so it is added once rather than once per rank.
        return out + self.bias if self.bias is not None else out
