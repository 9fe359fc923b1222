"""The gated activations over a merged gate/up projection: SiLU-and-mul (Llama-style MLPs) and
GELU-and-mul with the tanh approximation (Gemma's `gelu_pytorch_tanh`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.fused import kernels, use_fused


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x) and x.dim() == 2:
            return kernels().silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
