"""The mixture-of-experts layer against a per-token torch reference on random inputs: routing
(softmax over all experts, top-k, renormalized), the expert loop, and the tensor-parallel shards
of every expert summing to the unsharded output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt.layers import parallel_state as ps
from srt.layers.moe import FusedMoE, moe_forward_torch, route_topk


def _reference(x: torch.Tensor, w1: list[torch.Tensor], w3: list[torch.Tensor],
               w2: list[torch.Tensor], logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mixtral's block, one token at a time, from the checkpoint's per-expert tensors."""
    out = torch.full_like(x, float("nan"))
    probs = logits.double().softmax(-1)
    for t in range(x.shape[0]):
        top = probs[t].argsort(descending=True)[:top_k]
        weights = probs[t, top] / probs[t, top].sum()
        acc = torch.zeros_like(x[t])
        for w, e in zip(weights, top.tolist()):
            h = F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])
            acc += float(w) * (w2[e] @ h)
        out[t] = acc
    return out


def _experts(num: int, hidden: int, inter: int, g: torch.Generator) -> tuple[list, list, list]:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2
    return ([rand(inter, hidden) for _ in range(num)], [rand(inter, hidden) for _ in range(num)],
            [rand(hidden, inter) for _ in range(num)])


def test_route_topk_renormalizes() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 8, generator=g)
    weights, ids = route_topk(logits, 2)
    probs = logits.softmax(-1)
    assert torch.equal(ids, probs.topk(2, -1).indices)
    assert torch.allclose(weights.sum(-1), torch.ones(7))
    top = probs.gather(1, ids)
    assert torch.allclose(weights, top / top.sum(-1, keepdim=True))


@pytest.mark.parametrize("tokens,num_experts,top_k", [(1, 4, 2), (13, 8, 2), (40, 4, 1), (9, 3, 3)])
def test_moe_forward_torch_matches_reference(tokens: int, num_experts: int, top_k: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    hidden, inter = 32, 48
    w1, w3, w2 = _experts(num_experts, hidden, inter, g)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, num_experts, generator=g)
    w13 = torch.stack([torch.cat([a, b]) for a, b in zip(w1, w3)])
    weights, ids = route_topk(logits, top_k)
    out = moe_forward_torch(x, w13, torch.stack(w2), weights, ids)
    torch.testing.assert_close(out, _reference(x, w1, w3, w2, logits, top_k),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_expert_shards_sum_to_the_full_output(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank loads its slice of every expert from the checkpoint tensors; the sum of the
    ranks' partial outputs (what the all-reduce computes) is the full block's output."""
    g = torch.Generator().manual_seed(tp)
    num_experts, hidden, inter, tokens = 4, 32, 64, 11
    w1, w3, w2 = _experts(num_experts, hidden, inter, g)
    x = torch.randn(tokens, hidden, generator=g)
    logits = torch.randn(tokens, num_experts, generator=g)
    total = torch.zeros(tokens, hidden)
    for rank in range(tp):
        monkeypatch.setattr(ps, "_group", ps.TPGroup(rank, tp))
        moe = FusedMoE(num_experts, 2, hidden, inter)
        moe.w13_weight.data.fill_(float("nan"))
        moe.w2_weight.data.fill_(float("nan"))
        for e in range(num_experts):
            moe.weight_loader(moe.w13_weight, w1[e], e, "w1")
            moe.weight_loader(moe.w13_weight, w3[e], e, "w3")
            moe.weight_loader(moe.w2_weight, w2[e], e, "w2")
        monkeypatch.setattr(ps, "_group", ps.TPGroup(0, 1))  # forward without a collective
        total += moe(x, logits)
    torch.testing.assert_close(total, _reference(x, w1, w3, w2, logits, 2), rtol=1e-4, atol=1e-4)
