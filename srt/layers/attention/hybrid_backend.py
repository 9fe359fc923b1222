"""One backend for EXTEND / PREFILL steps, another for DECODE steps.

`--prefill-attention-backend` and `--decode-attention-backend` (SGLang's flags) pick them; on a
GPU with FlashInfer installed, `auto` pairs FlashInfer's prefill (its FlashAttention-3 kernels
on Hopper: about 1.4x the Triton extend kernel's rate at long contexts, measured on one H200)
with Triton's decode (faster at small batches). Both backends read and write the same KV pool;
each plans only the steps it runs.

A mixed step's decode rows go through the prefill backend as one-token extends (no decode tail:
the decode backend holds no plan for an EXTEND step). CUDA graphs, the shared-prefix decode
stage and the eager-decode warm-up are the decode backend's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from srt.layers.attention import AttentionBackend

if TYPE_CHECKING:
    import torch

    from srt.layers.forward_batch import ForwardBatch
    from srt.layers.radix_attention import RadixAttention


class HybridAttnBackend(AttentionBackend):
    supports_decode_tail = False

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.supports_shared_prefix = getattr(decode, "supports_shared_prefix", False)

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if fb.forward_mode.is_extend():
            self.prefill_backend.init_forward_metadata(fb)
        else:
            self.decode_backend.init_forward_metadata(fb)

    def init_cuda_graph_capture(self, fb: "ForwardBatch") -> None:
        self.decode_backend.init_cuda_graph_capture(fb)

    def init_cuda_graph_replay(self, fb: "ForwardBatch") -> None:
        self.decode_backend.init_cuda_graph_replay(fb)

    def warm_up_eager_decode(self, *args: Any) -> None:
        warm = getattr(self.decode_backend, "warm_up_eager_decode", None)
        if warm is not None:
            warm(*args)

    def forward_extend(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                       layer: "RadixAttention", fb: "ForwardBatch") -> "torch.Tensor":
        return self.prefill_backend.forward_extend(q, k, v, layer, fb)

    def forward_decode(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                       layer: "RadixAttention", fb: "ForwardBatch") -> "torch.Tensor":
        return self.decode_backend.forward_decode(q, k, v, layer, fb)
