"""RMSNorm, computed in float32 like the reference implementation, with an optional fused residual."""

from __future__ import annotations

import torch
from torch import nn

from srt.layers.fused import kernels, use_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if use_fused(x) and x.stride(-1) == 1:
            return kernels().add_rmsnorm(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + weight): the checkpoint's weight is loaded plus one (in
    float32, as the reference adds it), so the forward is RMSNorm's."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded[:].float() + 1.0)
