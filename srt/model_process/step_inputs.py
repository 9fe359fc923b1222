"""The integer inputs of one forward, moved to the device in one copy.

A step needs five integer tensors on the device: input_ids, positions and out_cache_loc (one
entry per new token) and req_pool_indices and seq_lens (one per request). Built one by one they
cost five small host-to-device copies. Here they are laid side by side in one host buffer and
copied at once; on a GPU from pinned staging memory with `non_blocking=True`, so the host does
not wait for the device. A DECODE step passes no input ids (the executor takes them from the
device); their segment is then left as it is.

Each tensor starts at a multiple of ALIGN elements (128 bytes): Triton specializes a kernel on
whether each pointer argument is 16-byte aligned, so views at offsets that depend on the token
count would compile new kernel variants in the middle of serving (seconds each).

Staging is double-buffered: while step k's copy may still be queued behind step k-1 on the
device, step k+1 fills the other buffer. Each buffer records an event after its copy, and a
buffer is refilled only once its event has completed (normally long done, so no wait).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

ALIGN = 16  # int64 elements
STAGING_BUFFERS = 2


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class StepTensors:
    """Device views into one int64 buffer."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor


class _Staging:
    """One pinned host buffer and the event after its last copy."""

    def __init__(self) -> None:
        self.buf = torch.empty(0, dtype=torch.int64)
        self.copied: torch.cuda.Event | None = None

    def take(self, n: int) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()  # its previous copy must have read it
        if self.buf.numel() < n:
            self.buf = torch.empty(max(n, 2 * self.buf.numel(), 4096), dtype=torch.int64,
                                   pin_memory=True)
        return self.buf[:n]


class StepInputBuilder:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._ring = [_Staging() for _ in range(STAGING_BUFFERS)] if self._pinned else []
        self._next = 0
        self.builds = 0  # staging buffers filled (tests check the ring turns)

    def build(self, input_ids: Sequence[int] | np.ndarray | None, positions: Sequence[int],
              out_cache_loc: torch.Tensor, req_pool_indices: Sequence[int],
              seq_lens: Sequence[int]) -> StepTensors:
        """out_cache_loc: int64 CPU tensor of the step's slots (one per position). input_ids
        None: the input_ids view is left unwritten (the caller fills it on the device)."""
        t, bs = len(positions), len(req_pool_indices)
        # segment starts: input_ids, positions, out_cache_loc, req_pool_indices, seq_lens
        o1 = _up(t)
        o2 = o1 + _up(t)
        o3 = o2 + _up(t)
        o4 = o3 + _up(bs)
        total = o4 + bs
        stage: _Staging | None = None
        if self._pinned:
            stage = self._ring[self._next]
            self._next = (self._next + 1) % len(self._ring)
            buf = stage.take(total)
        else:
            buf = torch.empty(total, dtype=torch.int64)
        self.builds += 1
        host = buf.numpy()
        if input_ids is not None:
            host[:t] = input_ids
        host[o1 : o1 + t] = positions
        host[o2 : o2 + t] = out_cache_loc.numpy()
        host[o3 : o3 + bs] = req_pool_indices
        host[o4:] = seq_lens
        if stage is not None:
            dev = buf.to(self.device, non_blocking=True)
            stage.copied = torch.cuda.Event()
            stage.copied.record()
        else:
            dev = buf
        return StepTensors(
            input_ids=dev[:t],
            positions=dev[o1 : o1 + t],
            out_cache_loc=dev[o2 : o2 + t],
            req_pool_indices=dev[o3 : o3 + bs],
            seq_lens=dev[o4:],
        )


class StagedCopier:
    """Int64 host arrays to the device in one copy, each at an ALIGN-ed offset; on a GPU from
    pinned double-buffered staging memory with `non_blocking=True` (as StepInputBuilder's), so
    that the host never waits for the steps in flight."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ring = [_Staging() for _ in range(STAGING_BUFFERS)] \
            if device.type == "cuda" else []
        self._next = 0

    def copy(self, parts: Sequence[np.ndarray]) -> list[torch.Tensor]:
        starts = np.cumsum([0] + [_up(len(p)) for p in parts])
        if not self._ring:
            buf = torch.empty(int(starts[-1]), dtype=torch.int64)
        else:
            stage = self._ring[self._next]
            self._next = (self._next + 1) % len(self._ring)
            buf = stage.take(int(starts[-1]))
        host = buf.numpy()
        for p, s in zip(parts, starts):
            host[s: s + len(p)] = p
        if self._ring:
            buf = buf.to(self.device, non_blocking=True)
            stage.copied = torch.cuda.Event()
            stage.copied.record()
        return [buf[s: s + len(p)] for p, s in zip(parts, starts)]
