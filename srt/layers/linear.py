"""Tensor-parallel linear layers. Each rank holds its shard; `weight_loader` cuts the shard out of
the full checkpoint tensor while loading, so no rank keeps a full copy.

Column-parallel: output features split across ranks. Row-parallel: input features split, outputs
all-reduced. QKV and gate/up are merged column-parallel layers whose loaders place each part.
A quantized layer (`srt/layers/fp8.py`, `srt/layers/awq.py`) has no `weight`: its `quant` does
the product, and its parameters say which axes the loaders cut (`tp_param`): the output axis
(packed several values per element for int4) and the input axis (in groups for per-group
scales), or none (kept whole on every rank).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import parallel_state as ps
from srt.layers.forward_batch import current_lora


class QuantWeight(Protocol):
    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T in x's dtype, w the dequantized weight [out, in]."""


def tp_param(t: torch.Tensor, output_dim: int = 0, input_dim: int | None = 1, pack: int = 1,
             input_div: int = 1) -> nn.Parameter:
    """A parameter whose loaders cut axis `output_dim` by output features (`pack` of them per
    element) and axis `input_dim` by input features (`input_div` of them per element; None:
    the row-parallel loader copies it whole)."""
    p = nn.Parameter(t, requires_grad=False)
    p.output_dim, p.input_dim, p.pack, p.input_div = output_dim, input_dim, pack, input_div
    return p


def _out_cut(param: nn.Parameter, n: int) -> tuple[int, int]:
    """(axis, elements) of `n` output features in `param`."""
    pack = getattr(param, "pack", 1)
    if n % pack:
        raise ValueError(f"{n} output features do not fill whole packed elements of {pack}")
    return getattr(param, "output_dim", 0), n // pack


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


class ColumnParallelLinear(nn.Module):
    # srt.lora.layers.LoraLinear when LoRA adapters may adapt this layer
    lora = None

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.out_per_rank = _divide(out_features, self.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(self.out_per_rank), requires_grad=False) if bias else None
        )
        self.quant: QuantWeight | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        dim, n = _out_cut(param, self.out_per_rank)
        param.data.copy_(loaded.narrow(dim, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            out = self.quant.matmul(x)
            out = out + self.bias if self.bias is not None else out
        else:
            out = F.linear(x, self.weight, self.bias)
        if self.lora is not None and (info := current_lora()) is not None:
            out = self.lora.apply(x, out, info)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up). shard_id indexes `sizes`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(sizes), bias)
        self.sizes_per_rank = [_divide(s, self.tp_size, "output features") for s in sizes]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        dim, n = _out_cut(param, self.sizes_per_rank[shard_id])
        _, offset = _out_cut(param, sum(self.sizes_per_rank[:shard_id]))
        param.data.narrow(dim, offset, n).copy_(loaded.narrow(dim, self.tp_rank * n, n))


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
        dim, q = _out_cut(param, self.num_heads * self.head_dim)
        _, kv = _out_cut(param, self.num_kv_heads * self.head_dim)
        if shard_id == "q":
            dst, src = param.data.narrow(dim, 0, q), loaded.narrow(dim, self.tp_rank * q, q)
        else:
            offset = q if shard_id == "k" else q + kv
            kv_rank = self.tp_rank // self.kv_replicas
            dst, src = param.data.narrow(dim, offset, kv), loaded.narrow(dim, kv_rank * kv, kv)
        dst.copy_(src)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input features: each rank's partial product, all-reduced; with
    `reduce_results=False` the rank's partial sum is returned and the caller reduces it (a sum of
    several such outputs then takes one all-reduce, not one each)."""

    lora = None  # as ColumnParallelLinear's

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__()
        if bias and not reduce_results:
            raise ValueError("a partial sum cannot carry the bias (it would be added per rank)")
        self.reduce_results = reduce_results
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.in_per_rank = _divide(in_features, self.tp_size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant: QuantWeight | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        dim = getattr(param, "input_dim", 1)
        if param is self.bias or dim is None:
            param.data.copy_(loaded[:])  # one per output row: whole on every rank
            return
        div = getattr(param, "input_div", 1)
        if self.in_per_rank % div:
            raise ValueError(f"a rank's {self.in_per_rank} input features are not whole "
                             f"groups of {div} (a smaller --tp-size may fit)")
        n = self.in_per_rank // div
        param.data.copy_(loaded.narrow(dim, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.quant.matmul(x) if self.quant is not None else F.linear(x, self.weight)
        if self.lora is not None and (info := current_lora()) is not None:
            out = self.lora.apply(x, out, info)  # into the rank's partial sum
        if not self.reduce_results:
            return out
        out = ps.all_reduce(out)
        # Bias after the reduction, so it is added once rather than once per rank.
        return out + self.bias if self.bias is not None else out
