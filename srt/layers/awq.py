"""AWQ int4 weights (AutoAWQ's GEMM layout) for the tensor-parallel linear layers.

On disk, per linear layer with K input and N output features and group size G (input
channels sharing one scale and zero point):

- `qweight` int32 [K, N / 8]: eight 4-bit values per int32 along the output axis, in AutoAWQ's
  interleaved order: output column 8j + c sits at bits AWQ_SHIFTS[c] .. + 3 of word j;
- `qzeros` int32 [K / G, N / 8]: the zero points, packed the same way;
- `scales` float16 [K / G, N].

The weight is w[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n] (computed in float32, then
rounded to the activation dtype). Each rank keeps its shard: column-parallel layers cut the
output axis (8 columns per int32), row-parallel ones the input axis (whole groups).

Products: on the CPU the weight is dequantized for each product (slow, exact to the definition
above, which is what the tests compare against). On the GPU the weight is repacked once loaded
(AwqKernelWeight: output columns contiguous) for the weight-only kernels of
srt/layers/quant_gemm_triton.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.linear import tp_param

PACK = 8  # 4-bit values per int32
# AutoAWQ packs columns c = 0..7 of each group of eight at these bit offsets (its order
# [0, 2, 4, 6, 1, 3, 5, 7] puts column ORDER[i] in nibble i).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_SHIFTS = tuple(4 * AWQ_ORDER.index(c) for c in range(PACK))  # (0, 16, 4, 20, 8, 24, 12, 28)
IN_ORDER = tuple(range(0, 32, 4))  # value c at bits 4 c: the GPU kernels' order


def pack_awq(values: torch.Tensor, shifts: tuple[int, ...] = AWQ_SHIFTS) -> torch.Tensor:
    """[R, C] integers in 0..15 -> int32 [R, C / 8], value c of each eight at bit shifts[c]
    (by default AutoAWQ's order)."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"{cols} columns: AWQ packs eight per int32")
    v = values.to(torch.int64).reshape(rows, cols // PACK, PACK)
    word = torch.zeros(rows, cols // PACK, dtype=torch.int64, device=values.device)
    for c in range(PACK):
        word |= v[:, :, c] << shifts[c]
    # two's complement into int32 (bit 31 may be set)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_awq(packed: torch.Tensor, shifts: tuple[int, ...] = AWQ_SHIFTS) -> torch.Tensor:
    """int32 [R, C / 8] -> int32 [R, C] values in 0..15 (pack_awq's inverse, same shifts)."""
    sh = torch.tensor(shifts, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> sh) & 0xF).reshape(packed.shape[0], -1)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] (as nn.Linear holds it) in `dtype`."""
    group = qweight.shape[0] // scales.shape[0]
    q = unpack_awq(qweight).float()
    z = unpack_awq(qzeros).float().repeat_interleave(group, 0)
    s = scales.float().repeat_interleave(group, 0)
    return ((q - z) * s).to(dtype).t()


def quantize_awq(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 of w [N, K] per group of `group` input channels, in the
    on-disk layout: (qweight [K, N/8], qzeros [K/G, N/8], scales float16 [K/G, N]). (AutoAWQ
    also searches activation-aware scales first; the layout is the same.)"""
    n, k = w.shape
    if k % group:
        raise ValueError(f"{k} input features are not a multiple of the group size {group}")
    wt = w.float().t().reshape(k // group, group, n)  # [groups, G, N]
    lo = wt.amin(dim=1).clamp(max=0)
    hi = wt.amax(dim=1).clamp(min=0)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = (-lo / s).round().clamp(0, 15)
    q = (wt / s[:, None, :] + zeros[:, None, :]).round().clamp(0, 15)
    return (pack_awq(q.reshape(k, n)), pack_awq(zeros), scales)


@dataclass
class AwqWeight:
    """A linear layer's int4 weight in the checkpoint's layout: qweight [K, N/8], qzeros
    [K/G, N/8], scales [K/G, N]. Products dequantize the whole weight (the CPU path); on the
    GPU the model runs on AwqKernelWeight (to_kernel_layout)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor

    @property
    def group(self) -> int:
        return self.qweight.shape[0] // self.scales.shape[0]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T in x's dtype (w as dequantize_awq defines it)."""
        return F.linear(x, dequantize_awq(self.qweight, self.qzeros, self.scales, x.dtype))


@dataclass
class AwqKernelWeight:
    """The same weight in the GPU kernels' layout (srt/layers/quant_gemm_triton.py): `w` int32
    [K/8, N] with eight consecutive input channels per word (IN_ORDER), `scales` [K/G, N] and
    `zeros` uint8 [K/G, N], so that output columns are contiguous, as the kernels read them.
    GPTQ checkpoints (srt/layers/gptq.py) load into it directly: their `qweight` is this `w`;
    `perm` (GPTQ's act order) reorders the input channels of x to w's order before a product;
    with `pad_x`, entries of `perm` equal to x's width read a zero channel (act order in a
    row-parallel shard, whose groups are padded to whole blocks)."""

    w: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    perm: torch.Tensor | None = None
    pad_x: bool = False

    @classmethod
    def from_checkpoint(cls, a: AwqWeight) -> "AwqKernelWeight":
        w = pack_awq(unpack_awq(a.qweight).t(), IN_ORDER).t().contiguous()
        return cls(w, a.scales.contiguous(), unpack_awq(a.qzeros).to(torch.uint8))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight [N, K] in `dtype` (torch; dequantize_awq's values), input channels in
        w's order (`perm` applied)."""
        q = unpack_awq(self.w.t(), IN_ORDER).float()  # [N, K]
        group = q.shape[1] // self.scales.shape[0]
        z = self.zeros.t().float().repeat_interleave(group, 1)
        return ((q - z) * self.scales.t().float().repeat_interleave(group, 1)).to(dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x @ w.T in x's dtype: on the GPU the weight-only kernels for few rows, one
        dequantization and a GEMM from DEQUANT_MIN_ROWS rows (prefill); on the CPU the
        dequantized weight."""
        from srt.layers.quant_gemm_triton import DEQUANT_MIN_ROWS, dequantize_int4, wo_matmul

        if self.perm is not None:
            x = (F.pad(x, (0, 1)) if self.pad_x else x).index_select(-1, self.perm)
        if not x.is_cuda:
            return F.linear(x, self.dequantize(x.dtype))
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] >= DEQUANT_MIN_ROWS:
            out = x2 @ dequantize_int4(self.w, self.scales, self.zeros, x.dtype)
        else:
            out = wo_matmul(x2 if x2.stride(1) == 1 else x2.contiguous(), self.w, self.scales,
                            self.zeros)
        return out.reshape(*shape[:-1], out.shape[-1])


def to_kernel_layout(model: nn.Module) -> int:
    """Give every AWQ layer of the model the GPU kernels' layout (called once loaded, on the
    GPU): the checkpoint-layout parameters go, the new tensors become the parameters
    `awq_w`, `awq_scales`, `awq_zeros` (so that the model's parameters still count them).
    Returns how many layers."""
    count = 0
    for module in model.modules():
        if isinstance(getattr(module, "quant", None), AwqWeight):
            kw = AwqKernelWeight.from_checkpoint(module.quant)
            for name in ("qweight", "qzeros", "scales"):
                delattr(module, name)
            install_kernel_weight(module, kw)
            count += 1
    return count


def install_kernel_weight(module: nn.Module, kw: AwqKernelWeight) -> None:
    """Make `kw` the layer's weight: its tensors become the parameters `awq_w`, `awq_scales`,
    `awq_zeros` (so that the model's parameters count them) and its products run on it."""
    module.awq_w = nn.Parameter(kw.w, requires_grad=False)
    module.awq_scales = nn.Parameter(kw.scales, requires_grad=False)
    module.awq_zeros = nn.Parameter(kw.zeros, requires_grad=False)
    module.quant = kw


def set_awq(module: nn.Module, group: int) -> None:
    """Give a linear layer empty AWQ parameters of its shard (`weight` goes), for the loader."""
    n, k = module.weight.shape  # this rank's shard
    dev = module.weight.device
    if n % PACK or k % group:
        raise ValueError(f"an AWQ layer's shard of {n} outputs x {k} inputs: the outputs must be "
                         f"a multiple of {PACK} and the inputs of the group size {group} "
                         "(a smaller --tp-size may fit)")
    module.qweight = tp_param(torch.empty(k, n // PACK, dtype=torch.int32, device=dev), 1, 0, PACK)
    module.qzeros = tp_param(torch.empty(k // group, n // PACK, dtype=torch.int32, device=dev),
                             1, 0, PACK, group)
    module.scales = tp_param(torch.empty(k // group, n, dtype=torch.float16, device=dev), 1, 0, 1,
                             group)
    module.quant = AwqWeight(module.qweight.data, module.qzeros.data, module.scales.data)
    del module.weight
    module.weight = None


def prepare_awq_checkpoint(model: nn.Module, quantized: Callable[[str], bool], group: int) -> int:
    """Before loading an AWQ checkpoint: every linear layer of the language model the
    checkpoint quantizes gets its AWQ parameters; returns how many. (Mixture-of-experts AWQ
    checkpoints are refused before: srt/layers/quant_config.py.)"""
    from srt.layers.fp8 import quantizable_linears

    count = 0
    for name, module in list(quantizable_linears(model)):
        if quantized(name):
            set_awq(module, group)
            count += 1
    return count
