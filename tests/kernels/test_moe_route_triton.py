"""The one-kernel MoE router (srt/layers/moe_route_triton.py) against the torch routers it
replaces on the GPU: srt.layers.moe.route_topk (Mixtral, Qwen-MoE) and DeepseekMoE.route
(greedy, group-limited, V3's biased groups), on random logits; without CUDA in Triton's
interpreter. The outputs are created by the kernel's wrapper; the test checks every entry."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from srt.layers.moe import route_topk  # noqa: E402
from srt.layers.moe_route_triton import route_triton  # noqa: E402
from srt.models.deepseek_v2 import DeepseekMoE  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, experts, generator=g) * 2.0


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[1].cpu(), want[1].cpu())
    torch.testing.assert_close(got[0].cpu(), want[0].cpu(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (13, 64, 6), (5, 128, 8),
                                                  (9, 60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_equals_route_topk(tokens: int, experts: int, top_k: int,
                                        renormalize: bool) -> None:
    logits = _logits(tokens, experts, tokens * experts)
    want = route_topk(logits, top_k, renormalize)  # CPU: the torch code
    got = route_triton(logits.to(DEVICE), top_k, renormalize=renormalize)
    _same(got, want)
    # the router of Mixtral in the model's dtype: the kernel reads bf16 logits as they are
    half = logits.bfloat16()
    _same(route_triton(half.to(DEVICE), top_k, renormalize=renormalize),
          route_topk(half, top_k, renormalize))


def _deepseek(experts: int, top_k: int, method: str, groups: int, topk_group: int, norm: bool,
              v3: bool) -> DeepseekMoE:
    config = SimpleNamespace(
        num_experts_per_tok=top_k, n_routed_experts=experts, topk_method=method, n_group=groups,
        topk_group=topk_group, routed_scaling_factor=2.5, norm_topk_prob=norm, hidden_size=16,
        moe_intermediate_size=8, n_shared_experts=0)
    moe = DeepseekMoE(config, v3=v3)
    g = torch.Generator().manual_seed(experts + top_k)
    moe.gate.weight.data = torch.randn(experts, 16, generator=g)
    if v3:
        moe.gate.e_score_correction_bias.data = torch.randn(experts, generator=g) * 0.1
    return moe


@pytest.mark.parametrize("experts,top_k,method,groups,topk_group,norm,v3", [
    (64, 6, "greedy", 1, 1, False, False),  # V2-Lite
    (64, 6, "greedy", 1, 1, True, False),
    (160, 6, "group_limited_greedy", 8, 3, False, False),  # V2
    (256, 8, "noaux_tc", 8, 4, True, True),  # V3 / R1
    (32, 4, "noaux_tc", 4, 2, False, True),
])
def test_deepseek_routing_equals_torch(experts: int, top_k: int, method: str, groups: int,
                                       topk_group: int, norm: bool, v3: bool) -> None:
    moe = _deepseek(experts, top_k, method, groups, topk_group, norm, v3)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(3))
    want = moe.route(x)  # CPU: the torch code
    logits = torch.nn.functional.linear(x, moe.gate.weight).to(DEVICE)
    grouped = v3 or method == "group_limited_greedy"
    got = route_triton(
        logits, top_k, sigmoid=v3,
        bias=moe.gate.e_score_correction_bias.to(DEVICE) if v3 else None,
        renormalize=norm, eps=1e-20, scale=2.5, groups=groups if grouped else 1,
        topk_group=topk_group if grouped else 1, group_top2=v3)
    _same(got, want)
    if grouped:  # the choice really is limited to the best groups
        per = experts // groups
        assert all(len({int(i) // per for i in row}) <= topk_group for row in got[1])
