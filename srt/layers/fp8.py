"""FP8 (e4m3) weights for the tensor-parallel linear layers (`--quantization fp8`).

The layers are built and loaded in the model dtype, then each rank quantizes its own shard:
one scale per output row (per channel), `scale = max|w_row| / 448`, `q = round_e4m3(w / scale)`,
so the weight becomes `q * scale`. On the GPU, products of few rows (decode) read the FP8
weight in a weight-only Triton kernel (srt/layers/quant_gemm_triton.py; compute capability
8.9 and newer); larger ones quantize the activations per token (`scale = max|x_token| / 448`)
and multiply in FP8 with both scale vectors (Hopper and newer): up to FP8_GEMM_MAX_ROWS rows
(decode batches) in srt's split-K kernel (srt/layers/fp8_gemm_triton.py), beyond through
`torch._scaled_mm` (row-wise scaling). Elsewhere (the CPU, older GPUs, shapes `_scaled_mm`
cannot take) the weight is dequantized to the activation dtype for each product: slow, exact to the dequantized weight,
which is what the tests compare against.

The experts of a mixture-of-experts layer are quantized the same way, expert by expert (one
scale per output row), weight-only: srt/layers/moe.py reads them in FP8 and applies the scales
to the products. Left in the model dtype: the embeddings, the LM head (as vLLM and SGLang do),
the router, and the vision tower and projector of LLaVA.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Rows up to which GPU products read the FP8 weight in the weight-only kernel
# (srt/layers/quant_gemm_triton.py) rather than quantizing x for torch._scaled_mm: where the
# product is bound by the weight's bytes, the activation's quantization only adds a kernel.
WEIGHT_ONLY_MAX_ROWS = 16
# Rows up to which FP8 x FP8 products run in the split-K kernel rather than torch._scaled_mm,
# whose one program per output tile leaves most SMs idle on small batches. One H100, the 8B
# layers (benchmarks/results/README.md, 2026-12-07): at 17-64 rows the kernel is 1.02-1.59x
# _scaled_mm's speed on every layer; at 128 0.75-1.03x, at 256 0.66-0.87x.
FP8_GEMM_MAX_ROWS = 64


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
    """A linear layer's weight in FP8: `qweight` [out, in] and `scale` [out] (float32).
    Decided once, from the weight's device and shape: `scaled_mm`, whether products of
    half-precision activations can go through torch._scaled_mm (scaled_mm_ok); `weight_only`,
    whether they can go through the weight-only Triton kernel (CUDA, capability 8.9+)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    scaled_mm: bool = field(init=False)
    weight_only: bool = field(init=False)

    def __post_init__(self) -> None:
        self.scaled_mm = scaled_mm_ok(self.qweight)
        # Triton reads e4m3 from compute capability 8.9 (Ada, Hopper) on
        self.weight_only = (self.qweight.is_cuda
                            and torch.cuda.get_device_capability(self.qweight.device) >= (8, 9))
        self.scale_row = self.scale.view(1, -1)  # _scaled_mm's per-column scale of w.T

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ (qweight * scale).T in x's dtype. Half-precision x on the GPU: up to
        WEIGHT_ONLY_MAX_ROWS rows (decode) the weight-only kernel, which reads the FP8 weight
        and leaves x as it is; more rows quantize x per token for the split-K kernel (up to
        FP8_GEMM_MAX_ROWS) or _scaled_mm. Otherwise the weight is dequantized for the
        product."""
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
            shape = x.shape
            x2 = x.reshape(-1, shape[-1])
            rows = x2.shape[0]
            out = None
            if self.weight_only and rows <= WEIGHT_ONLY_MAX_ROWS:
                from srt.layers.quant_gemm_triton import wo_matmul

                out = wo_matmul(x2 if x2.stride(1) == 1 else x2.contiguous(), self.qweight,
                                self.scale)
            elif self.scaled_mm:
                from srt.layers.fp8_triton import quantize_per_token_triton

                xq, xs = quantize_per_token_triton(x2 if x2.stride(1) == 1 else x2.contiguous())
                if rows <= FP8_GEMM_MAX_ROWS:
                    from srt.layers.fp8_gemm_triton import fp8_gemm

                    out = fp8_gemm(xq, xs, self.qweight, self.scale, x.dtype)
                else:
                    out = torch._scaled_mm(xq, self.qweight.t(), scale_a=xs,
                                           scale_b=self.scale_row, out_dtype=x.dtype)
            if out is not None:
                return out.reshape(*shape[:-1], out.shape[-1])
        return torch.nn.functional.linear(x, dequantize(self.qweight, self.scale, x.dtype))


def scaled_mm_ok(q: torch.Tensor) -> bool:
    """Row-wise scaled FP8 GEMMs for this weight: on CUDA, compute capability 9.0 or newer
    (Hopper), both matrix dimensions multiples of 16."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) < (9, 0):
        return False
    return q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0


# Module names (any part) whose linear layers stay in the model dtype.
# (MLA's kv_b_proj: its weight is read as the heads' absorbed up-projections)
_KEEP = ("vision_tower", "multi_modal_projector", "lm_head", "embed", "kv_b_proj")


def quantizable_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of every tensor-parallel linear layer of the language model still in the
    model dtype."""
    from srt.layers.linear import ColumnParallelLinear, RowParallelLinear

    for name, module in model.named_modules():
        if any(k in name for k in _KEEP):
            continue
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.quant is None:
            yield name, module


def _set_fp8(module: nn.Module, q: torch.Tensor, scale: torch.Tensor) -> None:
    """Give the layer FP8 parameters `qweight` and `weight_scale` in place of `weight`."""
    from srt.layers.linear import tp_param

    module.qweight = tp_param(q)
    module.weight_scale = tp_param(scale, input_dim=None)  # per output row
    module.quant = Fp8Weight(module.qweight.data, module.weight_scale.data)
    del module.weight  # the model-dtype copy goes
    module.weight = None


def _experts(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, layer) of every mixture-of-experts layer still in the model dtype."""
    from srt.layers.moe import FusedMoE

    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and not module.fp8:
            yield name, module


def _quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert [E, out, in] per output row: (q [E, out, in], scale [E, out])."""
    qs = [quantize_per_channel(w[e]) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([sc for _, sc in qs])


def quantize_model_fp8(model: nn.Module) -> int:
    """Quantize every tensor-parallel linear layer of the language model and every expert in
    place (each rank its shard); returns how many layers (a mixture-of-experts layer counts
    once). The layers then compute through their FP8 weights."""
    count = 0
    for _, module in list(quantizable_linears(model)):
        _set_fp8(module, *quantize_per_channel(module.weight.data))
        count += 1
    for _, moe in list(_experts(model)):
        moe.set_fp8(*_quantize_experts(moe.w13_weight.data), *_quantize_experts(moe.w2_weight.data))
        count += 1
    return count


def prepare_fp8_checkpoint(model: nn.Module, quantized: Callable[[str], bool],
                           block: tuple[int, int] | None = None) -> int:
    """Before loading an FP8 checkpoint: every linear layer whose weight the checkpoint holds
    in FP8 (`quantized(name)`) gets empty `qweight` / `weight_scale` parameters for the loader
    to fill (its `weight` goes), every such mixture-of-experts layer empty FP8 experts and
    scales; returns how many layers. `block`: the checkpoint's weight_block_size (Bn, Bk):
    block scales `weight_scale_inv` (srt/layers/fp8_block.py); its experts load in FP8 with
    their block scales and are dequantized to the model dtype once loaded."""
    count = 0
    for name, module in list(quantizable_linears(model)):
        if quantized(name) and block is not None:
            from srt.layers.fp8_block import set_block_fp8

            set_block_fp8(module, block)
            count += 1
        elif quantized(name):
            w = module.weight
            _set_fp8(module, torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device),
                     torch.empty(w.shape[0], dtype=torch.float32, device=w.device))
            count += 1
    for name, moe in list(_experts(model)):
        if quantized(name) and block is not None:
            moe.set_block_fp8(block)  # (dequantized once loaded: finish_block_fp8_experts)
            count += 1
        elif quantized(name):
            w13, w2 = moe.w13_weight, moe.w2_weight
            moe.set_fp8(torch.empty(w13.shape, dtype=FP8_DTYPE, device=w13.device),
                        torch.empty(w13.shape[:2], dtype=torch.float32, device=w13.device),
                        torch.empty(w2.shape, dtype=FP8_DTYPE, device=w2.device),
                        torch.empty(w2.shape[:2], dtype=torch.float32, device=w2.device))
            count += 1
    return count


class ScaleRows:
    """A checkpoint's per-tensor weight scale read as one scale per output row, so that the
    layers' loaders can cut it like a per-channel one (`narrow` rows, or `[:]` whole)."""

    def __init__(self, value: float, rows: int) -> None:
        self.value, self.rows = value, rows

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return torch.full((length,), self.value, dtype=torch.float32)

    def __getitem__(self, key: Any) -> torch.Tensor:
        return torch.full((self.rows,), self.value, dtype=torch.float32)


def weight_scale_rows(loaded: Any, rows: int) -> Any:
    """A checkpoint `weight_scale` (a scalar, [1], [out] or [out, 1]) as per-row scales:
    a ScaleRows for one value (`rows`: the whole length `[:]` should give), else [out]."""
    t = loaded[:].float().reshape(-1)
    return ScaleRows(float(t[0]), rows) if t.numel() == 1 else t
