"""Attention through the Triton kernels of `srt.layers.attention.triton_ops`.

PREFILL (no request has a cached prefix): `context_attention_fwd` on this step's contiguous q/k/v.
EXTEND: `extend_attention_fwd`, the prefix read from the pool through req_to_token. A layer with a
sliding window or a logit cap (RadixAttention) takes the extend kernel in PREFILL too, and no
layer of such a model reads a shared prefix once for the batch.
DECODE: `decode_attention_fwd`, split-K over the context, GQA groups in one program; a prefix
that every request of an eager batch shares (`ForwardBatch.shared_prefix_len`) is read once for
the whole batch.

Everything per step (device copies of the lengths, start offsets, the number of KV splits) is
built once in `init_forward_metadata` from the ForwardBatch's host lists; the per-layer calls do no
host sync. The decode workspace is allocated once, at construction.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

from srt.layers.attention import AttentionBackend
from srt.layers.attention.triton_ops import (
    choose_num_kv_splits,
    context_attention_fwd,
    decode_attention_fwd,
    decode_workspace,
    extend_attention_fwd,
)
from srt.layers.attention.triton_ops.decode_attention import (
    DECODE_MAX_KV_SPLITS,
    choose_shared_splits,
    device_num_sms,
)
from srt.layers.attention.triton_ops.decode_config import (DECODE_MLA_PROGRAMS_PER_SM,
                                                           DECODE_PROGRAMS_PER_SM)
from srt.layers.forward_batch import ForwardBatch, ForwardMode
from srt.layers.radix_attention import RadixAttention


@dataclass
class TritonExtendMetadata:
    prefix_lens: torch.Tensor  # [bs] int32, device
    extend_lens: torch.Tensor  # [bs] int32, device
    extend_start_loc: torch.Tensor  # [bs] int32, device
    max_len_extend: int
    # PREFILL graphs: the prefill kernel's programs from these tables (prefill_attention.
    # BlockTables), a grid the lengths do not change; None: from max_len_extend
    block_tables: Any = None


@dataclass
class TritonDecodeMetadata:
    num_kv_splits: int
    shared_len: int = 0  # > 0: positions read once for the whole batch (shared stage)
    shared_splits: int = 0


@dataclass
class TritonMixedMetadata:
    """A mixed step: the first requests' new tokens through the extend kernel, the last
    `decode_tail` requests' single tokens (rows `extend_tokens` on) through the decode kernel."""

    extend: TritonExtendMetadata
    extend_tokens: int
    decode: TritonDecodeMetadata
    # The decode rows' req_to_token rows and context lengths, copied out of the step's tensors
    # so that they start at aligned addresses (Triton specializes on pointer alignment).
    decode_rows: torch.Tensor
    decode_seq_lens: torch.Tensor


# A shared prefix is read once per batch when it saves at least this many token reads per
# layer (the shared stage costs one more launch per layer).
SHARED_PREFIX_MIN_SAVED_TOKENS = 4096


class TritonAttnBackend(AttentionBackend):
    def __init__(self, runner: Any = None, **_: object) -> None:
        if runner is None:
            raise ValueError("TritonAttnBackend needs the model runner")
        config = runner.config
        self.num_kv_heads = int(runner.model_kv_heads())
        self.num_heads = _model_num_heads(runner, config.num_heads)
        # the layers' (multi-head latent attention: the latent's, not the config's head_dim)
        self.head_dim = int(runner.kv_head_dim() if hasattr(runner, "kv_head_dim")
                            else config.head_dim)
        self.device = torch.device(runner.device)
        self.dtype = runner.dtype  # of q and o (the pool may hold FP8)
        self.max_bs = int(runner.max_running_requests)
        layers = runner._attention_layers() if hasattr(runner, "_attention_layers") else []
        # windows read each request's own last positions: no shared-prefix stage (nor for a
        # model with soft-capped layers, which the shared stage is not tested with, nor for
        # heads wider than 256, whose 64-row shared-stage tiles overflow shared memory)
        self.no_shared = any(layer.sliding_window or layer.logit_cap for layer in layers) \
            or self.head_dim > 256
        # latent attention's values: the first v_head_dim channels of its keys (one layout for
        # every layer of a model)
        self.v_head_dim = min((getattr(layer, "v_head_dim", self.head_dim) for layer in layers),
                              default=self.head_dim)
        self.num_sms = device_num_sms(self.device)
        self.max_kv_splits = DECODE_MAX_KV_SPLITS
        # latent attention's programs are larger (all heads over a 576-wide latent)
        self.programs_per_sm = (DECODE_MLA_PROGRAMS_PER_SM if self.v_head_dim > 256
                                else DECODE_PROGRAMS_PER_SM)
        # The flat workspace holds bs * splits partial results; size it for the largest
        # bs * choose_num_kv_splits(bs, ...) any batch up to max_bs can ask for.
        need = max(
            bs * self._splits(bs, 1 << 30) for bs in range(1, self.max_bs + 1)
        )
        # one more split per request for the shared-prefix stage
        self.workspace_splits = -(-need // self.max_bs) + 1
        self.workspace = decode_workspace(
            self.max_bs, self.num_heads, self.head_dim, self.workspace_splits, self.device
        )

    def _splits(self, bs: int, max_seq_len: int) -> int:
        return choose_num_kv_splits(
            bs, self.num_kv_heads, max_seq_len, num_sms=self.num_sms,
            max_splits=self.max_kv_splits, programs_per_sm=self.programs_per_sm)

    # ------------------------------------------------------------------ per step

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        tail = fb.decode_tail if fb.forward_mode == ForwardMode.EXTEND else 0
        if 0 < tail < fb.batch_size:
            n = fb.batch_size - tail
            ext = self._extend_metadata(fb.prefix_lens_cpu[:n], fb.extend_lens_cpu[:n],
                                        fb.req_pool_indices.device)
            longest = max(fb.seq_lens_cpu[n:], default=1)
            fb.attn_metadata = TritonMixedMetadata(
                ext, sum(fb.extend_lens_cpu[:n]),
                TritonDecodeMetadata(num_kv_splits=self._splits(tail, longest)),
                fb.req_pool_indices[n:].clone(), fb.seq_lens[n:].clone())
        elif fb.forward_mode.is_extend():
            fb.attn_metadata = self._extend_metadata(fb.prefix_lens_cpu, fb.extend_lens_cpu,
                                                     fb.req_pool_indices.device)
        else:
            fb.attn_metadata = self._decode_metadata(fb)

    def _extend_metadata(self, prefix_lens: list[int], extend_lens: list[int],
                         device: torch.device) -> TritonExtendMetadata:
        prefix = list(prefix_lens)
        extend = list(extend_lens)
        starts = [0, *accumulate(extend)][:-1]
        # One host->device copy for the three per-request vectors, each row padded to 32
        # entries (128 bytes): Triton specializes kernels on the 16-byte alignment of every
        # pointer, so unpadded rows compiled new variants for each batch size mod 4.
        pad = [0] * (-len(prefix) % 32)
        packed = torch.tensor([prefix + pad, extend + pad, starts + pad], dtype=torch.int32)
        packed = packed.to(device, non_blocking=True)
        bs = len(prefix)
        return TritonExtendMetadata(
            prefix_lens=packed[0, :bs],
            extend_lens=packed[1, :bs],
            extend_start_loc=packed[2, :bs],
            max_len_extend=max(extend, default=0),
        )

    def _decode_metadata(self, fb: ForwardBatch) -> TritonDecodeMetadata:
        bs, shared = fb.batch_size, fb.shared_prefix_len
        longest = max(fb.seq_lens_cpu, default=1)
        if (shared <= 0 or (bs - 1) * shared < SHARED_PREFIX_MIN_SAVED_TOKENS
                or self.no_shared):
            return TritonDecodeMetadata(num_kv_splits=self._splits(bs, longest))
        splits = self._splits(bs, longest - shared)
        # what the workspace holds at this batch size, less stage 1's splits
        room = self.workspace.numel() // (bs * self.num_heads * (self.head_dim + 1)) - splits
        shared_splits = max(0, min(room, choose_shared_splits(
            bs, self.num_heads // self.num_kv_heads, self.num_kv_heads, shared,
            num_sms=self.num_sms, max_splits=self.max_kv_splits)))
        if shared_splits == 0:
            return TritonDecodeMetadata(num_kv_splits=self._splits(bs, longest))
        return TritonDecodeMetadata(splits, shared, shared_splits)

    def warm_up_eager_decode(self, req_to_token: torch.Tensor, k_buf: torch.Tensor,
                             v_buf: torch.Tensor) -> None:
        """Compile the decode kernels of eager steps (batches larger than the captured graphs,
        with and without the shared-prefix stage) now rather than inside a user's step. Reads
        row 0 of `req_to_token` (any slot ids are valid there) and writes only scratch."""
        bs, h, hkv, d = 2, self.num_heads, self.num_kv_heads, self.head_dim
        # q as the model passes it: a view of the fused qkv projection
        qkv = torch.zeros(bs, (h + 2 * hkv) * d, dtype=self.dtype, device=self.device)
        q = qkv[:, : h * d].view(bs, h, d)
        o = torch.empty(q.shape, dtype=q.dtype, device=self.device)
        rows = torch.zeros(bs, dtype=torch.int64, device=self.device)
        seq_lens = torch.full((bs,), 2, dtype=torch.int64, device=self.device)
        for shared in (0,) if self.no_shared else (0, 1):
            decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rows, seq_lens, d**-0.5, 1,
                                 self.workspace, shared_len=shared, shared_splits=shared,
                                 v_head_dim=self.v_head_dim)

    # ------------------------------------------------------------------ CUDA graphs

    supports_cuda_graph = True
    supports_shared_prefix = True  # reads ForwardBatch.shared_prefix_len in eager DECODE
    supports_decode_tail = True  # a mixed step's decode rows go through the decode kernel
    # DECODE steps read each row's length from the device; seq_lens_cpu may be an upper bound
    # (chained verification steps know no more on the host)
    device_lengths = True

    def init_cuda_graph_capture(self, fb: ForwardBatch) -> None:
        # The split count is baked into the graph: take the one for the longest context, so any
        # context fits (splits past its end are empty and cost one early return each).
        fb.attn_metadata = TritonDecodeMetadata(num_kv_splits=self._splits(fb.batch_size, 1 << 30))

    def init_cuda_graph_replay(self, fb: ForwardBatch) -> None:
        # Lengths and rows are read from the graph's static input tensors; nothing to refresh.
        self.init_cuda_graph_capture(fb)

    # ------------------------------------------------------------------ per layer

    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        meta = fb.attn_metadata
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if isinstance(meta, TritonMixedMetadata):  # extends, then the decode rows
            t = meta.extend_tokens
            k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
            extend_attention_fwd(
                q[:t], k[:t], v[:t], o[:t], k_buf, v_buf, fb.req_to_token_pool.req_to_token,
                fb.req_pool_indices, meta.extend.prefix_lens, meta.extend.extend_lens,
                meta.extend.extend_start_loc, meta.extend.max_len_extend, layer.scaling,
                k_scale=layer.k_scale, v_scale=layer.v_scale,
                sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
            )
            decode_attention_fwd(
                q[t:], k_buf, v_buf, o[t:], fb.req_to_token_pool.req_to_token,
                meta.decode_rows, meta.decode_seq_lens, layer.scaling,
                meta.decode.num_kv_splits, self.workspace,
                k_scale=layer.k_scale, v_scale=layer.v_scale,
                sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
                v_head_dim=layer.v_head_dim,
            )
            return o
        plain = not (layer.sliding_window or layer.logit_cap)
        if fb.forward_mode == ForwardMode.PREFILL and plain:
            context_attention_fwd(
                q, k, v, o, meta.extend_start_loc, meta.extend_lens, meta.max_len_extend,
                layer.scaling, block_tables=meta.block_tables,
            )
        else:
            k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
            extend_attention_fwd(
                q, k, v, o, k_buf, v_buf, fb.req_to_token_pool.req_to_token,
                fb.req_pool_indices, meta.prefix_lens, meta.extend_lens, meta.extend_start_loc,
                meta.max_len_extend, layer.scaling, k_scale=layer.k_scale, v_scale=layer.v_scale,
                sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
            )
        return o

    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        meta: TritonDecodeMetadata = fb.attn_metadata
        k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        decode_attention_fwd(
            q, k_buf, v_buf, o, fb.req_to_token_pool.req_to_token, fb.req_pool_indices,
            fb.seq_lens, layer.scaling, meta.num_kv_splits, self.workspace,
            shared_len=meta.shared_len, shared_splits=meta.shared_splits,
            k_scale=layer.k_scale, v_scale=layer.v_scale,
            sliding_window=layer.sliding_window, logit_cap=layer.logit_cap,
            v_head_dim=layer.v_head_dim,
        )
        return o


def _model_num_heads(runner: Any, default: int) -> int:
    """Query heads of this rank's attention layers (the config's count for tp 1)."""
    per_rank = getattr(runner, "num_heads_per_rank", None)
    if callable(per_rank):
        return int(per_rank())
    try:
        return int(runner.model.model.layers[0].self_attn.num_heads)
    except AttributeError:
        return int(default)
