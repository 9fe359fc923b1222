"""MLA's input kernel (srt/layers/mla_triton.py) against the torch code of MLAttention
(RMSNorm, RotaryEmbedding, the two concatenations) on random inputs, interleaved and
half-split rotary with YaRN's scaled cos / sin, strided views as the model passes them; without
CUDA in Triton's interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from srt.layers.layernorm import RMSNorm  # noqa: E402
from srt.layers.mla_triton import mla_prep  # noqa: E402
from srt.layers.rotary import RotaryEmbedding  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def _reference(q, q_lat, kv, norm, rotary, positions, nope, rank):
    rope = q.shape[-1] - nope
    c, k_pe = kv.split([rank, rope], dim=-1)
    c = norm(c.contiguous())
    q_pe, k_pe = rotary(positions, q[..., nope:], k_pe.unsqueeze(1))
    return torch.cat((q_lat, q_pe), dim=-1), torch.cat((c.unsqueeze(1), k_pe), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("tokens,heads,nope,rope,rank", [(1, 2, 16, 8, 32), (7, 3, 8, 16, 48)])
def test_mla_prep_equals_torch(interleaved: bool, tokens: int, heads: int, nope: int, rope: int,
                               rank: int) -> None:
    g = torch.Generator().manual_seed(tokens + heads)
    # q and kv as views into wider projection outputs (the model's splits keep their strides)
    q_full = torch.randn(tokens, heads * (nope + rope) + 5, generator=g)
    q = q_full[:, : heads * (nope + rope)].view(tokens, heads, nope + rope)
    q_lat = torch.randn(tokens, heads, rank, generator=g)
    kv = torch.randn(tokens, rank + rope + 3, generator=g)[:, : rank + rope]
    norm = RMSNorm(rank, 1e-6)
    norm.weight.data = torch.rand(rank, generator=g) + 0.5
    rotary = RotaryEmbedding(rope, 128, 10000.0, YARN, interleaved=interleaved)
    positions = torch.randint(0, 128, (tokens,), generator=g)
    want = _reference(q, q_lat, kv, norm, rotary, positions, nope, rank)
    got = mla_prep(q.to(DEVICE), q_lat.to(DEVICE), kv.to(DEVICE), norm.weight.to(DEVICE),
                   norm.eps, positions.to(DEVICE), rotary.cos_cache.to(DEVICE),
                   rotary.sin_cache.to(DEVICE), nope, interleaved)
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape
        torch.testing.assert_close(g_.cpu(), w_, rtol=1e-5, atol=1e-5)
    # without q_lat (the expanded prefill): the rotated q_pe and the latent alike
    query, latent = mla_prep(q.to(DEVICE), None, kv.to(DEVICE), norm.weight.to(DEVICE),
                             norm.eps, positions.to(DEVICE), rotary.cos_cache.to(DEVICE),
                             rotary.sin_cache.to(DEVICE), nope, interleaved)
    torch.testing.assert_close(query[..., rank:].cpu(), want[0][..., rank:], rtol=1e-5,
                               atol=1e-5)
    torch.testing.assert_close(latent.cpu(), want[1], rtol=1e-5, atol=1e-5)
    # the other rotary layout gives other values: the test sees the layout
    other = mla_prep(q.to(DEVICE), q_lat.to(DEVICE), kv.to(DEVICE), norm.weight.to(DEVICE),
                     norm.eps, positions.to(DEVICE), rotary.cos_cache.to(DEVICE),
                     rotary.sin_cache.to(DEVICE), nope, not interleaved)
    assert not torch.allclose(other[0].cpu(), want[0], atol=1e-3)


def test_mla_prep_writes_the_latents_to_their_pool_slots() -> None:
    """Given the pool and the slots, each token's latent lands in its slot (bit-equal to the
    latent returned); every other slot keeps its poison."""
    g = torch.Generator().manual_seed(3)
    tokens, heads, nope, rope, rank = 5, 2, 8, 16, 48
    q = torch.randn(tokens, heads, nope + rope, generator=g)
    q_lat = torch.randn(tokens, heads, rank, generator=g)
    kv = torch.randn(tokens, rank + rope, generator=g)
    rotary = RotaryEmbedding(rope, 64, 10000.0, None, interleaved=True)
    positions = torch.randint(0, 64, (tokens,), generator=g)
    pool = torch.full((12, 1, rank + rope), 7.25, device=DEVICE)
    loc = torch.tensor([9, 0, 4, 11, 6], device=DEVICE)
    _, latent = mla_prep(q.to(DEVICE), q_lat.to(DEVICE), kv.to(DEVICE),
                         torch.rand(rank, generator=g).to(DEVICE), 1e-6,
                         positions.to(DEVICE), rotary.cos_cache.to(DEVICE),
                         rotary.sin_cache.to(DEVICE), nope, True, pool, loc)
    assert torch.equal(pool[loc], latent)
    others = [i for i in range(12) if i not in loc.tolist()]
    assert bool((pool[others] == 7.25).all())
