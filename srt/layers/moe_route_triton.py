"""Top-k routing of a mixture of experts in one kernel (GPU; tested on the CPU in Triton's
interpreter against the torch routers of srt/layers/moe.py and srt/models/deepseek_v2.py).

From the router's float32 logits [T, E] to (weights [T, k] float32, expert ids [T, k] int64),
one program a token: softmax or sigmoid scores, optionally a score-correction bias used for the
choice only (DeepSeek-V3), optionally the choice limited to the best `topk_group` of `groups`
expert groups (a group scored by its best score, or by the sum of its two best: V3), the top
k by repeated argmax (so in descending order, as torch.topk returns them), renormalized to sum
to 1 where asked, times a scale. The torch code it replaces is 4-15 launches a layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, w_out_ptr, id_out_ptr, stride_l, scale, eps,
                  E: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr,
                  SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                  GROUPS: tl.constexpr, G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  GROUP_TOP2: tl.constexpr):
    t = tl.program_id(0)
    bins = tl.arange(0, E_PAD)
    valid = bins < E
    x = tl.load(logits_ptr + t * stride_l + bins, mask=valid, other=0.0).to(tl.float32)
    if SIGMOID:
        s = 1.0 / (1.0 + tl.exp(-x))
    else:
        x = tl.where(valid, x, float("-inf"))
        p = tl.exp(x - tl.max(x, 0))
        s = p / tl.sum(p, 0)
    s = tl.where(valid, s, 0.0)
    choose = tl.where(valid, s, float("-inf"))
    if HAS_BIAS:
        choose += tl.load(bias_ptr + bins, mask=valid, other=0.0).to(tl.float32)
    if GROUPS > 1:
        group = bins // (E // GROUPS)
        gidx = tl.arange(0, G_PAD)
        gscore = tl.full((G_PAD,), float("-inf"), tl.float32)
        for g in tl.static_range(GROUPS):
            v = tl.where(group == g, choose, float("-inf"))
            best = tl.max(v, 0)
            if GROUP_TOP2:
                best += tl.max(tl.where(bins == tl.argmax(v, 0), float("-inf"), v), 0)
            gscore = tl.where(gidx == g, best, gscore)
        keep = bins < 0
        for _ in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(gscore, 0)
            keep = keep | (group == gi)
            gscore = tl.where(gidx == gi, float("-inf"), gscore)
        choose = tl.where(keep, choose, float("-inf"))
    kidx = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    for j in tl.static_range(K):
        i = tl.argmax(choose, 0)
        weights = tl.where(kidx == j, tl.sum(tl.where(bins == i, s, 0.0), 0), weights)
        ids = tl.where(kidx == j, i.to(tl.int64), ids)
        choose = tl.where(bins == i, float("-inf"), choose)
    if RENORM:
        weights = weights / (tl.sum(weights, 0) + eps)
    tl.store(w_out_ptr + t * K + kidx, weights * scale, mask=kidx < K)
    tl.store(id_out_ptr + t * K + kidx, ids, mask=kidx < K)


def route_triton(logits: torch.Tensor, top_k: int, *, sigmoid: bool = False,
                 bias: torch.Tensor | None = None, renormalize: bool = True, eps: float = 0.0,
                 scale: float = 1.0, groups: int = 1, topk_group: int = 1,
                 group_top2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, ids [T, k] int64) of float32 logits [T, E], as the module
    docstring says; `eps` is added to the sum a renormalization divides by."""
    t, e = logits.shape
    if groups > 1 and e % groups:
        raise ValueError(f"{e} experts do not split into {groups} groups")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    _route_kernel[(t,)](
        logits, bias if bias is not None else logits, weights, ids, logits.stride(0),
        float(scale), float(eps), E=e, E_PAD=triton.next_power_of_2(e),
        K=top_k, K_PAD=triton.next_power_of_2(top_k), SIGMOID=sigmoid,
        HAS_BIAS=bias is not None, RENORM=renormalize, GROUPS=groups,
        G_PAD=triton.next_power_of_2(groups), TOPK_GROUP=topk_group, GROUP_TOP2=group_top2,
        num_warps=1 if e <= 128 else 2)
    return weights, ids
