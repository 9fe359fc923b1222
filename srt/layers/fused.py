"""Whether a layer takes the fused Triton kernels of srt/layers/fused_triton.py, and that module,
imported on first use.

Importing Triton fixes its mode (compiled or interpreted, TRITON_INTERPRET) for the process, so
nothing on the CPU path may import it as a side effect of importing the layers.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

# SRT_DISABLE_FUSED_OPS=1 keeps the plain torch code on the GPU too (for comparisons).
_DISABLED = os.environ.get("SRT_DISABLE_FUSED_OPS", "") not in ("", "0")


def use_fused(x: torch.Tensor) -> bool:
    """Whether the layers take the fused kernels for x: on CUDA tensors unless disabled."""
    return x.is_cuda and not _DISABLED


def kernels() -> ModuleType:
    from srt.layers import fused_triton

    return fused_triton
