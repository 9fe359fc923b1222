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
- `g_idx` int32 [K]: each input channel's group: consecutive runs of G channels (g_idx[k] =
  k // G) unless the checkpoint was quantized in activation order (desc_act), where it is a
  permutation of those. For the latter srt sorts the layer's input channels by group once
  loaded and gathers x in that order before each product (one small kernel per product).

A row-parallel layer at --tp-size > 1 reads every group's scales and zero points (act order
spreads a group's channels over the ranks). With consecutive groups a rank keeps its own rows
of them; in act order a rank sorts its channels by group and pads each group's run to whole
blocks of `sub_group(G)` channels (zero activations, any weight), each block taking its
group's scale and zero point: the kernels then see a layer of group size sub_group(G), a few
blocks longer than the shard (about a quarter at G = 128 and --tp-size 2).

The weight is w[n, k] = (q[k, n] - z[g, n]) * s[g, n] with g = g_idx[k] (in float32, then
rounded to the activation dtype). Once loaded, a layer's GPTQ tensors become an
AwqKernelWeight (srt/layers/awq.py): the same kernels and CPU path serve both formats.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from srt.layers.awq import IN_ORDER, PACK, AwqKernelWeight, install_kernel_weight, pack_awq, \
    unpack_awq
from srt.layers.linear import tp_param

logger = logging.getLogger(__name__)


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


def _consecutive(k: int, group: int) -> torch.Tensor:
    return torch.arange(k, dtype=torch.int64) // (k if group == -1 else group)


def act_order(name: str, g_idx: torch.Tensor, group: int) -> torch.Tensor | None:
    """None for consecutive groups; for an act-order g_idx the permutation that sorts the
    input channels by group (stably); ValueError if its groups are not of `group` channels."""
    g = g_idx.reshape(-1).to(torch.int64).cpu()
    want = _consecutive(g.numel(), group)
    if torch.equal(g, want):
        return None
    perm = torch.argsort(g, stable=True)
    if not torch.equal(g[perm], want):
        raise ValueError(f"{name}: its groups are not of {group} input channels each, which "
                         "srt cannot load")
    return perm


def keep_g_idx(module: nn.Module, name: str, g_idx: torch.Tensor) -> None:
    """Keep a checkpoint g_idx on its (possibly merged) layer for finish_gptq; the parts of a
    merged layer (q / k / v, gate / up) share their input, so their orders must agree. A g_idx
    of a layer not loaded as GPTQ is refused."""
    if not isinstance(getattr(module, "quant", None), GptqWeight):
        raise ValueError(f"{name}: a GPTQ g_idx for a layer the checkpoint's "
                         "quantization_config does not quantize")
    g = g_idx.reshape(-1).to(torch.int64).cpu()
    kept = getattr(module, "gptq_g_idx", None)
    if kept is not None and not torch.equal(kept, g):
        raise ValueError(f"{name}: the parts of a layer srt computes as one product have "
                         "different act orders (g_idx), which srt cannot load")
    module.gptq_g_idx = g


class GptqWeight:
    """A linear layer's GPTQ tensors in the checkpoint's layout, between set_gptq and
    finish_gptq (the loader fills them; no product runs on them)."""

    def __init__(self, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> None:
        self.qweight, self.qzeros, self.scales = qweight, qzeros, scales

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a GPTQ layer computes once loaded (finish_gptq)")


def _tables_whole(module: nn.Module, group: int) -> bool:
    """Whether the layer's shard reads every group's scales and zero points: a row-parallel
    layer at --tp-size > 1 (module docstring), or one group (-1)."""
    from srt.layers.linear import RowParallelLinear

    return group == -1 or (isinstance(module, RowParallelLinear) and module.tp_size > 1)


def set_gptq(module: nn.Module, group: int) -> None:
    """Give a linear layer empty GPTQ parameters of its shard (`weight` goes), for the loader.
    A row-parallel layer's shard holds whole groups; at --tp-size > 1 and with one group (-1)
    every rank reads the whole scales and zero points."""
    n, k = module.weight.shape  # this rank's shard
    dev = module.weight.device
    if n % PACK or k % PACK or (group != -1 and k % group):
        raise ValueError(f"a GPTQ layer's shard of {n} outputs x {k} inputs: the outputs and "
                         f"inputs must be multiples of {PACK} and the inputs of the group size "
                         f"{group} (a smaller --tp-size may fit)")
    whole = _tables_whole(module, group)
    groups = 1 if group == -1 else k * (module.tp_size if whole else 1) // group
    in_dim = None if whole else 0
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
    checkpoint quantizes gets its GPTQ parameters; returns how many. (The loader keeps each
    layer's g_idx: keep_g_idx.)"""
    from srt.layers.fp8 import quantizable_linears

    count = 0
    for name, module in list(quantizable_linears(model)):
        if quantized(name):
            set_gptq(module, group)
            count += 1
    return count


def sub_group(group: int) -> int:
    """The block a row-parallel shard pads each act-order group's run to (module docstring):
    small, to pad little, and a whole number of the kernels' word rows and tiles."""
    return min(group, 32)


def shard_act_order(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    g_local: torch.Tensor, sub: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A row-parallel shard of an act-order layer as a layer of group size `sub`: its channels
    (packed rows `w` [K_r / 8, N], groups `g_local` [K_r]) sorted by group, each group's run
    padded to whole blocks of `sub` channels; `scales` / `zeros` [groups, N] are every group's.
    Returns (w' [K' / 8, N], scales' and zeros' [K' / sub, N], perm [K']): perm[j] is the
    shard channel at row j, or K_r (a zero activation) for padding."""
    k_r = g_local.numel()
    order = torch.argsort(g_local, stable=True)
    groups, counts = torch.unique_consecutive(g_local[order], return_counts=True)
    padded = (counts + sub - 1) // sub * sub
    run_start = torch.repeat_interleave(torch.cumsum(padded, 0) - padded, counts)
    first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    rows = run_start + torch.arange(k_r) - first  # each sorted channel's row in the new layer
    k_new = int(padded.sum())
    perm = torch.full((k_new,), k_r, dtype=torch.int64)
    perm[rows] = order
    q = unpack_rows(w.cpu())
    q_new = torch.zeros(k_new, q.shape[1], dtype=q.dtype)
    q_new[rows] = q[order]
    blocks = torch.repeat_interleave(groups, padded // sub).to(scales.device)
    return (pack_rows(q_new).to(w.device), scales[blocks].contiguous(),
            zeros[blocks].contiguous(), perm.to(w.device))


def finish_gptq(model: nn.Module, v2: bool, group: int) -> int:
    """Once loaded: each GPTQ layer's tensors become an AwqKernelWeight (qweight as it is, the
    zero points unpacked), on the CPU and the GPU alike; a row-parallel shard at --tp-size > 1
    keeps its own groups' scales and zero points. An act-order layer becomes shard_act_order's
    layer over its (shard's) channels: in whole groups, so unpadded, except in a row-parallel
    shard at --tp-size > 1 (blocks of sub_group(G)). The kept g_idx goes. Returns how many
    layers."""
    count = 0
    shard, padded = 0, 0  # input channels of act-order row-parallel shards, before / after
    for name, module in model.named_modules():
        quant: Any = getattr(module, "quant", None)
        if not isinstance(quant, GptqWeight):
            continue
        g_idx = getattr(module, "gptq_g_idx", None)
        if g_idx is not None:
            del module.gptq_g_idx
        w, scales = quant.qweight, quant.scales
        zeros = zeros_from_checkpoint(quant.qzeros, v2).to(torch.uint8)
        k_r = w.shape[0] * PACK
        split = group != -1 and _tables_whole(module, group)  # a row-parallel shard, tp > 1
        start = module.tp_rank * k_r if split else 0
        full = g_idx if g_idx is not None else _consecutive(
            k_r * (module.tp_size if split else 1), group)
        perm = None
        if act_order(name, full, group) is None:
            if split:
                rows = slice(start // group, (start + k_r) // group)
                scales, zeros = scales[rows], zeros[rows]
        else:
            w, scales, zeros, perm = shard_act_order(
                w, scales, zeros, full[start:start + k_r], sub_group(group) if split else group)
            if split:
                shard, padded = shard + k_r, padded + perm.numel()
        kw = AwqKernelWeight(w, scales.contiguous(), zeros, perm,
                             pad_x=perm is not None and perm.numel() > k_r)
        for attr in ("qweight", "qzeros", "scales"):
            delattr(module, attr)
        install_kernel_weight(module, kw)
        count += 1
    if shard:
        logger.info("GPTQ act order at --tp-size > 1: row-parallel shards sorted by group and "
                    "padded to blocks of %d channels: %d input channels become %d (+%.1f%%)",
                    sub_group(group), shard, padded, 100 * (padded / shard - 1))
    return count
