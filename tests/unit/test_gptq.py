"""GPTQ int4 (the layout AutoGPTQ / GPTQModel / optimum write): packing order, zero-point
conventions (v1 stores z - 1), the quantizer, the check of g_idx, the config's refusals, and
the conversion into the int4 kernels' weight through a linear layer on the CPU."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from srt.layers.gptq import act_order, dequantize_gptq, finish_gptq, pack_rows, \
    quantize_gptq, set_gptq, unpack_rows, zeros_from_checkpoint


def test_rows_pack_along_the_input_axis() -> None:
    # channels 0..7 of one output column holding 1..8: nibble j (bits 4 j) is channel j
    word = pack_rows(torch.arange(1, 9).view(8, 1))
    assert word.shape == (1, 1) and word.dtype == torch.int32
    assert int(word) & 0xFFFFFFFF == 0x87654321
    v = torch.randint(0, 16, (64, 24), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_rows(pack_rows(v)), v.to(torch.int32))


def test_symmetric_v1_stores_seven_and_v2_eight() -> None:
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    _, z1, _, _ = quantize_gptq(w, 64, sym=True)
    _, z2, _, _ = quantize_gptq(w, 64, sym=True, v2=True)
    assert z1.shape == (2, 2) and (z1 == 0x77777777).all()
    assert ((z2.to(torch.int64) & 0xFFFFFFFF) == 0x88888888).all()
    assert (zeros_from_checkpoint(z1, v2=False) == 8).all()
    assert (zeros_from_checkpoint(z2, v2=True) == 8).all()


@pytest.mark.parametrize("group,sym,v2", [(32, True, False), (64, False, True),
                                          (-1, True, False), (32, False, False)])
def test_quantize_dequantize(group: int, sym: bool, v2: bool) -> None:
    """Round to nearest: every weight within half a step of its original (plus the scale's
    float16 rounding; symmetric groups also clip nothing); the layout's shapes and dtypes."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 256, generator=g) * 0.05  # [N, K]
    qweight, qzeros, scales, g_idx = quantize_gptq(w, group, sym, v2)
    groups = 1 if group == -1 else 256 // group
    assert qweight.shape == (32, 48) and qweight.dtype == torch.int32
    assert qzeros.shape == (groups, 6) and qzeros.dtype == torch.int32
    assert scales.shape == (groups, 48) and scales.dtype == torch.float16
    assert g_idx.dtype == torch.int32 and torch.equal(
        g_idx, torch.arange(256, dtype=torch.int32) // (256 if group == -1 else group))
    deq = dequantize_gptq(qweight, qzeros, scales, g_idx, torch.float32, v2)
    step = scales.float()[g_idx.long()].t()
    assert ((deq - w).abs() <= 0.5 * step * 1.01 + 1e-6).all()
    assert (deq != w).any()
    # the definition, written out for one element
    k, n = 70, 5
    q = (int(qweight[k // 8, n]) >> (4 * (k % 8))) & 0xF
    z = ((int(qzeros[int(g_idx[k]), n // 8]) >> (4 * (n % 8))) & 0xF) + (0 if v2 else 1)
    assert deq[n, k] == (q - z) * scales[int(g_idx[k]), n].float()


def test_v1_reads_a_stored_fifteen_as_sixteen() -> None:
    """A v1 zero nibble of 15 is z = 16 (how the reference kernels read v1)."""
    qzeros = torch.full((1, 1), 0xF, dtype=torch.int32)
    assert zeros_from_checkpoint(qzeros, v2=False)[0, 0] == 16
    assert zeros_from_checkpoint(qzeros, v2=False)[0, 1] == 1


def test_act_order_sorts_channels_by_group() -> None:
    assert act_order("l.g_idx", torch.arange(256, dtype=torch.int32) // 64, 64) is None
    assert act_order("l.g_idx", torch.zeros(256, dtype=torch.int32), -1) is None
    g = (torch.randperm(256, generator=torch.Generator().manual_seed(3)) // 64).to(torch.int32)
    perm = act_order("l.g_idx", g, 64)
    assert torch.equal(g[perm].long(), torch.arange(256) // 64)
    uneven = torch.arange(256, dtype=torch.int32) // 64
    uneven[0] = 1  # group 0 with 63 channels, group 1 with 65
    with pytest.raises(ValueError, match="not of 64 input channels each"):
        act_order("model.layers.0.mlp.down_proj.g_idx", uneven, 64)


def test_a_linear_layer_serves_the_checkpoint_weight() -> None:
    """set_gptq gives a layer the checkpoint's parameters; once filled, finish_gptq makes them
    the int4 kernels' weight (as AWQ's; act order: channels sorted by group, x gathered),
    whose CPU product equals the dequantized weight's."""
    from srt.layers.awq import AwqKernelWeight
    from srt.layers.linear import ColumnParallelLinear

    g = torch.Generator().manual_seed(4)
    for v2, ordered in ((False, False), (True, False), (False, True)):
        layer = ColumnParallelLinear(128, 48)
        set_gptq(layer, 32)
        tensors = quantize_gptq(torch.randn(48, 128, generator=g), 32, sym=not v2, v2=v2)
        if ordered:  # act order: g_idx a permutation of the groups
            tensors = (*tensors[:3], tensors[3][torch.randperm(128, generator=g)].contiguous())
            layer.gptq_g_idx = tensors[3].long()
        for p, t in zip((layer.qweight, layer.qzeros, layer.scales), tensors[:3]):
            p.data.copy_(t)
        assert finish_gptq(layer, v2, 32) == 1
        assert isinstance(layer.quant, AwqKernelWeight)
        assert (layer.quant.perm is not None) == ordered
        assert {n for n, _ in layer.named_parameters()} == {"awq_w", "awq_scales", "awq_zeros"}
        x = torch.randn(3, 5, 128, generator=g)
        want = x @ dequantize_gptq(*tensors, torch.float32, v2).t()
        # (act order sums in another order: float32 rounding only)
        torch.testing.assert_close(layer(x), want, rtol=0, atol=1e-4 if ordered else 1e-5)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("ordered", [False, True])
def test_row_parallel_shards_sum_to_the_checkpoint_weight(group: int, ordered: bool) -> None:
    """A row-parallel layer cut over two ranks (each rank's layer built here with its rank, the
    outputs summed as the all-reduce would): every rank reads the whole scales and zero
    points; with consecutive groups it keeps its own, in act order it becomes a layer of
    sub_group(G) blocks over its channels sorted by group (runs padded with zero
    activations). The sum of the shards' products equals the full dequantized weight's."""
    from srt.layers.gptq import shard_act_order, sub_group
    from srt.layers.linear import RowParallelLinear

    g = torch.Generator().manual_seed(group + ordered)
    k, n, tp = 256, 48, 2
    tensors = quantize_gptq(torch.randn(n, k, generator=g), group, sym=False, v2=False)
    if ordered:
        tensors = (*tensors[:3], tensors[3][torch.randperm(k, generator=g)].contiguous())
    x = torch.randn(3, k, generator=g)
    total = torch.zeros(3, n)
    for rank in range(tp):
        layer = RowParallelLinear(k // tp, n)  # this rank's shard (the process group is 1)
        layer.tp_rank, layer.tp_size = rank, tp
        set_gptq(layer, group)
        assert layer.scales.shape == (k // group, n)  # every group
        rows = slice(rank * k // tp // 8, (rank + 1) * k // tp // 8)
        for p, t in zip((layer.qweight, layer.qzeros, layer.scales),
                        (tensors[0][rows], *tensors[1:3])):
            p.data.copy_(t)
        layer.gptq_g_idx = tensors[3].long()
        finish_gptq(layer, False, group)
        kw = layer.quant
        assert (kw.perm is not None) == ordered and kw.pad_x == ordered
        assert not hasattr(layer, "gptq_g_idx")
        if ordered:
            sub = sub_group(group)
            k_new = kw.w.shape[0] * 8
            assert kw.scales.shape == (k_new // sub, n) and k_new % sub == 0
            assert k // tp <= k_new < k // tp + (k // group) * sub
            real = kw.perm[kw.perm < k // tp]
            assert torch.equal(real.sort().values, torch.arange(k // tp))  # each channel once
        else:
            assert kw.scales.shape == (k // tp // group, n)
        total += layer(x[:, rank * k // tp:(rank + 1) * k // tp])
    want = x @ dequantize_gptq(*tensors, torch.float32, False).t()
    torch.testing.assert_close(total, want, rtol=0, atol=1e-4)
    # a shard's padding reads zeros whatever the weight rows hold there
    w, s_, z, perm = shard_act_order(tensors[0][:16], tensors[2],
                                     zeros_from_checkpoint(tensors[1], False).to(torch.uint8),
                                     torch.tensor([1] * 100 + [0] * 28), 32)
    assert perm.numel() == 128 + 32 and (perm == 128).sum() == 32
    assert torch.equal(perm[:28], torch.arange(100, 128))  # group 0 first


def test_g_idx_only_for_gptq_layers() -> None:
    """The loader keeps a g_idx on a GPTQ layer (whatever model holds it: no flag on the top
    model, so a language model inside LLaVA keeps its own) and refuses one for a layer the
    checkpoint's config leaves unquantized."""
    from srt.layers.gptq import keep_g_idx
    from srt.layers.linear import ColumnParallelLinear

    plain, layer = ColumnParallelLinear(64, 16), ColumnParallelLinear(64, 16)
    set_gptq(layer, 32)
    keep_g_idx(layer, "l.g_idx", torch.arange(64, dtype=torch.int32) // 32)
    assert layer.gptq_g_idx.dtype == torch.int64
    with pytest.raises(ValueError, match="does not quantize"):
        keep_g_idx(plain, "p.g_idx", torch.arange(64, dtype=torch.int32) // 32)


def _ckpt(tmp_path: Any, qc: dict[str, Any], **cfg: Any) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc, **cfg}))
    return str(tmp_path)


@pytest.mark.parametrize("qc,why", [
    ({"bits": 8, "group_size": 128}, "8 bits"),
    ({"bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"bits": 4, "group_size": 100}, "group size 100"),
    ({"bits": 4, "group_size": 128, "dynamic": {"-:.*down_proj": {}}}, "per-module overrides"),
    ({"bits": 4, "group_size": 128, "lm_head": True}, "a quantized lm_head"),
])
def test_config_refusals(tmp_path: Any, qc: dict[str, Any], why: str) -> None:
    from srt.layers.quant_config import checkpoint_quant

    with pytest.raises(ValueError, match=f"quant_method 'gptq' with {why}"):
        checkpoint_quant(_ckpt(tmp_path, {"quant_method": "gptq", **qc}))


def test_config_read(tmp_path: Any) -> None:
    """GPTQModel's keys (format / checkpoint_format, desc_act, sym); AutoGPTQ's
    quantize_config.json beside a config without quantization_config (no quant_method);
    modules_in_block_to_quantize leaves the other layers unquantized."""
    from srt.layers.quant_config import checkpoint_quant

    c = checkpoint_quant(_ckpt(tmp_path, {"quant_method": "gptq", "bits": 4, "group_size": -1,
                                          "desc_act": True, "sym": False,
                                          "format": "gptq_v2"}))
    assert (c.method, c.group_size, c.gptq_v2, c.is_int4) == ("gptq", -1, True, True)
    side = tmp_path / "side"
    side.mkdir()
    (side / "config.json").write_text("{}")
    (side / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128,
                                                           "desc_act": False}))
    c = checkpoint_quant(str(side))
    assert (c.method, c.group_size, c.gptq_v2) == ("gptq", 128, False)
    (tmp_path / "only").mkdir()
    c = checkpoint_quant(_ckpt(tmp_path / "only", {
        "quant_method": "gptq", "bits": 4, "group_size": 128,
        "modules_in_block_to_quantize": [["self_attn.q_proj", "self_attn.k_proj",
                                          "self_attn.v_proj"], ["mlp.down_proj"]]}))
    assert c.quantized("model.layers.0.self_attn.qkv_proj")
    assert c.quantized("model.layers.0.mlp.down_proj")
    assert not c.quantized("model.layers.0.mlp.gate_up_proj")
    assert not c.quantized("model.layers.0.self_attn.o_proj")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("group", [128, -1])
def test_gptq_layer_on_the_gpu_kernels(group: int) -> None:
    """A GPTQ layer on the GPU (its qweight used as the kernels' weight, v1 zero points up to
    16; act order at group 128) equals its dequantized weight in bf16, at the decode rows and
    the prefill path."""
    from srt.layers.linear import RowParallelLinear

    g = torch.Generator().manual_seed(5)
    layer = RowParallelLinear(4096, 1024).cuda()
    set_gptq(layer, group)
    tensors = quantize_gptq(torch.randn(1024, 4096, generator=g) * 0.02, group, sym=False)
    qzeros = tensors[1].clone()
    qzeros[0, 0] = qzeros[0, 0] | 0xF  # a stored 15: z = 16
    tensors = (tensors[0], qzeros, *tensors[2:])
    for p, t in zip((layer.qweight, layer.qzeros, layer.scales), tensors[:3]):
        p.data.copy_(t.cuda())
    if group != -1:  # act order
        tensors = (*tensors[:3], tensors[3][torch.randperm(4096, generator=g)].contiguous())
        layer.gptq_g_idx = tensors[3].long()
    finish_gptq(layer, False, group)
    w = dequantize_gptq(*tensors, torch.float64, v2=False).cuda()
    for m in (1, 2, 4, 16, 300):
        x = torch.randn(m, 4096, generator=g).to(torch.bfloat16).cuda()
        ref = x.double() @ w.t()
        out = layer(x)
        assert ((out.double() - ref).abs().max() / ref.abs().max()).item() < 1e-2, m
