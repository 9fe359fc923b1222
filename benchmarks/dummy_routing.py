"""How many experts a decode step of the DeepSeek-V2-Lite shape touches under two kinds of
random weights (CPU, seconds):

    python3 benchmarks/dummy_routing.py [--tokens 128]

- vLLM's dummy weights (`load_format="dummy"`, as the peer kit runs it): every parameter
  uniform in [-1e-3, 1e-3] from a generator re-seeded with 1234 for each, and DeepSeek's router
  softmax taken in bfloat16 (vLLM's grouped top-k path takes torch.softmax of the bf16 router
  logits). The logits are about 1e-5, so every bf16 score rounds to 1/64 and the top 6 is the
  same 6 experts for every token: a step reads 6 of the 64 experts of each layer.
- The same logits with the softmax in float32 (srt's router, as DeepSeek's reference code
  computes it), and srt's own dummy weights: the tokens spread over the experts.

The hidden state is the embedding after the first RMSNorm (with such weights the layers add
values far below it). This explains a benchmark's MoE speed on random weights, not a model's.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

VOCAB, HIDDEN, EXPERTS, TOP_K = 102400, 2048, 64, 6


def _vllm_dummy(*shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.empty(*shape).uniform_(-1e-3, 1e-3, generator=g).bfloat16()


def _srt_dummy(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.empty(*shape).uniform_(-1e-2, 1e-2, generator=g).bfloat16()


def _normed(emb: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    h = emb[ids].float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16() * weight


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    ids = torch.randint(0, VOCAB, (a.tokens,), generator=torch.Generator().manual_seed(0))
    rows = []
    h = _normed(_vllm_dummy(VOCAB, HIDDEN), _vllm_dummy(HIDDEN), ids)
    logits = F.linear(h, _vllm_dummy(EXPERTS, HIDDEN))
    rows.append(("vLLM dummy weights, bf16 softmax", logits.float().abs().max().item(),
                 torch.softmax(logits, dim=-1)))
    rows.append(("vLLM dummy weights, fp32 softmax", logits.float().abs().max().item(),
                 torch.softmax(logits.float(), dim=-1)))
    h = _normed(_srt_dummy(VOCAB, HIDDEN, seed=1), torch.ones(HIDDEN).bfloat16(), ids)
    logits = F.linear(h.float(), _srt_dummy(EXPERTS, HIDDEN, seed=2).float())
    rows.append(("srt dummy weights, fp32 softmax", logits.abs().max().item(),
                 torch.softmax(logits, dim=-1)))
    print(f"{a.tokens} tokens, {EXPERTS} experts, top {TOP_K}")
    print(f"{'weights, router':36} {'max |logit|':>12} {'distinct scores/token':>22} "
          f"{'experts touched':>16}")
    for name, top, scores in rows:
        distinct = sum(len(set(r.tolist())) for r in scores) / len(scores)
        touched = len(set(scores.topk(TOP_K, dim=-1)[1].flatten().tolist()))
        print(f"{name:36} {top:12.3g} {distinct:22.1f} {touched:16d}")


if __name__ == "__main__":
    main()
