"""The tensor-parallel group of this model process, and the collectives layers use.

One process per rank; ranks form a torch.distributed group (NCCL on GPUs, gloo on the CPU) whose
rendezvous address is on loopback. With one rank every collective is the identity and no group
is created. Layers call only the functions here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1


_group = TPGroup()


def init_tp_group(rank: int, size: int, device: torch.device, init_port: int | None) -> None:
    """Join the group (called once per process at start-up, before the model is built)."""
    global _group
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside tp_size {size}")
    if size > 1:
        if init_port is None:
            raise ValueError("tensor parallelism needs a rendezvous port")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{init_port}",
            rank=rank,
            world_size=size,
            timeout=timedelta(minutes=10),
        )
    _group = TPGroup(rank, size)


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks. Every rank gets bitwise the same result."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' slices along the last dimension, in rank order."""
    if _group.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_group.size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's tensor on every rank (in place)."""
    if _group.size == 1:
        return x
    dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of the ranks' values (so that every rank sizes its pools alike)."""
    if _group.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
