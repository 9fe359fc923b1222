"""The integer inputs of one forward, moved to the device in one copy.

A step needs five integer tensors on the device: input_ids, positions and out_cache_loc (one
entry per new token) and req_pool_indices and seq_lens (one per request). Built one by one from
Python lists they cost five small pageable host-to-device copies, each of which blocks the host.
Here they are laid side by side in one host tensor and copied at once; on a GPU through a pinned
staging buffer with `non_blocking=True`.

Contract: the staging buffer is reused by the next `build`, so the copy must have completed by
then. Every step ends with the device-to-host copy of its sampled ids, which waits for the
stream, so it has.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        host = torch.tensor(input_ids + positions + req_pool_indices + seq_lens,
                            dtype=torch.int64)
        if self._pinned:
            buf = self._staging_for(3 * t + 2 * bs)
            buf[: 2 * t].copy_(host[: 2 * t])
            buf[2 * t : 3 * t].copy_(out_cache_loc)
            buf[3 * t :].copy_(host[2 * t :])
            dev = buf.to(self.device, non_blocking=True)
        else:
            dev = torch.cat((host[: 2 * t], out_cache_loc.to(torch.int64), host[2 * t :]))
        return StepTensors(
            input_ids=dev[:t],
            positions=dev[t : 2 * t],
            out_cache_loc=dev[2 * t : 3 * t],
            req_pool_indices=dev[3 * t : 3 * t + bs],
            seq_lens=dev[3 * t + bs :],
        )
