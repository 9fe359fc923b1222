"""MLA's prefill over expanded keys and values (srt/layers/attention/fresh_prefill.py): the
Triton branch (values narrower than the keys, zero-padded) against a float64 causal attention
per request, on random inputs; without CUDA in Triton's interpreter. The torch branch against
the same reference."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from srt.layers.attention.fresh_prefill import fresh_prefill_attention  # noqa: E402
from srt.layers.attention.triton_backend import TritonExtendMetadata  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _meta(prefix: list[int], lens: list[int]) -> TritonExtendMetadata:
    """The triton backend's metadata of an extend step with these prefix and new lengths."""
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    starts = torch.cumsum(lens_t, 0, dtype=torch.int32) - lens_t
    return TritonExtendMetadata(torch.tensor(prefix, dtype=torch.int32, device=DEVICE), lens_t,
                                starts, max(lens))


def _reference(q, k, v, lens, scale):
    out, start = [], 0
    for n in lens:
        qi, ki, vi = (x[start:start + n].double().transpose(0, 1) for x in (q, k, v))
        s = (qi @ ki.transpose(1, 2)) * scale
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), -1e300)
        out.append((s.softmax(-1) @ vi).transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("triton_branch", [True, False])
@pytest.mark.parametrize("lens,heads,d,dv", [([5, 1, 19], 2, 24, 16), ([33], 3, 48, 32)])
def test_fresh_prefill_equals_reference(triton_branch: bool, lens: list[int], heads: int,
                                        d: int, dv: int) -> None:
    g = torch.Generator().manual_seed(sum(lens) + d)
    t = sum(lens)
    q, k = (torch.randn(t, heads, d, generator=g).to(DEVICE) for _ in range(2))
    v = torch.randn(t, heads, dv, generator=g).to(DEVICE)
    scale = d ** -0.5
    meta = _meta([0] * len(lens), lens) if triton_branch else None
    out = fresh_prefill_attention(q, k, v, meta, lens, scale)
    assert out.shape == (t, heads, dv)
    torch.testing.assert_close(out.double(), _reference(q, k, v, lens, scale),
                               atol=2e-5, rtol=2e-5)


def _extend_reference(q, k, v, kp, vp, prefix, lens, scale):
    out, start, pstart = [], 0, 0
    for p, n in zip(prefix, lens):
        qi = q[start:start + n].double().transpose(0, 1)
        ki = torch.cat((kp[pstart:pstart + p], k[start:start + n])).double().transpose(0, 1)
        vi = torch.cat((vp[pstart:pstart + p], v[start:start + n])).double().transpose(0, 1)
        s = (qi @ ki.transpose(1, 2)) * scale
        seen = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(diagonal=p)
        s = s.masked_fill(~seen, -1e300)
        out.append((s.softmax(-1) @ vi).transpose(0, 1))
        start += n
        pstart += p
    return torch.cat(out)


@pytest.mark.parametrize("triton_branch", [True, False])
@pytest.mark.parametrize("prefix,lens,heads,d,dv", [
    ([7, 0, 40], [5, 3, 19], 2, 24, 16), ([65], [33], 3, 48, 32)])
def test_expanded_extend_equals_reference(triton_branch: bool, prefix: list[int],
                                          lens: list[int], heads: int, d: int,
                                          dv: int) -> None:
    """New tokens over their requests' prefixes (one request without one) and each other;
    the prefix rows are read in the packed order (a table that swapped requests' prefixes,
    or a mask that hid the prefix or showed later tokens, fails it)."""
    from srt.layers.attention.fresh_prefill import expanded_extend_attention

    g = torch.Generator().manual_seed(sum(lens) + sum(prefix) + d)
    t, p = sum(lens), sum(prefix)
    q, k = (torch.randn(t, heads, d, generator=g).to(DEVICE) for _ in range(2))
    v = torch.randn(t, heads, dv, generator=g).to(DEVICE)
    kp = torch.randn(p, heads, d, generator=g).to(DEVICE)
    vp = torch.randn(p, heads, dv, generator=g).to(DEVICE)
    scale = d ** -0.5
    meta = _meta(prefix, lens) if triton_branch else None
    out = expanded_extend_attention(q, k, v, kp, vp, meta, prefix, lens, scale)
    assert out.shape == (t, heads, dv)
    torch.testing.assert_close(out.double(), _extend_reference(q, k, v, kp, vp, prefix, lens,
                                                               scale), atol=2e-5, rtol=2e-5)
