"""One backend for EXTEND / PREFILL steps, another for DECODE steps.

`--prefill-attention-backend` and `--decode-attention-backend` (SGLang's flags) pick them; on a
GPU with FlashInfer installed, `auto` pairs FlashInfer's prefill (its FlashAttention-3 kernels
on Hopper: about 1.4x the Triton extend kernel's rate at long contexts, measured on one H200)
with Triton's decode (faster at small batches). Both backends read and write the same KV pool;
each plans only the steps it runs.

A mixed step (`fb.decode_tail` > 0: running requests' single tokens riding in a fill step) is
split in two batches over the same pool: the extends go to the prefill backend, the decode rows
to the decode backend as an eager DECODE batch, each planned by its own backend. CUDA graphs,
the shared-prefix decode stage and the eager-decode warm-up are the decode backend's.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from srt.layers.attention import AttentionBackend
from srt.layers.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention


@dataclasses.dataclass
class HybridMixedMetadata:
    """A mixed step split for the two backends: `extend` holds the first requests (their
    `extend_tokens` rows of q), `decode` the decode rows after them."""

    extend: ForwardBatch
    decode: ForwardBatch
    extend_tokens: int


def split_mixed(fb: ForwardBatch) -> HybridMixedMetadata:
    """The extend requests and the decode tail of a mixed step as two ForwardBatches (views of
    the step's tensors; neither carries prompt logprobs or images, which only the model reads)."""
    n = fb.batch_size - fb.decode_tail
    t = sum(fb.extend_lens_cpu[:n])
    common = dict(attn_metadata=None, prompt_logprobs=None, images=None, decode_tail=0,
                  shared_prefix_len=0)
    ext = dataclasses.replace(
        fb, batch_size=n, input_ids=fb.input_ids[:t], positions=fb.positions[:t],
        out_cache_loc=fb.out_cache_loc[:t], req_pool_indices=fb.req_pool_indices[:n],
        seq_lens=fb.seq_lens[:n], seq_lens_cpu=fb.seq_lens_cpu[:n],
        prefix_lens_cpu=fb.prefix_lens_cpu[:n], extend_lens_cpu=fb.extend_lens_cpu[:n],
        **common)
    dec = dataclasses.replace(
        fb, forward_mode=ForwardMode.DECODE, batch_size=fb.decode_tail,
        input_ids=fb.input_ids[t:], positions=fb.positions[t:], out_cache_loc=fb.out_cache_loc[t:],
        req_pool_indices=fb.req_pool_indices[n:], seq_lens=fb.seq_lens[n:],
        seq_lens_cpu=fb.seq_lens_cpu[n:], prefix_lens_cpu=fb.prefix_lens_cpu[n:],
        extend_lens_cpu=fb.extend_lens_cpu[n:], **common)
    return HybridMixedMetadata(ext, dec, t)


class HybridAttnBackend(AttentionBackend):
    supports_decode_tail = True

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.supports_cuda_graph = decode.supports_cuda_graph
        self.supports_shared_prefix = getattr(decode, "supports_shared_prefix", False)
        self.device_lengths = getattr(decode, "device_lengths", False)

    def init_forward_metadata(self, fb: "ForwardBatch") -> None:
        if fb.forward_mode == ForwardMode.EXTEND and 0 < fb.decode_tail < fb.batch_size:
            meta = split_mixed(fb)
            self.prefill_backend.init_forward_metadata(meta.extend)
            self.decode_backend.init_forward_metadata(meta.decode)
            fb.attn_metadata = meta
        elif fb.forward_mode.is_extend():
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
        meta = fb.attn_metadata
        if isinstance(meta, HybridMixedMetadata):
            t = meta.extend_tokens
            return torch.cat([
                self.prefill_backend.forward_extend(q[:t], k[:t], v[:t], layer, meta.extend),
                self.decode_backend.forward_decode(q[t:], k[t:], v[t:], layer, meta.decode)])
        return self.prefill_backend.forward_extend(q, k, v, layer, fb)

    def forward_decode(self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor",
                       layer: "RadixAttention", fb: "ForwardBatch") -> "torch.Tensor":
        return self.decode_backend.forward_decode(q, k, v, layer, fb)
