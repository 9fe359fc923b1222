"""FlashInfer attention over the page-size-1 KV pool (GPU only, imported only when chosen).

Page size 1 makes the pool a paged KV cache whose pages are single tokens: a request's page list
is its `req_to_token` row. The index arrays are built once per step (not per layer) in
`init_forward_metadata`, which also plans the wrapper once; every layer then only runs it. The
workspace is allocated once at start-up. PREFILL and EXTEND both go through the paged prefill
wrapper: this step's K/V are already in the pool, and FlashInfer's causal mask is aligned to the
end of each request's KV, which is exactly "causal within the new part, all of the prefix".

An FP8 pool (`--kv-cache-dtype fp8_e4m3 / fp8_e5m2`): the wrappers are planned with the pool's
dtype for K/V and the model dtype for queries, and each layer's per-tensor `k_scale` / `v_scale`
go to `run` as Python floats (FlashInfer folds k_scale into the softmax scale and multiplies the
output by v_scale; a tensor there would be read back to the host, which graph capture forbids).
Prefill uses FlashInfer's FA2 kernels then: its `auto` picks FA3 on Hopper, which has no kernel
for half-precision queries over an FP8 cache.
"""

from __future__ import annotations

from typing import Any

import torch

from srt.layers.attention import AttentionBackend
from srt.layers.forward_batch import ForwardBatch
from srt.layers.radix_attention import RadixAttention

WORKSPACE_BYTES = 256 * 1024 * 1024


def build_kv_indices(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_indptr [bs + 1], kv_indices [sum seq_lens]) int32 from the requests' rows, without a
    device sync: the total length is known on the host."""
    dev = fb.seq_lens.device
    lens_cpu = torch.tensor(fb.seq_lens_cpu, dtype=torch.int64)
    indptr_cpu = torch.zeros(fb.batch_size + 1, dtype=torch.int64)
    torch.cumsum(lens_cpu, 0, out=indptr_cpu[1:])
    total = int(indptr_cpu[-1])
    indptr = indptr_cpu.to(dev, non_blocking=True)
    lens = fb.seq_lens.to(torch.int64)
    rows = torch.repeat_interleave(fb.req_pool_indices.to(torch.int64), lens, output_size=total)
    starts = torch.repeat_interleave(indptr[:-1], lens, output_size=total)
    cols = torch.arange(total, device=dev) - starts
    indices = fb.req_to_token_pool.req_to_token[rows, cols]
    return indptr.to(torch.int32), indices.to(torch.int32)


def refuse_windows_and_caps(architecture: str, layers: list[RadixAttention]) -> None:
    """A model with layers the wrappers cannot take (`RadixAttention.flashinfer_supported`:
    sliding windows, soft-capped scores, shared latent KV) is refused at start-up."""
    if not all(layer.flashinfer_supported for layer in layers):
        raise ValueError(f"{architecture} has sliding-window, soft-capped or latent attention "
                         "layers, which the flashinfer backend does not implement here: use "
                         "--attention-backend triton (the default on a GPU)")


class FlashInferAttnBackend(AttentionBackend):
    def __init__(self, runner: Any, decode_tensor_cores: bool | None = None, **_: Any) -> None:
        if runner.device.type != "cuda":
            raise RuntimeError("the flashinfer attention backend needs a CUDA GPU")
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(
                "the flashinfer attention backend needs flashinfer-python "
                "(pip install 'srt[gpu]'); or use --attention-backend triton"
            ) from e
        self.device = runner.device
        self.dtype = runner.dtype
        refuse_windows_and_caps(runner.config.architecture,
                                getattr(runner, "_attention_layers", lambda: [])())
        self.num_heads = runner.num_heads_per_rank()
        self.num_kv_heads = runner.model_kv_heads()
        self.head_dim = runner.config.head_dim
        self.sm_scale = runner.attn_scaling()
        self.kv_dtype: torch.dtype = getattr(runner, "kv_cache_dtype", self.dtype)
        self.fp8_kv = self.kv_dtype.itemsize == 1
        # FA3 (FlashInfer's choice on Hopper) has no half-precision-query / FP8-cache kernel
        self.kernel_backend = "fa2" if self.fp8_kv else "auto"
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", backend=self.kernel_backend)
        # Measured on one H200 (page size 1, 32/8 heads, d 128, bf16): the CUDA-core decode
        # kernel beat the tensor-core one at every batch and context of the benchmark.
        if decode_tensor_cores is None:
            decode_tensor_cores = False
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=decode_tensor_cores,
            backend=self.kernel_backend,
        )
        self.decode_tensor_cores = decode_tensor_cores
        self.last_page_len = torch.ones(
            runner.max_running_requests, dtype=torch.int32, device=self.device
        )
        # CUDA graphs: one decode wrapper per captured batch size, all planning into the same
        # fixed index buffers (graphs replay one at a time). Created on first capture.
        self.max_kv_indices = runner.max_total_num_tokens + runner.max_running_requests + 1
        self.graph_wrappers: dict[int, Any] = {}
        self.graph_indptr: torch.Tensor | None = None
        self.graph_indices: torch.Tensor | None = None

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_extend():
            indptr, indices = build_kv_indices(fb)
            last = self.last_page_len[: fb.batch_size]
            qo_cpu = torch.zeros(fb.batch_size + 1, dtype=torch.int32)
            torch.cumsum(torch.tensor(fb.extend_lens_cpu, dtype=torch.int32), 0, out=qo_cpu[1:])
            self.prefill.plan(
                qo_cpu.to(self.device, non_blocking=True), indptr, indices, last,
                self.num_heads, self.num_kv_heads, self.head_dim, 1,
                causal=True, sm_scale=self.sm_scale,
                q_data_type=self.dtype, kv_data_type=self.kv_dtype,
            )
        else:
            self._plan_decode(self.decode, fb)
            fb.attn_metadata = self.decode

    def _plan_decode(self, wrapper: Any, fb: ForwardBatch) -> None:
        indptr, indices = build_kv_indices(fb)
        wrapper.plan(
            indptr, indices, self.last_page_len[: fb.batch_size], self.num_heads,
            self.num_kv_heads, self.head_dim, 1,
            sm_scale=self.sm_scale, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
        )

    # ------------------------------------------------------------------ CUDA graphs

    supports_cuda_graph = True

    def init_cuda_graph_capture(self, fb: ForwardBatch) -> None:
        import flashinfer

        bs = fb.batch_size
        if self.graph_indptr is None:
            self.graph_indptr = torch.zeros(self.last_page_len.numel() + 1, dtype=torch.int32,
                                            device=self.device)
            self.graph_indices = torch.zeros(self.max_kv_indices, dtype=torch.int32,
                                             device=self.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            use_tensor_cores=self.decode_tensor_cores, backend=self.kernel_backend,
            paged_kv_indptr_buffer=self.graph_indptr[: bs + 1],
            paged_kv_indices_buffer=self.graph_indices,
            paged_kv_last_page_len_buffer=self.last_page_len[:bs],
        )
        self.graph_wrappers[bs] = wrapper
        self._plan_decode(wrapper, fb)
        fb.attn_metadata = wrapper

    def init_cuda_graph_replay(self, fb: ForwardBatch) -> None:
        # plan() copies this step's indptr/indices into the wrapper's fixed buffers.
        wrapper = self.graph_wrappers[fb.batch_size]
        self._plan_decode(wrapper, fb)
        fb.attn_metadata = wrapper

    def _paged(self, fb: ForwardBatch, layer: RadixAttention) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        return k.unsqueeze(1), v.unsqueeze(1)  # [pages, page_size = 1, kv_heads, head_dim]

    def _scales(self, layer: RadixAttention) -> dict[str, float]:
        """The layer's dequantization scales for `run` (none on a model-dtype pool)."""
        if not self.fp8_kv:
            return {}
        return {"k_scale": float(layer.k_scale), "v_scale": float(layer.v_scale)}

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        return self.prefill.run(q.contiguous(), self._paged(fb, layer), **self._scales(layer))

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: RadixAttention, fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_metadata.run(q.contiguous(), self._paged(fb, layer),
                                    **self._scales(layer))
