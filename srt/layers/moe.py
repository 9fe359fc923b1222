"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a replicated router picks the top-k experts of each token.

Tensor parallelism shards every expert like the dense MLP: each rank holds a slice of every expert's
intermediate dimension (w1/w3 column-parallel, w2 row-parallel), computes its partial output for
the tokens routed to each expert, and the partial outputs are all-reduced once per layer. With
expert parallelism (`--ep-size` = `--tp-size`) each rank holds E / tp experts whole and computes
the tokens routed to them (the other choices are dropped); the same all-reduce sums the
ranks' experts. Every rank has every token (attention is tensor-parallel), so no dispatch is
needed. Routing is
computed identically on every rank from the replicated router weights. On a GPU the experts run in
the fused Triton kernel of moe_triton.py below TORCH_PATH_MIN_TOKENS tokens (decode, CUDA
graphs) and in the torch loop below from there; on the CPU always in the torch loop. Experts in
FP8 (`--quantization fp8`, FP8 checkpoints) are read as such by the fused kernel (converted in
registers, the per-row scales applied to its products) and dequantized per expert by the loop.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers import parallel_state as ps
from srt.layers.fp8 import dequantize
from srt.layers.fused import use_fused
from srt.layers.linear import _divide


# From this many tokens (eager fill batches) the per-expert cuBLAS matmuls of the torch path are
# faster than the fused kernel for a few large experts: on one H200 with Mixtral's experts, 256
# tokens 1.22 vs 1.53 ms, 4096 tokens 5.55 vs 8.48 ms; 64 tokens 1.37 vs 1.21 ms
# (benchmarks/bench_moe.py). CUDA graphs always take the fused kernel (the torch path reads the
# expert counts on the host).
TORCH_PATH_MIN_TOKENS = 256
# ... but only up to this many experts a rank: the loop launches about seven kernels an expert,
# so fine-grained MoE (DeepSeek's 64, Qwen3's 128 small experts) spends its fills launching them
# (with 26-48 such layers a forward); those always take the fused kernel.
TORCH_PATH_MAX_EXPERTS = 16


@functools.cache  # asked every layer of every step: find_spec walks sys.path
def _triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def route_topk(router_logits: torch.Tensor, top_k: int,
               renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, keep the top k, renormalize them to sum to 1
    (Mixtral, Qwen3-MoE's `norm_topk_prob`; without, their softmax probabilities: Qwen2-MoE).

    Returns (weights [T, k] float32, expert ids [T, k] int64). On a GPU one kernel
    (srt/layers/moe_route_triton.py)."""
    if use_fused(router_logits) and _triton_available():
        from srt.layers.moe_route_triton import route_triton

        return route_triton(router_logits, top_k, renormalize=renormalize)
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    return (weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights), ids


def moe_forward_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The plain torch path (CPU, and the reference of the fused kernel).

    x: [T, H]; w13: [E, 2 * I, H] (gate rows then up rows); w2: [E, H, I];
    topk_weights, topk_ids: [T, k]; an id of E (another rank's expert under expert
    parallelism) drops that choice. Returns sum_j weight_j * expert_{id_j}(x) as [T, H].
    FP8 experts: w13 / w2 in float8_e4m3fn with per-row scales w13_scale [E, 2 * I] and
    w2_scale [E, H]; each expert used is dequantized (q * scale, in x's dtype)."""
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    # the (token, choice) pairs sorted by expert, so each expert's tokens are one contiguous run
    order = flat_ids.argsort(stable=True)
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].to(x.dtype)
    # One host sync per layer to learn the run lengths; the GPU path does not need it.
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()[: w13.shape[0]]
    out = torch.zeros_like(x)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = tokens[start : start + n]
        a, b = w13[e], w2[e]
        if w13_scale is not None:
            a, b = dequantize(a, w13_scale[e], x.dtype), dequantize(b, w2_scale[e], x.dtype)
        gate, up = F.linear(x.index_select(0, tok), a).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, b) * weights[start : start + n, None]
        out.index_add_(0, tok, y)
        start += n
    return out


class FusedMoE(nn.Module):
    """Every expert's weights stacked: w13_weight [E, 2 * I/tp, H], w2_weight [E, H, I/tp].

    In FP8 (`set_fp8`, srt/layers/fp8.py): the same tensors in float8_e4m3fn, with one scale
    per output row of each expert's shard, w13_scale [E, 2 * I/tp] and w2_scale [E, H]
    (weight-only: the activations stay in the model dtype)."""

    def __init__(self, num_experts: int, top_k: int, hidden: int, intermediate: int,
                 renormalize: bool = True) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize = renormalize
        # Expert parallelism (--ep-size): this rank holds experts first .. first + local - 1
        # whole; otherwise every expert, a slice of its intermediate size.
        self.ep = ps.expert_parallel()
        if self.ep:
            self.local = _divide(num_experts, self.tp_size, "experts")
            self.first = self.tp_rank * self.local
            self.inter_per_rank = intermediate
        else:
            self.local, self.first = num_experts, 0
            self.inter_per_rank = _divide(intermediate, self.tp_size, "expert intermediate size")
        n, e = self.inter_per_rank, self.local
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * n, hidden), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden, n), requires_grad=False)
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None

    @property
    def fp8(self) -> bool:
        return self.w13_scale is not None

    def set_fp8(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                w2_scale: torch.Tensor) -> None:
        """Hold the experts in FP8: the four tensors as the class docstring says."""
        for name, t in (("w13_weight", w13), ("w13_scale", w13_scale), ("w2_weight", w2),
                        ("w2_scale", w2_scale)):
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    def set_block_fp8(self, block: tuple[int, int]) -> None:
        """Take a block-wise FP8 checkpoint's experts: FP8 w13 / w2 and their block scales
        (`w13_scale_inv` [E, 2I / Bn, H / Bk], `w2_scale_inv` [E, H / Bn, I / Bk]) for the
        loader; `finish_block_fp8` turns them into model-dtype experts once loaded."""
        from srt.layers.fp8 import FP8_DTYPE

        bn, bk = block
        n, h = self.inter_per_rank, self.w2_weight.shape[1]
        if n % bn or n % bk or h % bn or h % bk:
            raise ValueError(f"experts of {h} x {n} (a rank's share) are not whole {bn} x {bk} "
                             "FP8 blocks (weight_block_size); a smaller --tp-size may fit")
        dev, e = self.w2_weight.device, self.local
        self.block = block
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * n, h, dtype=FP8_DTYPE, device=dev),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, h, n, dtype=FP8_DTYPE, device=dev),
                                      requires_grad=False)
        self.w13_scale_inv = nn.Parameter(torch.empty(e, 2 * n // bn, h // bk, device=dev,
                                                      dtype=torch.float32), requires_grad=False)
        self.w2_scale_inv = nn.Parameter(torch.empty(e, h // bn, n // bk, device=dev,
                                                     dtype=torch.float32), requires_grad=False)

    def finish_block_fp8(self, dtype: torch.dtype) -> None:
        """The loaded block-FP8 experts dequantized to `dtype` (their scales go)."""
        from srt.layers.fp8_block import dequantize_block

        for name in ("w13", "w2"):
            q, s = getattr(self, f"{name}_weight"), getattr(self, f"{name}_scale_inv")
            w = torch.stack([dequantize_block(q[i], s[i], self.block, dtype)
                             for i in range(q.shape[0])])
            setattr(self, f"{name}_weight", nn.Parameter(w, requires_grad=False))
            delattr(self, f"{name}_scale_inv")
        del self.block

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard_id: str
    ) -> None:
        """One expert's checkpoint tensor: w1 (gate) and w3 (up) [I, H], w2 (down) [H, I]; or,
        into w13_scale / w2_scale, their per-row scales (srt.layers.fp8.weight_scale_rows);
        or, into w13_scale_inv / w2_scale_inv, their block scales (cut in whole blocks)."""
        n = self.inter_per_rank
        expert_id -= self.first
        if not 0 <= expert_id < self.local:
            return  # another rank's expert (expert parallelism): not read
        rank = 0 if self.ep else self.tp_rank  # (whole experts: no slice)
        if param is getattr(self, "w13_scale_inv", None) or \
                param is getattr(self, "w2_scale_inv", None):
            bn, bk = self.block
            if shard_id == "w2":  # [H / Bn, I / Bk]: the rank's input blocks
                param.data[expert_id].copy_(loaded.narrow(1, rank * (n // bk), n // bk))
            else:
                rows = n // bn
                param.data[expert_id].narrow(0, 0 if shard_id == "w1" else rows, rows).copy_(
                    loaded.narrow(0, rank * rows, rows))
            return
        if param is self.w2_scale:  # one per output row H: whole on every rank
            param.data[expert_id].copy_(loaded[:])
            return
        if shard_id == "w2":
            param.data[expert_id].copy_(loaded.narrow(1, rank * n, n))
            return
        offset = 0 if shard_id == "w1" else n
        param.data[expert_id].narrow(0, offset, n).copy_(loaded.narrow(0, rank * n, n))

    def warm_up(self, dtype: torch.dtype) -> bool:
        """Compile the fused kernel's every tile configuration for these experts' shapes on
        `dtype` activations (`warm_up_fused_moe`; nothing all-reduced). False where this layer
        never takes the fused kernel (no CUDA or no Triton)."""
        if not (self.w13_weight.is_cuda and _triton_available()):
            return False
        from srt.layers.moe_triton import warm_up_fused_moe

        warm_up_fused_moe(self.w13_weight, self.w2_weight, self.top_k, dtype,
                          self.w13_scale, self.w2_scale)
        return True

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                reduce: bool = True) -> torch.Tensor:
        return self.compute(x, *route_topk(router_logits, self.top_k, self.renormalize),
                            reduce=reduce)

    def compute(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                reduce: bool = True) -> torch.Tensor:
        """sum_j weights[:, j] * expert_{ids[:, j]}(x), all-reduced over the ranks (with
        `reduce=False`, the rank's partial sum); weights and ids [T, k] as a router chose
        them."""
        if self.ep:
            # this rank's experts only: the others' choices are dropped (id `local`: computed
            # by no kernel); the all-reduce below sums every rank's experts
            ids = ids - self.first
            mine = (ids >= 0) & (ids < self.local)
            ids, weights = torch.where(mine, ids, self.local), torch.where(mine, weights, 0.0)
        if x.is_cuda and _triton_available() and (
                x.shape[0] < TORCH_PATH_MIN_TOKENS or self.local > TORCH_PATH_MAX_EXPERTS
                or torch.cuda.is_current_stream_capturing()):
            from srt.layers.moe_triton import fused_moe_triton

            out = fused_moe_triton(x, self.w13_weight, self.w2_weight, weights, ids,
                                   w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        else:
            out = moe_forward_torch(x, self.w13_weight, self.w2_weight, weights, ids,
                                    self.w13_scale, self.w2_scale)
        return ps.all_reduce(out) if reduce else out


class ReplicatedLinear(nn.Module):
    """A small linear layer every rank holds whole (the router)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Mixtral's `block_sparse_moe` and Qwen-MoE's sparse `mlp`: `gate` (the router) and
    `experts`; with `shared` (Qwen2-MoE) also a dense `shared_expert` MLP of that intermediate
    size (tensor-parallel like the dense MLP, built with reduce_results=False), added under a
    sigmoid `shared_expert_gate` to the experts' partial sum before the one all-reduce."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 renormalize: bool = True, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden, num_experts)
        self.experts = FusedMoE(num_experts, top_k, hidden, intermediate, renormalize)
        self.shared_expert = shared
        if shared is not None:
            self.shared_expert_gate = ReplicatedLinear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return self.experts(x, self.gate(x))
        out = self.experts(x, self.gate(x), reduce=False)
        # the gate is the same on every rank, so it may scale the partial sums
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return ps.all_reduce(out)
