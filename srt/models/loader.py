"""Reading weights: safetensors checkpoints (with a progress bar) or random dummy weights."""

from __future__ import annotations

import glob
import logging
import os
import threading
from typing import Any, Iterator

import torch
from torch import nn

logger = logging.getLogger(__name__)


class CheckpointTensor:
    """A tensor of the checkpoint not yet read: `narrow` and slicing read only the part asked
    for, so a tensor-parallel rank never holds more than its shard of a weight."""

    def __init__(self, sl: Any) -> None:
        self._slice = sl
        self.shape = tuple(sl.get_shape())
        self.dtype_name = str(sl.get_dtype())  # safetensors' name: "BF16", "F8_E4M3", ...

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self._slice[tuple(index)]

    def __getitem__(self, key: Any) -> torch.Tensor:
        if not self.shape and key == slice(None):  # a scalar: `[:]` means all of it
            key = ()
        return self._slice[key]


class RowSlice:
    """Rows start .. start + rows - 1 of a checkpoint tensor (a CheckpointTensor or a
    torch.Tensor), read lazily like the tensor itself: a fused projection's part."""

    def __init__(self, tensor: Any, start: int, rows: int) -> None:
        self._t, self._start = tensor, start
        self.shape = (rows, *tuple(tensor.shape)[1:])
        self.dtype_name = getattr(tensor, "dtype_name", "")
        if isinstance(tensor, torch.Tensor):
            self.dtype = tensor.dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim == 0:
            return self._t.narrow(0, self._start + start, length)
        return self[:].narrow(dim, start, length)

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows = self._t.narrow(0, self._start, self.shape[0])
        return rows if key == slice(None) else rows[key]


def iterate_safetensors(path: str) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (name, CheckpointTensor) from every *.safetensors file of a directory. Weight
    loaders take what they need with `narrow` or slicing (`t[:]` reads it all)."""
    from safetensors import safe_open
    from tqdm import tqdm

    # A thread lock, not tqdm's default multiprocessing one: that is a named semaphore which
    # outlives a process stopped by a signal and makes the resource tracker complain.
    tqdm.set_lock(threading.RLock())
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    names = []
    for f in files:
        with safe_open(f, framework="pt") as sf:
            names.extend((f, n) for n in sf.keys())
    bar = tqdm(total=len(names), desc="Loading weights", unit="tensor", mininterval=1.0)
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                yield name, CheckpointTensor(sf.get_slice(name))
                bar.update(1)
    bar.close()


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Small random values: same shapes and speed as real weights, no checkpoint needed.

    Drawn on the parameters' own device (an 8B model takes minutes on one CPU thread, well under
    a second on a GPU); deterministic for a given seed and device type."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        g = generators.get(p.device)
        if g is None:
            g = generators[p.device] = torch.Generator(device=p.device).manual_seed(seed)
        if not p.dtype.is_floating_point:  # packed integers (AWQ): any bits
            p.data.random_(-(1 << 31), (1 << 31) - 1, generator=g)
        elif p.dtype.itemsize == 1:  # FP8: drawn in float32
            p.data.copy_(torch.empty(p.shape, device=p.device).uniform_(-1, 1, generator=g))
        else:  # AWQ's group scales multiply values up to 15: smaller
            bound = 1e-3 if name.endswith(".scales") else 1e-2
            p.data.uniform_(-bound, bound, generator=g)
    for name, module in model.named_modules():
        if "norm" in name.rsplit(".", 1)[-1] and hasattr(module, "weight"):
            module.weight.data.fill_(1.0)
