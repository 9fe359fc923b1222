"""What a checkpoint's `quantization_config` (config.json) says, and whether srt loads it.

Loaded: FP8 (e4m3) weights with one scale per tensor or per output channel, in the two formats
tools write them:

- `quant_method: "fp8"` (Hugging Face / vLLM; e.g. `{"quant_method": "fp8",
  "activation_scheme": "static" | "dynamic"}`): tensors `weight` (float8_e4m3fn),
  `weight_scale` (a scalar or one per output row), `input_scale` with static activations.
- `quant_method: "compressed-tensors"` with `format: "float-quantized"` (what llm-compressor
  writes for FP8): one config group whose `weights` are `{"num_bits": 8, "type": "float",
  "strategy": "tensor" | "channel"}`; tensors as above (`weight_scale` [out, 1] per channel).
  Its `ignore` list names layers left unquantized (usually `lm_head`).

The activations are quantized per token at run time whatever the checkpoint says (a static
`input_scale` is read past, not used): the weights, which is what the checkpoint fixes, are
used exactly.

Also loaded: AWQ int4 in AutoAWQ's GEMM layout (`{"quant_method": "awq", "bits": 4,
"group_size": 128, "zero_point": true, "version": "gemm"}`; srt/layers/awq.py), its
`modules_to_not_convert` left in the model dtype; not for mixture-of-experts models.

Also loaded: GPTQ int4 (`{"quant_method": "gptq", "bits": 4, "group_size": 128 | -1,
"desc_act": ..., "sym": ..., "checkpoint_format": "gptq" | "gptq_v2"}`, as AutoGPTQ, GPTQModel
and optimum write it; srt/layers/gptq.py), symmetric or not; act-order (desc_act) ones too
(each layer's g_idx read at load);
`modules_in_block_to_quantize` leaves the other layers in the model dtype; not for
mixture-of-experts models.

Block-wise FP8 (`weight_block_size` [Bn, Bk], powers of two, dynamic activations) loads
(srt/layers/fp8_block.py; experts dequantized to the model dtype once loaded).

Refused with the reason: other bit widths, AWQ's
GEMV / Marlin layouts or symmetric (no zero point) variant, GPTQ's Marlin / BitBLAS formats,
per-module overrides (`dynamic`) or a quantized `lm_head`, and other methods.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CheckpointQuant:
    """A loadable FP8 checkpoint: its method and the module names it leaves unquantized."""

    method: str  # "fp8", "compressed-tensors", "awq" or "gptq"
    ignore: tuple[str, ...] = ()
    group_size: int = 0  # AWQ / GPTQ: input channels per scale (GPTQ -1: all)
    only: tuple[str, ...] = ()  # GPTQ: when given, the modules quantized (the rest ignored)
    gptq_v2: bool = False  # GPTQ: zero points stored as they are (v1 stores z - 1)
    block: tuple[int, int] | None = None  # fp8: weight_block_size (Bn, Bk), else per channel

    @property
    def is_int4(self) -> bool:
        return self.method in ("awq", "gptq")

    @property
    def is_fp8(self) -> bool:
        return self.method in ("fp8", "compressed-tensors")

    def quantized(self, module_name: str) -> bool:
        """Whether the checkpoint holds this srt module's weight quantized. srt's merged layers
        (`qkv_proj`, `gate_up_proj`) stand for the checkpoint's parts (`q_proj`, ...): they are
        quantized when no part is ignored, and a layer with some parts ignored and others not
        is refused (ValueError), as it cannot be one product."""
        head, _, leaf = module_name.rpartition(".")
        parts = [f"{head}.{p}" if head else p for p in _MERGED.get(leaf, (leaf,))]
        kept = [p for p in parts if self._ignored(p)]
        if kept and len(kept) < len(parts):
            raise ValueError(f"the checkpoint quantizes only some of {', '.join(parts)} "
                             f"({self.method}: {', '.join(kept)} left unquantized), which srt "
                             f"computes as one layer ({module_name})")
        return not kept

    def _ignored(self, name: str) -> bool:
        """An ignore entry matches the module's name or its last parts; a "re:" entry is a
        regular expression; AWQ's `modules_to_not_convert` are substrings, as AutoAWQ reads
        them."""
        import re

        if self.only and not any(name == o or name.endswith("." + o) for o in self.only):
            return True
        for pat in self.ignore:
            if pat.startswith("re:"):
                if re.match(pat[3:], name):
                    return True
            elif self.method == "awq":
                if pat in name:
                    return True
            elif name == pat or name.endswith("." + pat):
                return True
        return False


# srt's merged linear layers and the checkpoint modules they hold
_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _read_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def read_quantization_config(path: str) -> dict[str, Any] | None:
    """config.json's quantization_config, else an AutoGPTQ-era `quantize_config.json` beside
    it (those name no quant_method: GPTQ), else None."""
    cfg = _read_config(path)
    for c in (cfg, cfg.get("text_config") or {}):
        if c.get("quantization_config"):
            return dict(c["quantization_config"])
    side = os.path.join(path, "quantize_config.json")
    if os.path.exists(side):
        with open(side) as f:
            qc = dict(json.load(f))
        qc.setdefault("quant_method", "gptq")
        return qc
    return None


def _refuse_int4(method: str, bad: str | None, cfg: dict[str, Any], where: str) -> None:
    """ValueError naming what an int4 checkpoint has that srt cannot load (`bad`, or experts)."""
    if bad is None and (cfg.get("num_local_experts")
                        or (cfg.get("text_config") or {}).get("num_local_experts")):
        bad = f"mixture-of-experts layers (srt has no {method.upper()} expert kernel)"
    if bad:
        raise ValueError(f"the checkpoint is quantized with quant_method '{method}' with {bad} "
                         f"({where}), which srt cannot load")


def _awq(qc: dict[str, Any], cfg: dict[str, Any], where: str) -> CheckpointQuant:
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version", "gemm")).lower()
    bad = None
    if bits != 4:
        bad = f"{bits} bits (4 are loaded)"
    elif version != "gemm":
        bad = f"version {version!r} (the 'gemm' layout is loaded)"
    elif not qc.get("zero_point", True):
        bad = "no zero point (the asymmetric, zero-point variant is loaded)"
    elif not isinstance(group, int) or group < 16 or group & (group - 1):
        bad = f"group size {group} (a power of two of at least 16 is loaded)"
    _refuse_int4("awq", bad, cfg, where)
    return CheckpointQuant("awq", tuple(qc.get("modules_to_not_convert") or ()), group)


def _gptq(qc: dict[str, Any], cfg: dict[str, Any], where: str) -> CheckpointQuant:
    bits, group = qc.get("bits"), qc.get("group_size")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    bad = None
    if bits != 4:
        bad = f"{bits} bits (4 are loaded)"
    elif fmt not in ("gptq", "gptq_v2"):
        bad = f"checkpoint_format {fmt!r} ('gptq' and 'gptq_v2' are loaded)"
    elif not isinstance(group, int) or (group != -1 and (group < 16 or group & (group - 1))):
        bad = f"group size {group} (-1 or a power of two of at least 16 is loaded)"
    elif qc.get("dynamic"):
        bad = "per-module overrides ('dynamic')"
    elif qc.get("lm_head"):
        bad = "a quantized lm_head"
    _refuse_int4("gptq", bad, cfg, where)
    only: list[str] = []
    for entry in qc.get("modules_in_block_to_quantize") or ():
        only.extend([entry] if isinstance(entry, str) else entry)
    return CheckpointQuant("gptq", (), group, tuple(only), fmt == "gptq_v2")


def checkpoint_quant(path: str) -> CheckpointQuant | None:
    """The checkpoint's quantization, or None for an unquantized one. ValueError (naming the
    method and what is not supported) for one srt cannot load."""
    qc = read_quantization_config(path)
    if qc is None:
        return None
    method = str(qc.get("quant_method") or "unknown")
    where = "config.json quantization_config"
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(
                isinstance(b, int) and b >= 16 and b & (b - 1) == 0 for b in block)):
            raise ValueError(f"the checkpoint is quantized with quant_method 'fp8' with "
                             f"weight_block_size {block} ({where}), which srt cannot load (two "
                             "powers of two of at least 16, as [128, 128])")
        if block is not None and qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"block-wise FP8 with activation_scheme "
                             f"{qc.get('activation_scheme')!r} ({where}): only 'dynamic' loads")
        return CheckpointQuant("fp8", tuple(qc.get("ignored_layers") or ()),
                               block=tuple(block) if block else None)
    if method == "compressed-tensors":
        fmt = qc.get("format")
        groups = list((qc.get("config_groups") or {}).values())
        bad = None
        if fmt != "float-quantized":
            bad = f"format {fmt!r} (only 'float-quantized', FP8, is loaded)"
        elif len(groups) != 1:
            bad = f"{len(groups)} config groups (one is loaded)"
        else:
            w = groups[0].get("weights") or {}
            if (w.get("num_bits"), w.get("type")) != (8, "float"):
                bad = f"weights of {w.get('num_bits')} bits of type {w.get('type')!r}"
            elif w.get("strategy") not in ("tensor", "channel"):
                bad = f"weight strategy {w.get('strategy')!r} (tensor or channel are loaded)"
        if bad:
            raise ValueError(f"the checkpoint is quantized with quant_method 'compressed-tensors' "
                             f"with {bad} ({where}), which srt cannot load")
        return CheckpointQuant("compressed-tensors", tuple(qc.get("ignore") or ()))
    if method == "awq":
        return _awq(qc, _read_config(path), where)
    if method == "gptq":
        return _gptq(qc, _read_config(path), where)
    raise ValueError(f"the checkpoint is quantized with quant_method {method!r} ({where}), "
                     "which srt cannot load (FP8 checkpoints, 'fp8' or 'compressed-tensors', "
                     "AWQ int4 in the 'gemm' layout and GPTQ int4 are loaded; --quantization "
                     "fp8 quantizes an unquantized checkpoint at load)")
