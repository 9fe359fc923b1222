"""A LoRA adapter read from PEFT's layout: `adapter_config.json` and `adapter_model.safetensors`.

PEFT names each low-rank pair after the base layer it adapts, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight` ([rank, in]) and `...lora_B.weight`
([out, rank]); the layer's output becomes W x + scaling * B A x, with scaling lora_alpha / rank
(lora_alpha / sqrt(rank) with `use_rslora`). `LoraAdapter.load` reads the files on the host in
float32 and checks them against the base model, so that a bad adapter is refused with a message
before anything reaches a device: missing files, an unknown or unserved target module, a rank over
the server's maximum, shapes that do not match the base model, layers it does not have, and the
PEFT options srt does not implement (DoRA, biases, modules_to_save, embedding / LM head adapters).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the HTTP process reads adapter configs without importing torch)
    import torch

# The projections an adapter may target, in the order the servers list them.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# SGLang's names for the merged layers, accepted by --lora-target-modules
MERGED_NAMES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoraError(ValueError):
    """An adapter that cannot be served; the message says why (answered as a 400)."""


@dataclass(frozen=True)
class BaseShapes:
    """The full (unsharded) sizes of the base model's projections: (in, out) of each target."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, hf_config: object) -> "BaseShapes":
        """From a Llama-shaped config (hidden, intermediate, heads, KV heads, head_dim)."""
        c = hf_config
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        h, inter = c.hidden_size, c.intermediate_size
        return cls(c.num_hidden_layers, {
            "q_proj": (h, heads * head_dim), "k_proj": (h, kv_heads * head_dim),
            "v_proj": (h, kv_heads * head_dim), "o_proj": (heads * head_dim, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h),
        })


def expand_targets(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """--lora-target-modules (or an adapter's target_modules) as projection names: `all`,
    the merged names and the PEFT names, in TARGET_MODULES' order; LoraError for others."""
    out: set[str] = set()
    for n in names:
        if n == "all":
            out.update(TARGET_MODULES)
        elif n in MERGED_NAMES:
            out.update(MERGED_NAMES[n])
        elif n in TARGET_MODULES:
            out.add(n)
        else:
            raise LoraError(f"unsupported LoRA target module {n!r}; supported: "
                            f"{', '.join(TARGET_MODULES)} (or qkv_proj, gate_up_proj, all)")
    return tuple(t for t in TARGET_MODULES if t in out)


@dataclass
class LoraAdapter:
    """One adapter on the host: for each (layer, projection) it adapts, A [rank, in] and
    B [out, rank] in float32, B already multiplied by the scaling."""

    name: str
    path: str
    rank: int
    scaling: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @classmethod
    def load(cls, name: str, path: str, base: BaseShapes, max_rank: int | None,
             served_targets: tuple[str, ...] | None) -> "LoraAdapter":
        """Read and check an adapter. `max_rank` / `served_targets`: the server's limits
        (None: no limit, when the server takes its limits from its first adapters)."""
        config = _read_config(path)
        rank = config.get("r")
        if not isinstance(rank, int) or rank <= 0:
            raise LoraError(f"adapter {name!r}: adapter_config.json has no positive rank `r`")
        if max_rank is not None and rank > max_rank:
            raise LoraError(f"adapter {name!r} has rank {rank}, over the server's "
                            f"--max-lora-rank {max_rank}")
        unsupported = {"use_dora": bool(config.get("use_dora")),
                       "modules_to_save": bool(config.get("modules_to_save")),
                       "bias": config.get("bias", "none") != "none"}
        for option, bad in unsupported.items():
            if bad:
                raise LoraError(f"adapter {name!r}: {option}={config[option]!r} is not "
                                "supported")
        if config.get("layers_to_transform") is not None or config.get("rank_pattern") or \
                config.get("alpha_pattern"):
            raise LoraError(f"adapter {name!r}: per-layer ranks, alphas or layer lists "
                            "(rank_pattern, alpha_pattern, layers_to_transform) are not supported")
        alpha = config.get("lora_alpha", rank)
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        tensors = _read_tensors(name, path)
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, t in tensors.items():
            m = _KEY.search(key)
            if m is None:
                raise LoraError(f"adapter {name!r}: unsupported tensor {key!r} (srt adapts "
                                f"the projections {', '.join(TARGET_MODULES)} only)")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if module not in TARGET_MODULES and module not in MERGED_NAMES:
                raise LoraError(f"adapter {name!r}: unsupported target module {module!r}")
            if layer >= base.num_layers:
                raise LoraError(f"adapter {name!r}: layer {layer} does not exist (the base "
                                f"model has {base.num_layers})")
            pairs.setdefault((layer, module), {})[ab] = t
        if not pairs:
            raise LoraError(f"adapter {name!r}: no LoRA weights in the file")
        targets = expand_targets(sorted({m for _, m in pairs}))
        if served_targets is not None:
            extra = [t for t in targets if t not in served_targets]
            if extra:
                raise LoraError(f"adapter {name!r} adapts {', '.join(extra)}, not among the "
                                f"server's --lora-target-modules ({', '.join(served_targets)})")
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for (layer, module), ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                raise LoraError(f"adapter {name!r}: layer {layer} {module} lacks lora_"
                                f"{'B' if 'A' in ab else 'A'}")
            a, b = ab["A"].float(), ab["B"].float()
            # a fused checkpoint module (Phi-3's qkv_proj, gate_up_proj): one A for all its
            # parts, B's rows the parts' outputs one after another; B A x splits by those rows
            parts = MERGED_NAMES.get(module, (module,))
            fan_in = base.shapes[parts[0]][0]
            outs = [base.shapes[p][1] for p in parts]
            if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (sum(outs), rank):
                raise LoraError(
                    f"adapter {name!r}: layer {layer} {module} has A {list(a.shape)} and B "
                    f"{list(b.shape)}; the base model needs A [{rank}, {fan_in}] and B "
                    f"[{sum(outs)}, {rank}]")
            for part, b_part in zip(parts, (b * scaling).split(outs)):
                if (layer, part) in weights:
                    raise LoraError(f"adapter {name!r}: layer {layer} adapts {part} twice "
                                    f"(as {part} and in {module})")
                weights[(layer, part)] = (a.contiguous(), b_part.contiguous())
        return cls(name, path, rank, scaling, targets, weights)


def _read_config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise LoraError(f"LoRA adapter path {path!r} is not a directory")
    try:
        with open(file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise LoraError(f"no adapter_config.json in {path!r}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"cannot read {file}: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{file} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{file}: peft_type {peft_type!r} is not LORA")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(file):
        hint = " (only the safetensors layout is read; adapter_model.bin is not)" \
            if os.path.exists(os.path.join(path, "adapter_model.bin")) else ""
        raise LoraError(f"adapter {name!r}: no adapter_model.safetensors in {path!r}{hint}")
    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError) as e:
        raise LoraError(f"adapter {name!r}: cannot read {file}: {e}") from None
