"""CUDA graphs for PREFILL steps: fills of new prompts replay a graph of a bucketed token count.

An eager fill of a model with many small kernels a layer is bound by the host: Qwen3-30B-A3B's
48 layers launch about 580 Triton kernels and 145 GEMMs, which on one H100's host took 50-100 ms
for 37 ms of GPU work, once per fill round. A graph replays them in one launch.

Contract: graphs are captured for the token counts of `capture_token_counts(max_tokens)`; a
PREFILL step (no request has a cached prefix) of n tokens in k <= `max_requests` requests
replays the graph of the smallest count T >= n. Its rows n..T-1 are a dummy request (token 0 at
position 0, KV written to the pool's padding slot) whose logits are dropped; the k requests'
lengths, start rows, the rows whose logits are returned (`ForwardBatch.sample_rows`) and the
attention kernel's block tables (`BlockTables`: the grid fixed by T and max_requests, not by
the lengths) are copied into static buffers. Not taken: EXTEND and mixed steps, prompt
logprobs, images, LoRA adapters, more than `max_requests` requests or more than the largest
count of tokens; such steps run eagerly. Replayed logits live in one buffer all the graphs
write, valid until the next replay of any of them. On the CPU, with the flag set, nothing is
captured and the same padded steps run eagerly (how the tests check the padding).

Only the Triton attention backend runs it (its PREFILL kernel takes block tables), and only for
models whose layers have no sliding window or logit cap (those take the extend kernel).

Off by default (`--prefill-graph-max-tokens 0`). On one H100 (Qwen3-30B-A3B shape, W1, same
machine start) the fills of 81 rounds took 5.60 s against 6.00 s eager (the run's first, eager
8,192-token fill aside, which compiled the eager prefill kernel then: the start-up's warm-up
fills now run eagerly), while capturing 11 sizes lengthened the start by up to 12 s: inside W1
most of an eager fill's host time overlaps the decode step before it. Fills that follow no
decode step (a server with little load: time to first token) were not measured.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from srt.layers.attention.triton_backend import TritonAttnBackend, TritonExtendMetadata
from srt.layers.attention.triton_ops.prefill_attention import BlockTables
from srt.layers.forward_batch import ForwardBatch, ForwardMode, forward_context

logger = logging.getLogger(__name__)

# Requests one graph's fill may hold (the block tables and sampled rows are sized by it).
MAX_REQUESTS = 64


def capture_token_counts(max_tokens: int) -> list[int]:
    """512 to 2048 by 256, then by 512, up to max_tokens (and max_tokens itself): a fill is
    padded by at most a quarter of its tokens (fills of up to 256 tokens mostly run as decode
    rows: srt.model_process.graph_fill)."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    counts = [t for t in [*range(512, 2048, 256), *range(2048, max_tokens + 1, 512)]
              if t <= max_tokens]
    if not counts or counts[-1] != max_tokens:
        counts.append(max_tokens)
    return counts


def supported(runner: Any) -> bool:
    """Whether the runner's backend and layers can replay PREFILL graphs."""
    backend = runner.attn_backend
    if type(backend) is not TritonAttnBackend:
        return False
    return not any(layer.sliding_window or layer.logit_cap
                   for layer in runner._attention_layers())


class PrefillGraphRunner:
    def __init__(self, runner: Any, max_tokens: int,
                 model_forward: Callable[[ForwardBatch], torch.Tensor],
                 max_requests: int = MAX_REQUESTS, replay: bool = True) -> None:
        """`replay=False`: nothing is captured and `run` computes the same padded static
        batch eagerly (on the CPU, where the tests check the padding)."""
        self.runner = runner
        self.replay = replay
        self.model_forward = model_forward
        self.sizes = capture_token_counts(max_tokens)
        self.max_tokens = self.sizes[-1]
        self.max_requests = max_requests
        dev = runner.device
        n, r = self.max_tokens, max_requests + 1  # (+ the dummy request of the padding)
        self.pad_slot = runner.token_to_kv_pool.size  # never handed out
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.full((n,), self.pad_slot, dtype=torch.int64, device=dev)
        # rows: lengths, start rows, sampled rows (the first max_requests entries)
        self.meta = torch.zeros(3, r, dtype=torch.int32, device=dev)
        self.zeros = torch.zeros(r, dtype=torch.int32, device=dev)  # prefix lengths
        self.rows = torch.zeros(r, dtype=torch.int64, device=dev)  # req_to_token rows
        self.tables = {t: BlockTables(t, r, dev) for t in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # every graph copies its logits here: one [max_requests, vocab] buffer kept, not one a
        # graph (Qwen3's vocabulary: 39 MB each)
        self.logits: torch.Tensor | None = None
        self.replays = 0

    def _host_meta(self, extend_lens: list[int], tokens: int) -> tuple[list[int], torch.Tensor]:
        """The lengths of the `tokens`-row graph's requests (the dummy one last, when rows are
        left) and the packed [3, max_requests + 1] lengths / starts / sampled rows."""
        used = sum(extend_lens)
        lens = list(extend_lens) + ([tokens - used] if tokens > used else [])
        r = self.max_requests + 1
        starts, at = [], 0
        for n in lens:
            starts.append(at)
            at += n
        sample = [s + n - 1 for s, n in zip(starts, extend_lens)]
        pad = [0] * (r - len(lens))
        packed = torch.tensor([lens + pad, starts + pad,
                               sample + [0] * (r - len(sample))], dtype=torch.int32)
        return lens, packed

    def _static_batch(self, tokens: int, lens: list[int]) -> ForwardBatch:
        r = self.max_requests + 1
        fb = ForwardBatch(
            forward_mode=ForwardMode.PREFILL,
            batch_size=r,
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            out_cache_loc=self.out_cache_loc[:tokens],
            req_pool_indices=self.rows,
            seq_lens=self.meta[0],
            seq_lens_cpu=lens + [0] * (r - len(lens)),
            prefix_lens_cpu=[0] * r,
            extend_lens_cpu=lens + [0] * (r - len(lens)),
            req_to_token_pool=self.runner.req_to_token_pool,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            attn_backend=self.runner.attn_backend,
            sample_rows=self.meta[2, : self.max_requests],
        )
        fb.attn_metadata = TritonExtendMetadata(
            prefix_lens=self.zeros, extend_lens=self.meta[0], extend_start_loc=self.meta[1],
            max_len_extend=tokens, block_tables=self.tables[tokens])
        return fb

    def _load(self, tokens: int, extend_lens: list[int]) -> ForwardBatch:
        """The static inputs of the `tokens`-row graph set for requests of `extend_lens` (the
        token buffers' padding included); its ForwardBatch."""
        lens, packed = self._host_meta(extend_lens, tokens)
        self.meta.copy_(packed, non_blocking=True)
        self.tables[tokens].fill(lens)
        return self._static_batch(tokens, lens)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> Any:
        """Capture every count, largest first, in `pool` (a graph memory pool to share: the
        decode graphs'); returns the pool."""
        start = time.monotonic()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        for tokens in reversed(self.sizes):
            fb = self._load(tokens, [tokens])
            with forward_context(fb), torch.cuda.stream(stream):
                for _ in range(2):  # warm up: compiles and lazy buffers stay out of the graph
                    out = self.model_forward(fb)
                if self.logits is None:
                    self.logits = torch.empty_like(out)
                stream.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.logits.copy_(self.model_forward(fb))
            pool = graph.pool()
            self.graphs[tokens] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize(self.runner.device)
        logger.info("captured CUDA graphs for %d prefill sizes (%d..%d tokens, up to %d "
                    "requests) in %.1f s", len(self.sizes), self.sizes[0], self.max_tokens,
                    self.max_requests, time.monotonic() - start)
        return pool

    def bucket(self, tokens: int) -> int:
        """The smallest captured count that holds `tokens` rows."""
        for t in self.sizes:
            if t >= tokens:
                return t
        raise ValueError(f"{tokens} tokens exceed the largest prefill graph ({self.max_tokens})")

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.forward_mode == ForwardMode.PREFILL and not fb.decode_tail
                and fb.prompt_logprobs is None and not fb.images and fb.lora is None
                and fb.spec_hidden is None and fb.batch_size <= self.max_requests
                and fb.input_ids.shape[0] <= self.max_tokens)

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """The logits [batch, vocab] of `fb` (a PREFILL step `can_run` takes) from the graph of
        its bucket (without graphs, `replay=False`: the same padded batch run eagerly)."""
        n = fb.input_ids.shape[0]
        tokens = self.bucket(n)
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.out_cache_loc[:n].copy_(fb.out_cache_loc)
        if tokens > n:
            self.input_ids[n:tokens].zero_()
            self.positions[n:tokens].zero_()
            self.out_cache_loc[n:tokens].fill_(self.pad_slot)
        static = self._load(tokens, list(fb.extend_lens_cpu))
        self.replays += 1
        if self.replay:
            self.graphs[tokens].replay()
            out = self.logits
        else:
            with forward_context(static):
                out = self.model_forward(static)
        return out[: fb.batch_size]
