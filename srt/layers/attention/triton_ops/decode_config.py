"""Host-side choices of the DECODE attention kernels (srt/layers/attention/triton_ops/
decode_attention.py): tile and pipeline constants, the split counts, the device's SM count and
shared memory, the workspace's size. Host ints only: nothing here launches a kernel."""

from __future__ import annotations

import functools

import torch
import triton

# Tuned on one H200 with benchmarks/sweep_triton_attention.py (32/8 heads, d 128, bf16):
# batch 64 x 2048 went from 71% to 87% of copy bandwidth with 64-token blocks.
DECODE_BLOCK_N = 64  # tokens per inner step of stage 1
DECODE_MIN_BLOCK_H = 16  # tl.dot needs M >= 16: the query-head group is padded to this
DECODE_NUM_WARPS = 4
# Batches of unequal contexts (benchmarks/sweep_decode_ragged.py, 100-1124 tokens, one H200):
# 3 stages against 2 took batch 64 from 75.6 to 59.7 us, 128 from 141.5 to 101.2 us and 256
# from 231 to 178 us per layer; 4 stages equal 3 with a third more shared memory.
DECODE_NUM_STAGES = 3
# SmolLM2's heads (9 / 3, d 64) at batch 256 x 768: 4 stages 0.059 ms, 2 stages 0.065 ms.
DECODE_NUM_STAGES_SMALL_HEAD = 4
# Split rule: aim at PROGRAMS_PER_SM stage-1 programs per SM, never splits shorter than
# MIN_TOKENS_PER_SPLIT, never more than MAX_KV_SPLITS splits. 8 (was 4) from the H200 sweeps of
# unequal contexts (100-1124 tokens): batch 128 gets 2 splits (bf16 pool 96.6-98.2 us a layer
# against 101.2-110.8 with 1; FP8 pool 95.0 against 101.1), batch 64 3 (59.4 us, 2: 59.7),
# batch 256 still 1. The shared-prefix stage keeps 4 (DECODE_SHARED_PROGRAMS_PER_SM).
DECODE_PROGRAMS_PER_SM = 8
# Latent attention (one 576-wide KV head read by all 16 query heads, values 512 wide: each
# program is large, and stage 2 merges 512-wide float32 partials): 3 per SM. One H100,
# DeepSeek-V2-Lite's heads, contexts 100-1124, a layer: batch 200 2 splits 0.091 ms against
# 0.106 with the 8-per-SM rule's 6; batch 256 2 splits 0.112 against 0.130 (6); batch 128 4
# splits 0.070 (best 3: 0.070; 6: 0.073); 4 warps beat 8 at every size.
DECODE_MLA_PROGRAMS_PER_SM = 3
DECODE_SHARED_PROGRAMS_PER_SM = 4
DECODE_MIN_TOKENS_PER_SPLIT = 128
DECODE_MAX_KV_SPLITS = 64
DECODE_SHARED_BLOCK_M = 64  # query rows (request x head) per program of the shared stage
_DEFAULT_NUM_SMS = 132  # H100 / H200


@functools.lru_cache(maxsize=None)
def _cuda_properties(index: int) -> tuple[int, int | None]:
    """(streaming multiprocessors, shared memory per block opt-in, None where torch lacks it)"""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, getattr(props, "shared_memory_per_block_optin", None)


def _cuda_index(device: torch.device | str | None) -> int | None:
    """CUDA index of `device` (the current CUDA device if None); None without CUDA."""
    if device is not None:
        device = torch.device(device)
        if device.type != "cuda":
            return None
    if not torch.cuda.is_available():
        return None
    if device is not None and device.index is not None:
        return device.index
    return torch.cuda.current_device()


def device_num_sms(device: torch.device | str | None = None) -> int:
    """Streaming multiprocessors of `device` (the current CUDA device if None); 132 without CUDA."""
    index = _cuda_index(device)
    return _DEFAULT_NUM_SMS if index is None else _cuda_properties(index)[0]


def device_shared_memory(device: torch.device | str | None = None) -> int | None:
    """Shared memory per block (opt-in) of `device` in bytes; None without CUDA or unknown."""
    index = _cuda_index(device)
    return None if index is None else _cuda_properties(index)[1]


def decode_num_stages(head_dim: int, block_n: int, kv_itemsize: int,
                      shared_memory: int | None, latent: bool = False) -> int:
    """Stage 1's pipeline depth: DECODE_NUM_STAGES (DECODE_NUM_STAGES_SMALL_HEAD for head_dim
    <= 64), less where `shared_memory` bytes per block (None: unknown, no limit) would not hold
    that many K and V tiles with 16 KiB to spare (e.g. 99 KiB GPUs at d 128 get 2); never
    below 2. `latent`: one tile serves as K and V (multi-head latent attention)."""
    stages = DECODE_NUM_STAGES_SMALL_HEAD if head_dim <= 64 else DECODE_NUM_STAGES
    tiles = (1 if latent else 2) * block_n * triton.next_power_of_2(head_dim) * kv_itemsize
    while (shared_memory is not None and stages > 2
           and stages * tiles + (16 << 10) > shared_memory):
        stages -= 1
    return stages


def fp8_pairs(q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the decode kernels read an FP8 pool as int16 words of two channels and compute
    in float16 (_attend_range_pairs): half-precision queries, an even head_dim of at least 32
    (each half a tl.dot operand of >= 16). Else FP8 tiles are converted to q's dtype as read,
    which on a GPU reads them from shared memory a byte at a time (on one H200 at batch 128,
    contexts of 100-1124: 110-116 us a layer, slower than a bf16 pool's 101 us for twice the
    bytes)."""
    return (kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
            and q_dtype in (torch.bfloat16, torch.float16)
            and head_dim % 2 == 0 and triton.next_power_of_2(head_dim) >= 32)


def choose_shared_splits(bs: int, group: int, kv_heads: int, shared_len: int, *,
                         num_sms: int | None = None,
                         max_splits: int = DECODE_MAX_KV_SPLITS) -> int:
    """Splits of the shared-prefix stage: about DECODE_SHARED_PROGRAMS_PER_SM programs per SM over
    its (kv_heads x row blocks) grid, at least 256 prefix tokens a split. Host ints only."""
    row_blocks = triton.cdiv(bs * group, DECODE_SHARED_BLOCK_M)
    target = (num_sms if num_sms is not None else device_num_sms()) * DECODE_SHARED_PROGRAMS_PER_SM
    want = triton.cdiv(target, max(1, kv_heads * row_blocks))
    return max(1, min(want, triton.cdiv(max(1, shared_len), 256), max_splits))


def choose_num_kv_splits(
    bs: int,
    kv_heads: int,
    max_seq_len: int,
    *,
    num_sms: int | None = None,
    max_splits: int = DECODE_MAX_KV_SPLITS,
    programs_per_sm: int = DECODE_PROGRAMS_PER_SM,
) -> int:
    """splits = clamp(ceil(num_sms * programs_per_sm / (bs * kv_heads)), 1, max_splits),
    further limited so a split of the longest context holds at least
    DECODE_MIN_TOKENS_PER_SPLIT tokens. Host ints only; deterministic."""
    target = (num_sms if num_sms is not None else device_num_sms()) * programs_per_sm
    splits = triton.cdiv(target, max(1, bs * kv_heads))
    splits = min(splits, triton.cdiv(max(1, max_seq_len), DECODE_MIN_TOKENS_PER_SPLIT))
    return max(1, min(splits, max_splits))


def decode_workspace_numel(bs: int, num_heads: int, head_dim: int, num_kv_splits: int) -> int:
    return bs * num_heads * num_kv_splits * (head_dim + 1)


def decode_workspace(
    max_bs: int, num_heads: int, head_dim: int, num_kv_splits: int,
    device: torch.device | str,
) -> torch.Tensor:
    """Flat float32 workspace big enough for any call with bs * splits <= max_bs * num_kv_splits
    (same heads and head_dim)."""
    numel = decode_workspace_numel(max_bs, num_heads, head_dim, num_kv_splits)
    return torch.empty(numel, dtype=torch.float32, device=device)
