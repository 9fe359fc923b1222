"""CUDA graphs for DECODE steps: captured once at start-up, replayed for every decode batch.

A decode step of a small batch is bound by kernel launches, not by the GPU: hundreds of small
kernels per step, each a few microseconds of Python and driver work. Capturing the whole forward
(embedding to logits, all-reduces included) once per batch size and replaying it turns that into
one launch.

Contract: graphs are captured for the batch sizes of `capture_batch_sizes`; a batch of size bs
replays the graph of the smallest captured size >= bs, with the extra rows padded (token 0,
position 0, context length 1, KV written to the pool's padding slot, request row 0); their logits
are dropped. Inputs are copied into static buffers whose addresses the graphs captured; the
attention backend refreshes its own metadata in place (`init_cuda_graph_replay`). Replayed logits
live in the graph's output buffer and are valid until the next replay; so do the hidden states
a model keeps for an EAGLE draft (`spec_hidden`), which replay puts back on the model.
With LoRA adapters, every graph computes the adapters' products from static buffers of the rows
grouped by slot (srt.lora.layers.LoraBatchInfo); a batch of no adapter replays with every group
empty.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable

import torch

from srt.layers.forward_batch import ForwardBatch, ForwardMode, forward_context

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_bs, and max_bs itself (so every batch up to it
    has a graph)."""
    if max_bs < 1:
        raise ValueError("max_bs must be >= 1")
    sizes = [s for s in [1, 2, 4, *range(8, max_bs + 1, 8)] if s <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def padded_size(sizes: list[int], bs: int) -> int:
    """The smallest captured size that holds bs rows."""
    for s in sizes:
        if s >= bs:
            return s
    raise ValueError(f"batch size {bs} exceeds the largest captured size {sizes[-1]}")


class CudaGraphRunner:
    def __init__(self, runner: Any, max_bs: int,
                 model_forward: Callable[[ForwardBatch], torch.Tensor]) -> None:
        self.runner = runner
        self.backend = runner.attn_backend
        self.model_forward = model_forward
        self.sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = runner.device
        n = self.max_bs
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pad_slot = runner.token_to_kv_pool.size  # never handed out
        self.out_cache_loc = torch.full((n,), self.pad_slot, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=dev)
        self.lora = None
        if runner.lora is not None:
            from srt.lora.layers import LoraBatchInfo
            from srt.lora.sgmv import block_m_for, max_row_blocks

            slots, block_m = runner.lora.num_slots, block_m_for(n)
            blocks = max_row_blocks(n, slots, block_m)
            self.lora = LoraBatchInfo(
                torch.zeros(n, dtype=torch.int64, device=dev),
                torch.zeros(slots + 1, dtype=torch.int64, device=dev),
                torch.full((blocks,), -1, dtype=torch.int64, device=dev),
                torch.zeros(blocks, dtype=torch.int64, device=dev), block_m, None)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # a model's spec_hidden of each graph
        self.mempool: Any = None

    def load_lora(self, info: Any) -> None:
        """A step's LoRA grouping (srt.lora.layers.LoraBatchInfo; None: no adapter) into the
        graphs' static buffers; the blocks past the step's are padding (slot -1)."""
        lo = self.lora
        lo.block_slot.fill_(-1)
        if info is None:
            return
        if info.block_m != lo.block_m:
            raise ValueError(f"a LoRA table of {info.block_m}-row blocks for graphs of "
                             f"{lo.block_m}")
        nb = info.block_slot.shape[0]
        lo.rows[: info.rows.shape[0]].copy_(info.rows)
        lo.indptr.copy_(info.indptr)
        lo.block_slot[:nb].copy_(info.block_slot)
        lo.block_start[:nb].copy_(info.block_start)

    def _lora_blocks(self, bs: int) -> int:
        """The LoRA block table's length in the graph of `bs` rows."""
        from srt.lora.sgmv import max_row_blocks

        return max_row_blocks(bs, self.runner.lora.num_slots, self.lora.block_m)

    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu,
            prefix_lens_cpu=[s - 1 for s in seq_lens_cpu],
            extend_lens_cpu=[1] * bs,
            req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            attn_backend=self.backend,
            lora=None if self.lora is None else dataclasses.replace(
                self.lora, rows=self.lora.rows[:bs],
                block_slot=self.lora.block_slot[:self._lora_blocks(bs)],
                block_start=self.lora.block_start[:self._lora_blocks(bs)]),
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (smaller graphs reuse the largest one's memory)."""
        start = time.monotonic()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        for bs in reversed(self.sizes):
            fb = self._static_batch(bs, [1] * bs)
            self.backend.init_cuda_graph_capture(fb)
            with forward_context(fb), torch.cuda.stream(stream):
                for _ in range(2):  # warm up: lazy inits and autotuning must not be captured
                    self.model_forward(fb)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.mempool, stream=stream):
                    out = self.model_forward(fb)
            self.mempool = graph.pool()
            self.graphs[bs] = graph
            self.outputs[bs] = out
            hidden = getattr(self.runner.model, "spec_hidden", None)
            if hidden is not None:
                self.hidden[bs] = hidden
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured CUDA graphs for %d decode batch sizes (1..%d) in %.1f s",
                    len(self.sizes), self.max_bs, time.monotonic() - start)

    def can_run(self, fb: ForwardBatch) -> bool:
        return fb.forward_mode == ForwardMode.DECODE and fb.batch_size <= self.max_bs

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """The logits [bs, vocab] of `fb` (a DECODE batch) by replaying a captured graph."""
        bs = fb.batch_size
        pbs = padded_size(self.sizes, bs)
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        if pbs > bs:
            self.input_ids[bs:pbs].zero_()
            self.positions[bs:pbs].zero_()
            self.out_cache_loc[bs:pbs].fill_(self.pad_slot)
            self.req_pool_indices[bs:pbs].zero_()
            self.seq_lens[bs:pbs].fill_(1)
        if self.lora is not None:
            self.load_lora(fb.lora)
        out = self.replay_static(pbs, list(fb.seq_lens_cpu) + [1] * (pbs - bs))
        if pbs in self.hidden:
            self.runner.model.spec_hidden = self.hidden[pbs][:bs]
        return out[:bs]

    def replay_static(self, pbs: int, seq_lens_cpu: list[int]) -> torch.Tensor:
        """Replay the graph of `pbs` rows (a captured size) over what its static inputs hold
        now, every row of it already written (padding too); its logits [pbs, vocab].
        `seq_lens_cpu`: the rows' lengths or upper bounds (what the backend's replay reads)."""
        self.backend.init_cuda_graph_replay(self._static_batch(pbs, seq_lens_cpu))
        self.graphs[pbs].replay()
        return self.outputs[pbs]
