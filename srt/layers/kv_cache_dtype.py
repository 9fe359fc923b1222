"""The KV cache's storage dtype (`--kv-cache-dtype`) and its per-tensor scales.

`auto` stores K and V in the model dtype. `fp8_e4m3` / `fp8_e5m2` store one byte per value: a
layer writes `round_fp8(clamp(k / k_scale))` and every reader computes with `stored * k_scale`
(the same for V), where `k_scale` / `v_scale` are one float per layer (`RadixAttention.k_scale`,
`v_scale`): the checkpoint's `self_attn.k_scale` / `v_scale` when it has them, else 1.0. This
step's own K/V may be attended to before or after the rounding, by backend (the Triton prefill
and extend kernels use this step's values as computed; the torch backend reads them back from
the pool, and so does FlashInfer); either way the cache holds the rounded values that later
steps read. Every backend takes an FP8 pool; `auto` then stays on Triton for both steps.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8": torch.float8_e4m3fn,  # vLLM's spelling
}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's storage dtype for `--kv-cache-dtype name`."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown --kv-cache-dtype {name!r}: auto, {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in KV_CACHE_DTYPES.values()


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to `dtype` (computed in float32, clamped to the format's range so
    that no value overflows to NaN)."""
    m = fp8_max(dtype)
    return (x.float() / scale).clamp(-m, m).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored values back in `dtype`: x * scale, computed in float32. Identity (no copy) when
    the cache is in `dtype` already."""
    if x.dtype == dtype:
        return x
    return (x.float() * scale).to(dtype)


def store_kv(buf: torch.Tensor, loc: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """buf[loc] = x, quantized when buf holds FP8."""
    buf[loc] = quantize_kv(x, scale, buf.dtype) if is_fp8(buf.dtype) else x
