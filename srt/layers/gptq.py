"""GPTQ int4 weights (the layout AutoGPTQ, GPTQModel and optimum write) for the tensor-parallel
linear layers.

On disk, per linear layer with K input and N output features and group size G (G = -1: one
group over all K inputs):

- `qweight` int32 [K / 8, N]: input channel 8 r + j of output column n at bits 4 j .. 4 j + 3 of
  word [r, n] (rows along the input axis: the layout of srt's GPU int4 kernels as it is);
- `qzeros` int32 [K / G, N / 8]: the zero point of output column 8 c + j at bits 4 j of word c
  of its group's row. checkpoint_format "gptq" (v1, the common one) stores z - 1, "gptq_v2"
  stores z; a v1 nibble of 15 reads back as 16, as the reference kernels read it;
- `scales` float16 [K / G, N];
- `g_idx` int32 [K]: each input channel's group. srt loads the checkpoints whose groups are
  consecutive runs of G channels (g_idx[k] = k // G: desc_act false, or act-order with static
  groups); an act-order permutation is refused at load, naming desc_act.

The weight is w[n, k] = (q[k, n] - z[g, n]) * s[g, n] with g = g_idx[k] (in float32, then
rounded to the activation dtype). Once loaded, a layer's GPTQ tensors become an
AwqKernelWeight (srt/layers/awq.py): the same kernels and CPU path serve both formats.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from srt.layers.awq import IN_ORDER, PACK, AwqKernelWeight, install_kernel_weight, pack_awq, \
    unpack_awq
from srt.layers.linear import tp_param


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[K, N] integers in 0..15 -> int32 [K / 8, N], channel 8 r + j at bits 4 j of row r."""
    return pack_awq(values.t(), IN_ORDER).t().contiguous()


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """pack_rows' inverse: int32 [K / 8, N] -> int32 [K, N]."""
    return unpack_awq(packed.t(), IN_ORDER).t().contiguous()


def zeros_from_checkpoint(qzeros: torch.Tensor, v2: bool) -> torch.Tensor:
    """The zero points [groups, N] (int32) that `qzeros` holds: v1 stores z - 1."""
    return unpack_awq(qzeros, IN_ORDER) + (0 if v2 else 1)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor, dtype: torch.dtype, v2: bool = False) -> torch.Tensor:
    """The weight [N, K] (as nn.Linear holds it) in `dtype`, by the module docstring's
    definition (any g_idx)."""
    q = unpack_rows(qweight).float()  # [K, N]
    g = g_idx.long()
    z = zeros_from_checkpoint(qzeros, v2).float()[g]
    return ((q - z) * scales.float()[g]).to(dtype).t()


def quantize_gptq(w: torch.Tensor, group: int, sym: bool = True, v2: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest int4 of w [N, K] per group of `group` input channels (-1: all) in the
    on-disk layout: (qweight [K/8, N], qzeros [K/G, N/8], scales float16 [K/G, N], g_idx [K]).
    sym: zero point 8 and the scale from the largest magnitude (GPTQ's default); else
    asymmetric from the group's range. (GPTQ itself also corrects each column's rounding
    error with second-order information; the layout is the same.) v1 (not v2) cannot store a
    zero point of 0: asymmetric groups then take 1."""
    n, k = w.shape
    g = k if group == -1 else group
    if k % g:
        raise ValueError(f"{k} input features are not a multiple of the group size {group}")
    wt = w.float().t().reshape(k // g, g, n)  # [groups, G, N]
    if sym:
        scales = (wt.abs().amax(dim=1) * 2 / 15).clamp(min=1e-5).to(torch.float16)
        zeros = torch.full_like(scales, 8, dtype=torch.float32)
    else:
        lo = wt.amin(dim=1).clamp(max=0)
        hi = wt.amax(dim=1).clamp(min=0)
        scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
        zeros = (-lo / scales.float()).round().clamp(0 if v2 else 1, 15)
    q = (wt / scales.float()[:, None, :] + zeros[:, None, :]).round().clamp(0, 15)
    stored = zeros.to(torch.int64) - (0 if v2 else 1)
    g_idx = torch.arange(k, dtype=torch.int32) // g
    return pack_rows(q.reshape(k, n)), pack_awq(stored, IN_ORDER), scales, g_idx


def check_g_idx(name: str, g_idx: torch.Tensor, group: int) -> None:
    """ValueError unless the checkpoint's g_idx puts channels in consecutive groups of `group`
    (-1: one group), the only order srt's kernels read."""
    k = g_idx.numel()
    want = torch.arange(k, dtype=torch.int64) // (k if group == -1 else group)
    if not torch.equal(g_idx.reshape(-1).to(torch.int64).cpu(), want):
        raise ValueError(f"{name}: the checkpoint orders input channels into groups by "
                         "activation (desc_act / act-order), which srt cannot load (groups of "
                         f"{group} consecutive channels are loaded)")


class GptqWeight:
    """A linear layer's GPTQ tensors in the checkpoint's layout, between set_gptq and
    finish_gptq (the loader fills them; no product runs on them)."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> None:
        self.qweight, self.qzeros, self.scales = qweight, qzeros, scales

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a GPTQ layer computes once loaded (finish_gptq)")


def set_gptq(module: nn.Module, group: int) -> None:
    """Give a linear layer empty GPTQ parameters of its shard (`weight` goes), for the loader.
    A row-parallel layer's shard holds whole groups; with one group (-1) every rank reads the
    whole scales and zero points."""
    n, k = module.weight.shape  # this rank's shard
    dev = module.weight.device
    if n % PACK or k % PACK or (group != -1 and k % group):
        raise ValueError(f"a GPTQ layer's shard of {n} outputs x {k} inputs: the outputs and "
                         f"inputs must be multiples of {PACK} and the inputs of the group size "
                         f"{group} (a smaller --tp-size may fit)")
    groups = 1 if group == -1 else k // group
    in_dim = None if group == -1 else 0
    module.qweight = tp_param(torch.empty(k // PACK, n, dtype=torch.int32, device=dev), 1, 0, 1,
                              PACK)
    module.qzeros = tp_param(torch.empty(groups, n // PACK, dtype=torch.int32, device=dev), 1,
                             in_dim, PACK, group)
    module.scales = tp_param(torch.empty(groups, n, dtype=torch.float16, device=dev), 1, in_dim,
                             1, group)
    module.quant = GptqWeight(module.qweight.data, module.qzeros.data, module.scales.data)
    del module.weight
    module.weight = None


def prepare_gptq_checkpoint(model: nn.Module, quantized: Callable[[str], bool], group: int) -> int:
    """Before loading a GPTQ checkpoint: every linear layer of the language model the
    checkpoint quantizes gets its GPTQ parameters; returns how many. The model keeps the group
    size (`gptq_group`) to check each layer's g_idx as it loads."""
    from srt.layers.fp8 import quantizable_linears

    count = 0
    for name, module in list(quantizable_linears(model)):
        if quantized(name):
            set_gptq(module, group)
            count += 1
    model.gptq_group = group
    return count


def finish_gptq(model: nn.Module, v2: bool) -> int:
    """Once loaded: each GPTQ layer's tensors become an AwqKernelWeight (qweight as it is, the
    zero points unpacked), on the CPU and the GPU alike. Returns how many layers."""
    count = 0
    for module in model.modules():
        quant: Any = getattr(module, "quant", None)
        if isinstance(quant, GptqWeight):
            zeros = zeros_from_checkpoint(quant.qzeros, v2).to(torch.uint8)
            kw = AwqKernelWeight(quant.qweight, quant.scales.contiguous(), zeros)
            for name in ("qweight", "qzeros", "scales"):
                delattr(module, name)
            install_kernel_weight(module, kw)
            count += 1
    return count
