"""The tensor-parallel group of this model process.

With one rank every collective is the identity. Ranks > 1 (NCCL on GPUs, gloo on the CPU) plug in
here; layers call only these functions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_group = TPGroup()


def init_tp_group(rank: int, size: int) -> None:
    global _group
    if size != 1:
        raise NotImplementedError("tensor parallelism with more than one rank is not built yet")
    _group = TPGroup(rank, size)


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _group.size == 1:
        return x
    raise NotImplementedError


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    if _group.size == 1:
        return x
    raise NotImplementedError
