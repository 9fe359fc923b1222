"""The tensor-parallel group of this model process, and the collectives layers use.

One process per rank; ranks form a torch.distributed group (NCCL on GPUs, gloo on the CPU) whose
rendezvous address is on loopback (node 0's --dist-init-addr with several nodes). With one rank
every collective is the identity and no group is created. Layers call only the functions here.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    # --ep-size: mixtures of experts split by whole experts over the group's ranks
    expert_parallel: bool = False


_group = TPGroup()
# A gloo group over the same ranks for host-side agreement (GPUs: the main group is NCCL, whose
# collectives queue behind the device's work); None where the main group is gloo already.
_cpu_group: "dist.ProcessGroup | None" = None


def init_tp_group(rank: int, size: int, device: torch.device, init_port: int | None,
                  init_host: str = "127.0.0.1", expert_parallel: bool = False) -> None:
    """Join the group (called once per process at start-up, before the model is built); the
    rendezvous is rank 0's TCP store at init_host:init_port. `expert_parallel`: the model's
    experts are split over the ranks whole, not each sliced across them."""
    global _group
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside tp_size {size}")
    if size > 1:
        if init_port is None:
            raise ValueError("tensor parallelism needs a rendezvous port")
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{init_host}:{init_port}",
            rank=rank,
            world_size=size,
            timeout=timedelta(minutes=10),
        )
        if device.type == "cuda":
            global _cpu_group
            _cpu_group = dist.new_group(backend="gloo", timeout=timedelta(minutes=10))
    _group = TPGroup(rank, size, expert_parallel and size > 1)


def tp_rank() -> int:
    return _group.rank


def tp_size() -> int:
    return _group.size


def expert_parallel() -> bool:
    return _group.expert_parallel


class _OneShotAllReduce:
    """All-reduce of small tensors in one kernel over a PyTorch symmetric-memory buffer: each
    rank copies its tensor into its buffer, then reads every peer's buffer over NVLink and sums
    in rank order (the same order on every rank, so the results are bitwise equal).
    Graph-capturable: the buffer never moves. Opt-in (--enable-custom-all-reduce): on two
    NVLink-connected H200s a call took 18.2 us against NCCL's 17.7 us at 8 KB, so the fixed cost
    per call there is not NCCL's algorithm."""

    def __init__(self, max_bytes: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = dist.group.WORLD.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        # 16-byte multiples: the kernel moves 16 bytes at a time
        return (x.dtype == self.dtype and x.numel() <= self.max_numel
                and (x.numel() * x.element_size()) % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        buf = self.buffer[: x.numel()]
        buf.copy_(x.reshape(-1))
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name).view(x.shape)


_one_shot: _OneShotAllReduce | None = None


def init_one_shot_all_reduce(max_bytes: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Route all-reduces of up to max_bytes through `_OneShotAllReduce` (CUDA, TP > 1). Every
    rank must call it; if any rank cannot set it up, none uses it (NCCL for all). Returns
    whether it is in use."""
    global _one_shot
    if _group.size == 1 or device.type != "cuda":
        return False
    ok = True
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        ok = hasattr(torch.ops.symm_mem, "one_shot_all_reduce")
    except Exception:  # noqa: BLE001 - any import failure means: not available
        ok = False
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if not flag.item():
        logger.info("one-shot all-reduce unavailable: NCCL for every all-reduce")
        return False
    try:
        impl = _OneShotAllReduce(max_bytes, dtype, device)
        probe = torch.full((8,), float(_group.rank + 1), dtype=dtype, device=device)
        good = bool((impl(probe) == sum(range(1, _group.size + 1))).all())
    except Exception as e:  # noqa: BLE001 - fall back to NCCL on any failure
        logger.warning("one-shot all-reduce failed to start (%s): NCCL for every all-reduce", e)
        good = False
    flag = torch.tensor([int(good)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if flag.item():
        _one_shot = impl
        logger.info("all-reduces up to %d KiB: one-shot over symmetric memory", max_bytes >> 10)
    return _one_shot is not None


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks. Every rank gets bitwise the same result."""
    if _group.size == 1:
        return x
    if _one_shot is not None and _one_shot.fits(x):
        return _one_shot(x)
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


def flag_from_first(flag: bool) -> bool:
    """Rank 0's `flag` on every rank (the others' arguments are ignored). A host-side broadcast
    over gloo: it waits for no device work, so the steps in flight keep running."""
    if _group.size == 1:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int32)
    dist.broadcast(t, src=0, group=_cpu_group)
    return bool(t.item())


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of the ranks' values (so that every rank sizes its pools alike)."""
    if _group.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
