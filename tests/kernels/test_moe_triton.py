"""The fused Triton MoE kernel against the torch expert loop (srt.layers.moe.moe_forward_torch)
on random inputs; without CUDA in Triton's interpreter on small shapes, real sizes on a GPU.
Outputs are filled with NaN before the call."""

from __future__ import annotations

import os

from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

triton = pytest.importorskip("triton")

from srt.layers.moe import moe_forward_torch, route_topk  # noqa: E402
from srt.layers.moe_triton import (  # noqa: E402
    ALIGN_LARGE_CHUNK, ALIGN_LARGE_FROM, TILE_CONFIGS, TileConfig, align_pairs_by_expert,
    align_pairs_by_expert_torch, fused_moe_triton, tile_config)


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
          device: str, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x = rand(tokens, hidden, scale=1.0)
    w13 = rand(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = rand(experts, hidden, inter, scale=inter**-0.5)
    weights, ids = route_topk(rand(tokens, experts, scale=1.0), top_k)
    return x, w13, w2, weights, ids


def _check(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
           device: str, seed: int, limit: float, cfg: TileConfig | None = None) -> None:
    x, w13, w2, weights, ids = _case(tokens, experts, top_k, hidden, inter, dtype, device, seed)
    ref = moe_forward_torch(x.double(), w13.double(), w2.double(), weights, ids)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w13, w2, weights, ids, out=out, cfg=cfg)
    assert not out.isnan().any()
    rel = (out.double() - ref).abs().max() / ref.abs().max()
    assert rel < limit, rel


def test_align_pairs_by_expert() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 0]], device=device)
    sorted_pairs, block_expert = align_pairs_by_expert(ids, 4, block_m=2)
    pad = ids.numel()
    # flattened [2, 0, 2, 1, 0, 2, 2, 0]: expert 0 has pairs 1, 4, 7 (+1 pad), expert 1 pair 3
    # (+1 pad), expert 2 pairs 0, 2, 5, 6
    assert sorted_pairs.tolist()[:10] == [1, 4, 7, pad, 3, pad, 0, 2, 5, 6]
    assert all(p == pad for p in sorted_pairs.tolist()[10:])
    assert block_expert.tolist()[:5] == [0, 0, 1, 2, 2]


@pytest.mark.parametrize("tokens,top_k,experts,block_m", [
    (1, 2, 8, 16), (3, 6, 64, 16), (128, 6, 64, 16), (77, 8, 128, 32), (300, 2, 5, 128),
    (50, 4, 160, 16),
    (683, 6, 64, 16),  # 4,098 pairs: over ALIGN_LARGE_FROM, large chunks, the last partial
])
def test_align_kernel_equals_torch_layout(tokens: int, top_k: int, experts: int,
                                          block_m: int) -> None:
    """The one-launch layout equals the torch one exactly (stable order within an expert),
    with some experts unused, expert counts not a power of two, and more pairs than one chunk;
    skewed ids put most pairs on a few experts."""
    assert ALIGN_LARGE_FROM < 4098 and 4098 % ALIGN_LARGE_CHUNK
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(tokens * experts)
    for skew in (False, True):
        if skew:
            ids = (torch.rand(tokens, top_k, generator=g) ** 4 * experts).long()
        else:
            ids = torch.randint(0, experts, (tokens, top_k), generator=g)
        ids = ids.to(device)
        got = align_pairs_by_expert(ids, experts, block_m)
        want = align_pairs_by_expert_torch(ids, experts, block_m)
        assert torch.equal(got[0], want[0])
        assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 4, 2, 32, 48), (7, 4, 2, 32, 48), (19, 8, 2, 48, 40), (5, 3, 3, 16, 16), (33, 8, 1, 32, 32),
    (29, 6, 2, 160, 72),  # three column blocks each way, a partial group of row blocks
])
def test_fused_moe_matches_torch_small(tokens: int, experts: int, top_k: int, hidden: int,
                                       inter: int) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(tokens, experts, top_k, hidden, inter, torch.float32, device, tokens, 1e-3)


@pytest.mark.parametrize("group_m", [1, 3, 1 << 20])
def test_fused_moe_every_program_order(group_m: int, monkeypatch: Any) -> None:
    """Row blocks grouped by 1, by 3 (a partial last group) and all together (the default
    order): every (row block, column block) is computed once whatever the order."""
    from srt.layers import moe_triton

    monkeypatch.setattr(moe_triton, "GROUP_M", group_m)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(29, 6, 2, 160, 72, torch.float32, device, 3, 1e-3, TileConfig(16, 64, 64, 4, 3))


@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_dropped_choices_are_not_computed(tokens: int) -> None:
    """Expert parallelism hands the kernels another rank's choices as id E: they are in no
    expert's run and not summed (their rows of the intermediate outputs stay unwritten), so
    the result is the sum over the kept choices alone, as the torch path computes it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w13, w2, weights, ids = _case(tokens, 4, 3, 32, 24, torch.float32, device, tokens)
    g = torch.Generator().manual_seed(tokens)
    drop = (torch.rand(ids.shape, generator=g) < 0.4).to(device)
    ids = torch.where(drop, 4, ids)
    weights = torch.where(drop, 0.0, weights)
    ref = moe_forward_torch(x.double(), w13.double(), w2.double(), weights, ids)
    kept = moe_forward_torch(x.double(), w13.double(), w2.double(), weights,
                             torch.where(drop, 0, ids))  # the old way: weight 0 on expert 0
    torch.testing.assert_close(ref, kept)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, w13, w2, weights, ids, out=out)
    assert not out.isnan().any()
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-3


@pytest.mark.parametrize("cfg", TILE_CONFIGS)
def test_fused_moe_every_tile_config(cfg: TileConfig) -> None:
    """Each tile configuration `tile_config` picks (padding, skipped blocks, masked edges; in
    float32 on a GPU the largest tiles run with fewer stages)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _check(45, 4, 2, 48, 40, torch.float32, device, 7, 1e-3, cfg)


def test_stages_fit_shared_memory() -> None:
    """A tile's stages shrink to what the shared memory holds in the input's dtype: the
    largest bf16 tiles keep their 4 stages on an H100 / H200, float32 ones drop to 2."""
    from srt.layers.moe_triton import LARGE_FILL_TILES, SMEM_BYTES, _fit_stages

    cpu = torch.device("cpu")  # (the limit of an H100 / H200: SMEM_BYTES)
    assert _fit_stages(LARGE_FILL_TILES, 256, 64, 2, cpu) == 4
    assert _fit_stages(LARGE_FILL_TILES, 256, 64, 4, cpu) == 2
    assert _fit_stages(TileConfig(16, 64, 128, 4, 4), 64, 128, 4, cpu) == 4
    for cfg in TILE_CONFIGS:
        for itemsize in (1, 2, 4):
            stages = _fit_stages(cfg, cfg.block_n, cfg.block_k, itemsize, cpu)
            assert 1 <= stages <= cfg.num_stages
            assert stages * (cfg.block_m + cfg.block_n) * cfg.block_k * itemsize <= SMEM_BYTES


def test_tile_config_grows_with_pairs_per_expert() -> None:
    sizes = [tile_config(p, 8).block_m for p in (2, 128, 512, 8192)]
    assert sizes == sorted(sizes) and sizes[0] == 16 and sizes[-1] == 128


def test_tile_config_picks_only_warmed_configs() -> None:
    """Whatever a batch's pair count, the configuration is one the warm-up compiles, and each
    of those is picked by some batch."""
    picked = {tile_config(p, e) for e in (8, 64, 128) for p in range(1, 40_000, 7)}
    assert picked == set(TILE_CONFIGS)


def test_warm_up_runs_every_config_on_both_kinds_of_pair_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`warm_up_fused_moe` launches the grouped GEMMs under every tile configuration, each with
    a pair count that is a multiple of 16 and one that is not (Triton compiles them apart), and
    the results are finite."""
    from srt.layers import moe_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    launched: list[tuple[TileConfig, int]] = []
    outputs: list[torch.Tensor] = []
    gemm, fused = moe_triton._grouped_gemm, moe_triton.fused_moe_triton

    def spy_gemm(a, w, c, *args):
        launched.append((args[-2], c.shape[0]))
        return gemm(a, w, c, *args)

    def spy_fused(*args, **kw):
        outputs.append(fused(*args, **kw))
        return outputs[-1]

    monkeypatch.setattr(moe_triton, "_grouped_gemm", spy_gemm)
    monkeypatch.setattr(moe_triton, "fused_moe_triton", spy_fused)
    _, w13, w2, _, _ = _case(4, 6, 2, 48, 40, torch.float32, device, 3)
    moe_triton.warm_up_fused_moe(w13, w2, 2, torch.float32)
    for cfg in TILE_CONFIGS:
        counts = {n for c, n in launched if c == cfg}
        assert any(n % 16 == 0 for n in counts) and any(n % 16 for n in counts), (cfg, counts)
    assert len(launched) == 2 * len(outputs)  # the gate/up and the down product of each run
    assert all(o.isfinite().all() for o in outputs)


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [14336, 1792])
@pytest.mark.parametrize("tokens", [1, 16, 64, 1024, 4096])
def test_fused_moe_matches_torch_real_size(tokens: int, inter: int) -> None:
    """Mixtral-8x7B's experts (8, top 2, hidden 4096, intermediate 14336; 1792 = its share at
    tp 8), bf16."""
    _check(tokens, 8, 2, 4096, inter, torch.bfloat16, "cuda", tokens, 1e-2)


def _fp8_case(tokens: int, experts: int, hidden: int, inter: int, dtype: torch.dtype,
              device: str, seed: int):
    from srt.layers.fp8 import _quantize_experts

    x, w13, w2, weights, ids = _case(tokens, experts, 2, hidden, inter, dtype, device, seed)
    q13, s13 = _quantize_experts(w13.float())
    q2, s2 = _quantize_experts(w2.float())
    return x, q13.to(device), s13.to(device), q2.to(device), s2.to(device), weights, ids


@pytest.mark.parametrize("tokens,cfg", [(3, TileConfig(16, 32, 32, 4, 1)),
                                        (40, TileConfig(32, 64, 64, 4, 1))])
def test_fused_moe_fp8_experts(tokens: int, cfg: TileConfig) -> None:
    """FP8 experts with per-row scales: the fused kernel against the torch loop, which
    dequantizes each expert (the float64 reference of the same dequantized weights)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, q13, s13, q2, s2, weights, ids = _fp8_case(tokens, 4, 48, 40, torch.float32, device, 5)
    ref = moe_forward_torch(x.double(), q13, q2, weights, ids, s13, s2)
    out = torch.full_like(x, float("nan"))
    fused_moe_triton(x, q13, q2, weights, ids, out=out, cfg=cfg, w13_scale=s13, w2_scale=s2)
    assert not out.isnan().any()
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-3
    # the scales matter: without them the result is far off
    plain = moe_forward_torch(x.double(), q13.double(), q2.double(), weights, ids)
    assert ((plain - ref).abs().max() / ref.abs().max()) > 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64])
def test_fused_moe_fp8_experts_real_size(tokens: int) -> None:
    x, q13, s13, q2, s2, weights, ids = _fp8_case(tokens, 8, 4096, 14336, torch.bfloat16,
                                                  "cuda", tokens)
    ref = moe_forward_torch(x.float(), q13, q2, weights, ids, s13, s2).double()
    out = fused_moe_triton(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    assert ((out.double() - ref).abs().max() / ref.abs().max()) < 1e-2
