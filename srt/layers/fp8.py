"""FP8 (e4m3) weights for the tensor-parallel linear layers (`--quantization fp8`).

The layers are built and loaded in the model dtype, then each rank quantizes its own shard:
one scale per output row (per channel), `scale = max|w_row| / 448`, `q = round_e4m3(w / scale)`,
so the weight becomes `q * scale`. Activations are quantized per token at run time on the GPU
(`scale = max|x_token| / 448`) and the product runs through `torch._scaled_mm` with both scale
vectors (row-wise scaling: Hopper and newer). On the CPU, and wherever `_scaled_mm` cannot take
the shapes, the weight is dequantized to the activation dtype for each product: slow, exact to
the dequantized weight, which is what the tests compare against.

Left in the model dtype: the embeddings and the LM head (as vLLM and SGLang do), the vision
tower and projector of LLaVA, and the experts of a mixture-of-experts layer (their FP8 kernel is
not written yet; a warning says so).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [out, in] float8_e4m3fn, scale [out] float32) with w ~= q * scale[:, None]. A row of
    zeros gets scale 1 (its q is zero)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale per row, computed in float32, then cast to `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_q [M, K] float8_e4m3fn, scale [M, 1] float32) with x ~= x_q * scale."""
    amax = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


@dataclass
class Fp8Weight:
    """A linear layer's weight in FP8: `qweight` [out, in] and `scale` [out] (float32)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ (qweight * scale).T in x's dtype."""
        if _scaled_mm_ok(x, self.qweight):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            xq, xs = quantize_per_token(x2)
            out = torch._scaled_mm(xq, self.qweight.t(), scale_a=xs,
                                   scale_b=self.scale.view(1, -1), out_dtype=x.dtype)
            return out.reshape(*shape[:-1], out.shape[-1])
        return torch.nn.functional.linear(x, dequantize(self.qweight, self.scale, x.dtype))


def _scaled_mm_ok(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Row-wise scaled FP8 GEMMs: CUDA, compute capability 9.0 or newer (Hopper), both matrix
    dimensions multiples of 16, a half-precision output."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    return q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0


# Module names (any part) whose linear layers stay in the model dtype.
_KEEP = ("vision_tower", "multi_modal_projector", "lm_head", "embed")


def quantize_model_fp8(model: nn.Module) -> int:
    """Quantize every tensor-parallel linear layer of the language model in place (each rank
    its shard); returns how many. The layers then compute through their `fp8` weight."""
    from srt.layers.linear import ColumnParallelLinear, RowParallelLinear

    count = 0
    moe = False
    for name, module in model.named_modules():
        if any(k in name for k in _KEEP):
            continue
        if type(module).__name__ == "FusedMoE":
            moe = True
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.fp8 is None:
            q, scale = quantize_per_channel(module.weight.data)
            module.qweight = nn.Parameter(q, requires_grad=False)
            module.weight_scale = nn.Parameter(scale, requires_grad=False)
            module.fp8 = Fp8Weight(module.qweight.data, module.weight_scale.data)
            del module.weight  # the model-dtype copy goes
            module.weight = None
            count += 1
    if moe:
        logger.warning("--quantization fp8: the experts of the mixture-of-experts layers stay "
                       "in the model dtype (no FP8 expert kernel yet); attention is FP8")
    return count
