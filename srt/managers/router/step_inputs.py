"""The integer inputs of one forward, moved to the device in one copy.

A step needs five integer tensors on the device: input_ids, positions and out_cache_loc (one
entry per new token) and req_pool_indices and seq_lens (one per request). Built one by one from
Python lists they cost five small pageable host-to-device copies, each of which blocks the host.
Here they are laid side by side in one host tensor and copied at once; on a GPU through a pinned
staging buffer with `non_blocking=True`.

Each tensor starts at a multiple of ALIGN elements (128 bytes): Triton specializes a kernel on
whether each pointer argument is 16-byte aligned, so views at offsets that depend on the token
count would compile new kernel variants in the middle of serving (seconds each).

Contract: the staging buffer is reused by the next `build`, so the copy must have completed by
then. Every step ends with the device-to-host copy of its sampled ids, which waits for the
stream, so it has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 16  # int64 elements


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


class StepInputBuilder:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.int64)

    def _staging_for(self, n: int) -> torch.Tensor:
        if self._staging.numel() < n:
            size = max(n, 2 * self._staging.numel(), 4096)
            self._staging = torch.empty(size, dtype=torch.int64, pin_memory=self._pinned)
        return self._staging[:n]

    def build(self, input_ids: list[int], positions: list[int], out_cache_loc: torch.Tensor,
              req_pool_indices: list[int], seq_lens: list[int]) -> StepTensors:
        """out_cache_loc: int64 CPU tensor of the step's slots (len(input_ids) of them)."""
        t, bs = len(input_ids), len(req_pool_indices)
        # segment starts: input_ids, positions, out_cache_loc, req_pool_indices, seq_lens
        o1 = _up(t)
        o2 = o1 + _up(t)
        o3 = o2 + _up(t)
        o4 = o3 + _up(bs)
        total = o4 + bs
        buf = (self._staging_for(total) if self._pinned
               else torch.empty(total, dtype=torch.int64))
        # two host tensors from Python lists (one per length), padded to the segment starts
        buf[:o2] = torch.tensor(input_ids + [0] * (o1 - t) + positions + [0] * (o2 - o1 - t),
                                dtype=torch.int64)
        buf[o2 : o2 + t] = out_cache_loc
        buf[o2 + t : o3] = 0
        buf[o3:] = torch.tensor(req_pool_indices + [0] * (o4 - o3 - bs) + seq_lens,
                                dtype=torch.int64)
        dev = buf.to(self.device, non_blocking=True) if self._pinned else buf
        return StepTensors(
            input_ids=dev[:t],
            positions=dev[o1 : o1 + t],
            out_cache_loc=dev[o2 : o2 + t],
            req_pool_indices=dev[o3 : o3 + bs],
            seq_lens=dev[o4:],
        )
