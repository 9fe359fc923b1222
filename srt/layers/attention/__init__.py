"""Attention backends, chosen by `--attention-backend` and imported lazily by name.

Contract of a backend: `init_forward_metadata(fb)` runs once per step (not per layer) and may
store what it derives in `fb.attn_metadata`; `forward_extend` / `forward_decode` compute attention
for one layer after `RadixAttention` has written this step's K/V into the pool at
`fb.out_cache_loc`. Queries are `[tokens, heads, head_dim]`; the result has the same shape. A backend
never changes the pools' bookkeeping and never touches the radix tree.

Mixed steps: a backend with `supports_decode_tail` reads `fb.decode_tail` in EXTEND (the last
requests of the batch are single decode tokens) and may compute those rows with its decode
kernel; the others ignore it and treat them as extends of one token.

CUDA graphs (DECODE only): `init_cuda_graph_capture(fb)` replaces `init_forward_metadata` while a
graph of batch size `fb.batch_size` is captured, and `init_cuda_graph_replay(fb)` before each
replay; whatever the captured kernels read must then live in buffers whose addresses never change,
refreshed in place by the replay hook. A backend without these hooks runs without graphs.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from srt.layers.forward_batch import ForwardBatch
    from srt.layers.radix_attention import RadixAttention

# name -> "module:Class"; heavy dependencies are imported only when the backend is chosen.
_BACKENDS: dict[str, str] = {
    "torch": "srt.layers.attention.torch_backend:TorchAttnBackend",
    "triton": "srt.layers.attention.triton_backend:TritonAttnBackend",
    "flashinfer": "srt.layers.attention.flashinfer_backend:FlashInferAttnBackend",
}


class AttentionBackend:
    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        """Per-step preparation shared by all layers."""

    supports_cuda_graph = False
    supports_decode_tail = False

    def init_cuda_graph_capture(self, fb: "ForwardBatch") -> None:
        raise NotImplementedError

    def init_cuda_graph_replay(self, fb: "ForwardBatch") -> None:
        raise NotImplementedError

    def forward_extend(
        self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", layer: "RadixAttention",
        fb: "ForwardBatch",
    ) -> "torch.Tensor":
        raise NotImplementedError

    def forward_decode(
        self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", layer: "RadixAttention",
        fb: "ForwardBatch",
    ) -> "torch.Tensor":
        raise NotImplementedError


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def resolve_backend_name(name: str, device_type: str) -> str:
    """`auto` -> triton on a GPU (flashinfer where Triton is missing); torch on the CPU.

    Triton is the default on a GPU because decode dominates serving and its decode kernels
    measured faster on an H200: 7 vs 18 us per layer at batch 1 (5.25 vs 6.25 ms per token on
    the Llama-3-8B shape) and 83% vs 58% of copy bandwidth at batch 64 x 2048; FlashInfer's
    extend is faster (Triton takes 1.5x its time), so `flashinfer` stays a choice.

    An explicit choice that cannot work here is a clear error at start-up. triton on the CPU runs
    in Triton's interpreter (correct but slow: for tests).
    """
    if name == "auto":
        if device_type != "cuda":
            return "torch"
        if _importable("triton"):
            return "triton"
        return "flashinfer" if _importable("flashinfer") else "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {', '.join(available_backends())}"
        )
    if name == "flashinfer":
        if device_type != "cuda":
            raise ValueError("--attention-backend flashinfer needs a CUDA GPU")
        if not _importable("flashinfer"):
            raise ValueError("--attention-backend flashinfer needs flashinfer-python installed")
    if name == "triton" and not _importable("triton"):
        raise ValueError("--attention-backend triton needs triton installed")
    return name


def create_attention_backend(name: str, **kwargs: Any) -> AttentionBackend:
    module, cls = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


def resolve_step_backends(attention: str, prefill: str | None, decode: str | None,
                          device_type: str, fp8_kv: bool = False,
                          triton_only: bool = False) -> tuple[str, str]:
    """(EXTEND/PREFILL backend, DECODE backend) from --attention-backend and the per-step
    overrides (None: follow --attention-backend).

    `auto` on a GPU with FlashInfer installed pairs FlashInfer's prefill with Triton's decode:
    on one H200 (Llama-3-8B heads, bf16, page size 1) FlashInfer's prefill (FlashAttention-3
    kernels) computed 8,192 new tokens over a 21,808-token prefix in 6.0 ms against Triton's
    8.9 ms, and a fresh 8,192-token prompt in 1.1 ms against 1.3 ms, while Triton's decode
    stays the faster one (see resolve_backend_name).

    Every backend takes an FP8 KV cache (`fp8_kv`), but there `auto` stays on Triton for both
    steps: FlashInfer has no FA3 kernel for it, and its FA2 prefill filled W1's 142,824 prompt
    tokens in 2.31 s against Triton's 2.24 s (one H200, Llama-3-8B shape, FP8 weights).
    `triton_only`: the model has layers FlashInfer does not take (sliding windows, soft-capped
    scores, shared latent KV: `RadixAttention.flashinfer_supported`), so `auto` stays on Triton.
    """
    base = resolve_backend_name(attention, device_type)
    step_prefill = resolve_backend_name(prefill, device_type) if prefill else base
    step_decode = resolve_backend_name(decode, device_type) if decode else base
    if (attention == "auto" and prefill is None and device_type == "cuda" and base == "triton"
            and _importable("flashinfer") and not fp8_kv and not triton_only):
        step_prefill = "flashinfer"
    return step_prefill, step_decode


def create_step_backends(prefill: str, decode: str, **kwargs: Any) -> AttentionBackend:
    """One backend when both steps use the same, else a HybridAttnBackend of the two."""
    if prefill == decode:
        return create_attention_backend(prefill, **kwargs)
    from srt.layers.attention.hybrid_backend import HybridAttnBackend

    return HybridAttnBackend(create_attention_backend(prefill, **kwargs),
                             create_attention_backend(decode, **kwargs))
