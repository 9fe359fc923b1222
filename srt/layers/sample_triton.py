"""Temperature sampling and argmax of a whole batch in one pass over the logits (GPU; tested on
the CPU in Triton's interpreter).

Sampling from softmax(logits / T) is taking argmax(logits / T + G) with G independent standard
Gumbel noise, -log(-log U) for U uniform: the same distribution as the exponential race of
`srt.layers.sampler` (argmax of p / E, E ~ Exp(1), is argmax of log p - log E, and -log E is
Gumbel), without the softmax, the noise tensor or the division, each a pass over [batch, vocab]
float32 (about 130 MB at batch 256 and a 128k vocabulary; the torch sequence makes seven). The
uniforms come from Philox inside the kernel, keyed by a per-row 64-bit seed and counted by
the token id, so a row's draw depends on its seed only, never on the other rows.

Stage 1, grid (rows, vocab chunks): each program keeps the best sampled score and the largest
logit of its chunk (the first index among equals); stage 2, one program a row, takes the best
chunk (the first among equals, so the greedy id is torch.argmax's) and returns the greedy id
where the row's temperature is 0, the sampled one otherwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # vocabulary entries a stage-1 program covers (32 programs a row at 128k)
BLOCK = 1024  # entries a stage-1 program reads at once


@triton.jit
def _chunk_kernel(logits_ptr, stride_row, temp_ptr, seed_ptr, best_ptr, best_id_ptr,
                  top_ptr, top_id_ptr, vocab, num_chunks,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    inv_t = 1.0 / tl.where(t > 0, t, 1.0)
    seed = tl.load(seed_ptr + row)
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_id = tl.zeros((BLOCK,), tl.int32)
    top = tl.full((BLOCK,), float("-inf"), tl.float32)
    top_id = tl.zeros((BLOCK,), tl.int32)
    lo = chunk * CHUNK
    for start in range(0, CHUNK, BLOCK):
        cols = lo + start + tl.arange(0, BLOCK)
        valid = cols < vocab
        x = tl.load(logits_ptr + row * stride_row + cols, mask=valid,
                    other=float("-inf")).to(tl.float32)
        u = tl.rand(seed, cols)
        # u == 0 gives -inf: never drawn (as E = inf never wins the exponential race)
        score = x * inv_t - tl.log(-tl.log(u))
        score = tl.where(valid, score, float("-inf"))
        # strictly greater: each lane keeps its first index among equal values
        better = score > best
        best = tl.where(better, score, best)
        best_id = tl.where(better, cols, best_id)
        higher = x > top
        top = tl.where(higher, x, top)
        top_id = tl.where(higher, cols, top_id)
    m = tl.max(best, 0)
    m_id = tl.min(tl.where(best == m, best_id, vocab), 0)
    g = tl.max(top, 0)
    g_id = tl.min(tl.where(top == g, top_id, vocab), 0)
    out = row * num_chunks + chunk
    tl.store(best_ptr + out, m)
    tl.store(best_id_ptr + out, tl.minimum(m_id, vocab - 1))  # (NaN logits: still an id)
    tl.store(top_ptr + out, g)
    tl.store(top_id_ptr + out, tl.minimum(g_id, vocab - 1))


@triton.jit
def _pick_kernel(best_ptr, best_id_ptr, top_ptr, top_id_ptr, temp_ptr, out_ptr, num_chunks,
                 CHUNKS: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, CHUNKS)
    valid = offs < num_chunks
    best = tl.load(best_ptr + row * num_chunks + offs, mask=valid, other=float("-inf"))
    top = tl.load(top_ptr + row * num_chunks + offs, mask=valid, other=float("-inf"))
    # the first chunk among equals: its id is the smallest
    b = tl.min(tl.where(best == tl.max(best, 0), offs, CHUNKS), 0)
    g = tl.min(tl.where(top == tl.max(top, 0), offs, CHUNKS), 0)
    sampled = tl.load(best_id_ptr + row * num_chunks + tl.minimum(b, num_chunks - 1))
    greedy = tl.load(top_id_ptr + row * num_chunks + tl.minimum(g, num_chunks - 1))
    t = tl.load(temp_ptr + row)
    tl.store(out_ptr + row, tl.where(t > 0, sampled, greedy).to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  chunk: int = CHUNK) -> torch.Tensor:
    """logits [bs, vocab] (last dim contiguous), temperatures [bs] float32 (0: greedy), seeds
    [bs] int64 (each row's Philox key) -> token ids [bs] int64: argmax(logits) on greedy rows
    (torch.argmax's id among equal logits), a draw from softmax(logits / T) on the others."""
    bs, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block = min(BLOCK, chunk)
    num_chunks = triton.cdiv(vocab, chunk)
    dev = logits.device
    best = torch.empty(bs, num_chunks, dtype=torch.float32, device=dev)
    top = torch.empty_like(best)
    best_id = torch.empty(bs, num_chunks, dtype=torch.int32, device=dev)
    top_id = torch.empty_like(best_id)
    out = torch.empty(bs, dtype=torch.int64, device=dev)
    if bs == 0:
        return out
    _chunk_kernel[(bs, num_chunks)](
        logits, logits.stride(0), temperatures, seeds, best, best_id, top, top_id, vocab,
        num_chunks, CHUNK=chunk, BLOCK=block, num_warps=4)
    _pick_kernel[(bs,)](best, best_id, top, top_id, temperatures, out, num_chunks,
                        CHUNKS=max(2, triton.next_power_of_2(num_chunks)), num_warps=1)
    return out
