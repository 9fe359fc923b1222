"""Block-wise FP8 checkpoints (DeepSeek-V3, Qwen3-FP8: `quant_method` "fp8" with
`weight_block_size` [Bn, Bk]).

Each linear layer's `weight` [N, K] is e4m3 and `weight_scale_inv` [N / Bn, K / Bk] float32
holds one scale per Bn x Bk block: w[i, j] = q[i, j] * scale[i // Bn, j // Bk]. The scale
parameter is cut by the tensor-parallel loaders in whole blocks (`tp_param` with pack Bn on the
output axis and input_div Bk on the input axis), so every shard and every part of a merged
layer (q/k/v, gate/up) must be a whole number of blocks; the loaders refuse it otherwise.

Experts of such a checkpoint load in FP8 with their block scales and are dequantized to the
model dtype once loaded (`finish_block_fp8_experts`): correct, but with the memory of
model-dtype experts until a block-scaled expert kernel exists.

The product: on a GPU with half-precision activations a Triton kernel reads the FP8 weight,
scales each tile by its block's scale in float32, rounds it to the activation dtype and
multiplies on the tensor cores (weight-only: activations stay as they are), so the result is
the dequantized weight's product. Elsewhere the weight is dequantized for each product.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.fp8 import FP8_DTYPE


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                     dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] * scale [ceil(N / Bn), ceil(K / Bk)] per block, in float32, cast to `dtype`."""
    n, k = q.shape
    bn, bk = block
    s = scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (q.float() * s).to(dtype)


@dataclass
class Fp8BlockWeight:
    """A linear layer's block-scaled FP8 weight: `qweight` [N, K] e4m3, `scale` [N / Bn, K / Bk]
    float32, `block` (Bn, Bk)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ dequant(w).T in x's dtype."""
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            from srt.layers.fp8_block_triton import block_fp8_matmul

            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            out = block_fp8_matmul(x2 if x2.stride(1) == 1 else x2.contiguous(), self.qweight,
                                   self.scale, self.block)
            return out.reshape(*shape[:-1], out.shape[-1])
        return F.linear(x, dequantize_block(self.qweight, self.scale, self.block, x.dtype))


def set_block_fp8(module: nn.Module, block: tuple[int, int]) -> None:
    """Give a linear layer (still holding its model-dtype `weight` for the shape) empty
    `qweight` [N, K] and `weight_scale_inv` [N / Bn, K / Bk] parameters for the loader to fill;
    its `weight` goes. A shard that is not a whole number of blocks is refused."""
    from srt.layers.linear import tp_param

    w = module.weight
    n, k = w.shape
    bn, bk = block
    if n % bn or k % bk:
        raise ValueError(f"a layer's shard of {n} x {k} is not a whole number of "
                         f"{bn} x {bk} FP8 blocks (weight_block_size); a smaller --tp-size "
                         "may fit")
    module.qweight = tp_param(torch.empty(n, k, dtype=FP8_DTYPE, device=w.device))
    module.weight_scale_inv = tp_param(
        torch.empty(n // bn, k // bk, dtype=torch.float32, device=w.device),
        pack=bn, input_div=bk)
    module.quant = Fp8BlockWeight(module.qweight.data, module.weight_scale_inv.data, block)
    del module.weight
    module.weight = None


def finish_block_fp8_experts(model: nn.Module, dtype: torch.dtype) -> int:
    """Once a block-wise FP8 checkpoint is loaded, its experts dequantized to `dtype` (no
    block-scaled expert kernel yet: they then hold the memory of model-dtype experts);
    returns how many mixture-of-experts layers."""
    from srt.layers.moe import FusedMoE

    count = 0
    for module in model.modules():
        if isinstance(module, FusedMoE) and getattr(module, "block", None) is not None:
            module.finish_block_fp8(dtype)
            count += 1
    return count
