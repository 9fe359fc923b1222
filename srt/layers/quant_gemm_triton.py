"""Weight-only products with quantized weights, for the few rows of decode: x [M, K] in the
model dtype times a weight dequantized inside the kernel, so that the product reads each weight
byte once and nothing else.

Two weight formats:
- FP8 e4m3 `w [N, K]` (as nn.Linear holds it) with one scale per output row `s [N]`
  (srt/layers/fp8.py);
- int4 `w [K / 8, N]` int32, eight consecutive input channels per word (channel 8 j + i in
  bits 4 i .. 4 i + 3 of word row j), with `s [K / G, N]` scales and `z [K / G, N]` uint8 zero
  points per group of G input channels: w[n, k] = (q - z) * s. Output columns are contiguous,
  so that a program's loads of a word row are wide (srt/layers/awq.py's AwqKernelWeight
  repacks AutoAWQ's layout into this one on the GPU).

Kernels:
- `_gemv_fp8_kernel` and `_gemv_int4_kernel`, few rows of x per program on the CUDA cores into
  a float32 accumulator of the tile's shape, reduced once at the end. No integer-to-float
  conversions (an eighth of the floating-point rate): int4 values become floats through their
  bits (srt/layers/int4_values.py). The int4 one also shares loads of x between two column
  tiles (UNROLL_N) and decoded values between two rows (ROWS), and on a GPU with
  half-precision x computes in packed half precision (PACKED: inline PTX, two values per
  instruction), which the interpreter cannot run (the tests compile it for sm_90 through
  ptxas on the CPU); X_WORDS reads half-precision activations there as words of two channels
  (the default tiles at 1-4 rows; rows not 4-byte aligned take per-value loads).
- `_dot_kernel`, BLOCK_M rows per program on the tensor cores: the tile is dequantized to x's
  dtype and multiplied by tl.dot.
All cut the output axis into BLOCK_N columns and optionally split K over SPLIT_K programs,
which add into a float32 workspace that the last of them per output turns into the output and
leaves zeroed (`_finish`: no extra kernels per product), so that enough programs stream the
weight at once. All but the packed path run in Triton's interpreter on the CPU (tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from srt.layers.int4_values import (_PACKED_BITS, _packed_part, _tile_part, _x_pairs,
                                    _x_pairs_words, _x_tile, _zero_pairs)

# Rows from which a product dequantizes the int4 weight once and runs a GEMM (prefill)
DEQUANT_MIN_ROWS = 256


@triton.jit
def _finish(acc, offs_n, mask_n, m, out_ptr, ws_ptr, cnt_ptr, N, stride_om,
            SPLIT_K: tl.constexpr):
    """Write one program's sums for rows m, columns offs_n (a row and a vector of columns, or
    broadcastable [BLOCK_M, 1] rows and [1, BLOCK_N] columns); mask_n: the outputs to write."""
    out = out_ptr + m * stride_om + offs_n
    if SPLIT_K == 1:
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
    else:
        # Split K without extra kernels: each program adds its sums into the float32
        # workspace, then counts itself in per output (the counter's release orders the add
        # before it); the SPLIT_K-th to arrive at an output takes the total, leaving zeros for
        # the next product, writes it in the output's dtype and resets the counter.
        ws = ws_ptr + m * N + offs_n
        cnt = cnt_ptr + m * N + offs_n
        tl.atomic_add(ws, acc, mask=mask_n, sem="relaxed")
        last = mask_n & (tl.atomic_add(cnt, 1, mask=mask_n, sem="acq_rel") == SPLIT_K - 1)
        total = tl.atomic_add(ws, 0.0, mask=last, sem="acq_rel")  # (the interpreter has no
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=last)  # float exchange)
        tl.store(ws, tl.zeros_like(total), mask=last)
        tl.store(cnt, last.to(tl.int32) * 0, mask=last)


@triton.jit
def _gemv_int4_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                      stride_w, stride_s, stride_z, stride_om, hi, lo, one, magic, sixteenth,
                      x_scale, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, UNROLL_N: tl.constexpr,
                      ROWS: tl.constexpr, FOUR_SHIFTS: tl.constexpr, PACKED: tl.constexpr,
                      X_WORDS: tl.constexpr):
    # One group per tile (BLOCK_K divides GROUP); word row j of a tile holds channels 8 j + i
    # (bits 4 i). With 1 + q / 128 from _nibble,
    #   sum_i (q_i - z) x_i / 128 = sum_i (1 + q_i / 128) x_i - (1 + z / 128) sum_i x_i,
    # so that each value costs a shift, a masked OR and a multiply-add, and the zero point a
    # multiply-add per word. UNROLL_N (1 or 2) column tiles per program share the loads and
    # conversions of x; ROWS (1 or 2) rows of x share the values taken from the words.
    pid_m = tl.program_id(0)  # fastest: the programs of other rows read the same words next
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    BLOCK_W: tl.constexpr = BLOCK_K // 8
    STEP_W: tl.constexpr = BLOCK_W * SPLIT_K
    KW = K // 8
    m0 = pid_m.to(tl.int64) * ROWS
    offs_w = tl.arange(0, BLOCK_W)
    offs_a = pid_n * (BLOCK_N * UNROLL_N) + tl.arange(0, BLOCK_N)
    offs_b = offs_a + BLOCK_N
    mask_a = offs_a < N
    mask_b = offs_b < N
    has1 = (offs_w * 0 + m0 + 1) < M  # a second row (as a mask of the tile's word rows)
    col_a = w_ptr + offs_a[None, :]
    col_b = w_ptr + offs_b[None, :]
    x_row = x_ptr + m0 * stride_xm
    acc_a0 = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
    acc_b0 = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
    acc_a1 = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
    acc_b1 = tl.zeros((BLOCK_W, BLOCK_N), dtype=tl.float32)
    # the next tile's words are loaded before this one's are used (two tiles in flight)
    wi = pid_k * BLOCK_W + offs_w
    rows = wi[:, None].to(tl.int64) * stride_w
    w_a = tl.load(col_a + rows, mask=(wi < KW)[:, None] & mask_a[None, :], other=0)
    w_b = w_a
    if UNROLL_N == 2:
        w_b = tl.load(col_b + rows, mask=(wi < KW)[:, None] & mask_b[None, :], other=0)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        wi = k0 // 8 + offs_w
        mask_w = wi < KW
        nxt = wi + STEP_W
        rows = nxt[:, None].to(tl.int64) * stride_w
        n_a = tl.load(col_a + rows, mask=(nxt < KW)[:, None] & mask_a[None, :], other=0)
        n_b = n_a
        if UNROLL_N == 2:
            n_b = tl.load(col_b + rows, mask=(nxt < KW)[:, None] & mask_b[None, :], other=0)
        g = k0 // GROUP
        s_a = tl.load(s_ptr + g * stride_s + offs_a, mask=mask_a, other=0.0).to(tl.float32)
        z_a = tl.load(z_ptr + g * stride_z + offs_a, mask=mask_a, other=0).to(tl.float32)
        s_b = s_a
        z_b = z_a
        if UNROLL_N == 2:
            s_b = tl.load(s_ptr + g * stride_s + offs_b, mask=mask_b, other=0.0).to(tl.float32)
            z_b = tl.load(z_ptr + g * stride_z + offs_b, mask=mask_b, other=0).to(tl.float32)
        if PACKED:
            zlo_a, zhi_a = _zero_pairs(z_a)
            zlo_b = zlo_a
            zhi_b = zhi_a
            if UNROLL_N == 2:
                zlo_b, zhi_b = _zero_pairs(z_b)
            if X_WORDS:
                x04, x15, x26, x37 = _x_pairs_words(x_row + wi * 8, mask_w, x_scale,
                                                    X_WORDS == 2)
            else:
                x04, x15, x26, x37 = _x_pairs(x_row + wi * 8, mask_w)
            acc_a0 += _packed_part(w_a, x04, x15, x26, x37, zlo_a, zhi_a, magic,
                                   sixteenth) * s_a[None, :]
            if UNROLL_N == 2:
                acc_b0 += _packed_part(w_b, x04, x15, x26, x37, zlo_b, zhi_b, magic,
                                       sixteenth) * s_b[None, :]
            if ROWS == 2:
                if X_WORDS:
                    x04, x15, x26, x37 = _x_pairs_words(x_row + stride_xm + wi * 8,
                                                        mask_w & has1, x_scale, X_WORDS == 2)
                else:
                    x04, x15, x26, x37 = _x_pairs(x_row + stride_xm + wi * 8, mask_w & has1)
                acc_a1 += _packed_part(w_a, x04, x15, x26, x37, zlo_a, zhi_a, magic,
                                       sixteenth) * s_a[None, :]
                if UNROLL_N == 2:
                    acc_b1 += _packed_part(w_b, x04, x15, x26, x37, zlo_b, zhi_b, magic,
                                           sixteenth) * s_b[None, :]
        else:
            zc_a = z_a * 0.0078125
            zc_b = z_b * 0.0078125
            x0, x1, x2, x3, x4, x5, x6, x7, xs, xc = _x_tile(x_row + wi * 8, mask_w,
                                                             FOUR_SHIFTS)
            acc_a0 += _tile_part(w_a, s_a, zc_a, xs, xc, x0, x1, x2, x3, x4, x5, x6, x7, hi,
                                 lo, one, FOUR_SHIFTS)
            if UNROLL_N == 2:
                acc_b0 += _tile_part(w_b, s_b, zc_b, xs, xc, x0, x1, x2, x3, x4, x5, x6, x7,
                                     hi, lo, one, FOUR_SHIFTS)
            if ROWS == 2:
                x0, x1, x2, x3, x4, x5, x6, x7, xs, xc = _x_tile(x_row + stride_xm + wi * 8,
                                                                 mask_w & has1, FOUR_SHIFTS)
                acc_a1 += _tile_part(w_a, s_a, zc_a, xs, xc, x0, x1, x2, x3, x4, x5, x6, x7,
                                     hi, lo, one, FOUR_SHIFTS)
                if UNROLL_N == 2:
                    acc_b1 += _tile_part(w_b, s_b, zc_b, xs, xc, x0, x1, x2, x3, x4, x5, x6,
                                         x7, hi, lo, one, FOUR_SHIFTS)
        w_a = n_a
        w_b = n_b
    # the sums' unit: 2^-7 (the bits of 1.0) or 2^-6 (the packed activations' scale)
    unit = 128.0
    if PACKED:
        unit = 64.0
    _finish(tl.sum(acc_a0, 0) * unit, offs_a, mask_a, m0, out_ptr, ws_ptr, cnt_ptr, N,
            stride_om, SPLIT_K)
    if UNROLL_N == 2:
        _finish(tl.sum(acc_b0, 0) * unit, offs_b, mask_b, m0, out_ptr, ws_ptr, cnt_ptr, N,
                stride_om, SPLIT_K)
    if ROWS == 2:
        row1 = m0 + 1 < M + offs_a * 0  # (a tensor: the interpreter masks with tensors only)
        _finish(tl.sum(acc_a1, 0) * unit, offs_a, mask_a & row1, m0 + 1, out_ptr, ws_ptr,
                cnt_ptr, N, stride_om, SPLIT_K)
        if UNROLL_N == 2:
            _finish(tl.sum(acc_b1, 0) * unit, offs_b, mask_b & row1, m0 + 1, out_ptr, ws_ptr,
                    cnt_ptr, N, stride_om, SPLIT_K)


@triton.jit
def _gemv_fp8_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, stride_xm, stride_w,
                     stride_om, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, REDUCE: tl.constexpr):
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    x_row = x_ptr + m * stride_xm
    offs_k = tl.arange(0, BLOCK_K)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + offs_k
        w = tl.load(w_ptr + rows * stride_w + ks[None, :],
                    mask=mask_n[:, None] & (ks < K)[None, :], other=0.0)
        x = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
        if REDUCE:
            acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
        else:
            acc2 += w.to(tl.float32) * x[None, :]
    if not REDUCE:
        acc = tl.sum(acc2, 1)
    acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    _finish(acc, offs_n, mask_n, m, out_ptr, ws_ptr, cnt_ptr, N, stride_om, SPLIT_K)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, ws_ptr, cnt_ptr, M, N, K, stride_xm,
                stride_w, stride_s, stride_z, stride_om, INT4: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLIT_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = offs_n[:, None].to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        ks = k0 + offs_k
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=mask_m[:, None] & (ks < K)[None, :], other=0.0)
        if INT4:
            # BLOCK_K divides GROUP: one group per tile. In half precision the values come
            # from the bits (fp16 0x6400 | q is 1024 + q, bf16 0x4300 | q is 128 + q) and
            # q - z is taken in that precision (exact: -15..15), so that the tensor cores
            # multiply x by q - z and only the group's scale is applied after.
            # the word rows of the tile, each expanded in registers into its eight channels
            BLOCK_W: tl.constexpr = BLOCK_K // 8
            wi = k0 // 8 + tl.arange(0, BLOCK_W)
            words = tl.load(w_ptr + wi[:, None].to(tl.int64) * stride_w + offs_n[None, :],
                            mask=(wi < K // 8)[:, None] & mask_n[None, :], other=0)
            nib = tl.arange(0, 8) * 4
            q = tl.reshape((words[:, None, :] >> nib[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
            g = k0 // GROUP
            s = tl.load(s_ptr + g * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            z = tl.load(z_ptr + g * stride_z + offs_n, mask=mask_n, other=0).to(tl.float32)
            if x.dtype == tl.float16:
                h = (q | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
                h = h - (z + 1024.0).to(tl.float16)[None, :]
            elif x.dtype == tl.bfloat16:
                h = (q | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
                h = h - (z + 128.0).to(tl.bfloat16)[None, :]
            else:
                h = q.to(x.dtype) - z[None, :]
            acc += tl.dot(x, h, input_precision=PRECISION) * s[None, :]
        else:
            w = tl.load(w_ptr + rows * stride_w + ks[None, :],
                        mask=mask_n[:, None] & (ks < K)[None, :], other=0.0).to(x.dtype)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    if not INT4:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    _finish(acc, offs_n[None, :], mask_m[:, None] & mask_n[None, :], offs_m[:, None].to(tl.int64),
            out_ptr, ws_ptr, cnt_ptr, N, stride_om, SPLIT_K)


@triton.jit
def _dequant_int4_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, stride_w, stride_s, stride_z,
                         stride_o, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (ks < K)[:, None] & (offs_n < N)[None, :]
    words = tl.load(w_ptr + (ks // 8)[:, None].to(tl.int64) * stride_w + offs_n[None, :],
                    mask=mask, other=0)
    g = (ks // GROUP)[:, None]
    s = tl.load(s_ptr + g * stride_s + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + g * stride_z + offs_n[None, :], mask=mask, other=0).to(tl.float32)
    q = ((words >> ((ks % 8) * 4)[:, None]) & 0xF).to(tl.float32)
    tl.store(out_ptr + ks[:, None].to(tl.int64) * stride_o + offs_n[None, :],
             ((q - z) * s).to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_int4(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """The int4 weight of the module docstring's layout as [K, N] (the transpose of
    nn.Linear's) in `dtype`: (q - z) * s in float32, rounded once; into `out` if given."""
    k, n = w.shape[0] * 8, w.shape[1]
    group = k // s.shape[0]
    if out is None:
        out = torch.empty((k, n), dtype=dtype, device=w.device)
    elif out.shape != (k, n) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} for a weight of {k} x {n} {dtype}")
    block_n, block_k = 128, 32
    _dequant_int4_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w, s, z, out, n, k, w.stride(0), s.stride(0), z.stride(0), out.stride(0), GROUP=group,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


@dataclass(frozen=True)
class WoConfig:
    """Tiles of one product: BLOCK_M == 1 selects the CUDA-core kernel (one row of x per
    program), larger BLOCK_M the tensor-core one."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    SPLIT_K: int = 1
    num_warps: int = 4
    REDUCE: int = 0  # CUDA-core FP8 kernel: reduce every tile (1) or once at the end (0)
    UNROLL_N: int = 1  # CUDA-core int4 kernel: column tiles per program (1 or 2)
    ROWS: int = 1  # CUDA-core int4 kernel: rows of x per program (1 or 2)
    # CUDA-core int4 kernel: packed half-precision arithmetic (inline PTX) where it can run:
    # half-precision activations on a GPU (float32 and the interpreter take the float path)
    PACKED: int = 0
    # packed path: half-precision x read as words of two channels (_x_pairs_words; rows
    # not 4-byte aligned take the per-value loads)
    X_WORDS: int = 0


def default_config(m: int, n: int, k: int, int4: bool, group: int) -> WoConfig:
    """The tiles used when none are given (chosen on one H200 at the Llama-3-8B layer sizes:
    benchmarks/bench_quant_gemm.py --sweep)."""
    if int4:
        bk = min(group, 128)
        split = 16 if k > 8192 else 8
        # X_WORDS (H200, 8B layer sizes): products at 1-4 rows 3-27% faster in float16, 0-23%
        # in bfloat16
        if m == 1:
            return WoConfig(1, 32, bk, split, 2, PACKED=1, X_WORDS=1)
        if m == 2:
            return WoConfig(1, 32, bk, split, 2, UNROLL_N=2 if k > 8192 else 1, ROWS=2,
                            PACKED=1, X_WORDS=1)
        if m <= 4:
            return WoConfig(1, 32, bk, 8, 2, UNROLL_N=2, ROWS=2, PACKED=1, X_WORDS=1)
        if m <= 16:
            return WoConfig(16, 64, bk, 4, 4)
        return WoConfig(64, 128, min(group, 128), 1, 4)
    if m == 1:
        if n >= 16384:
            return WoConfig(1, 16, 256, 1, 2, REDUCE=1)
        return WoConfig(1, 4, 1024, 1, 2 if n > k else 4, REDUCE=1)
    if m <= 16:
        return WoConfig(16, 64 if n >= 16384 else 32, 128, 4, 4)
    return WoConfig(64, 64, 128, 4, 4)


# The masks of the nibble positions and the bits of 1.0, passed as arguments rather than
# written as constants, so that they stay in registers: as immediates the compiler rebuilds
# one before nearly every masked OR (it takes one immediate), an instruction per value.
_NIBBLE_BITS = (0xF0000, 0xF000, 0x3F800000)

_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_OUTGROWN: list[tuple[torch.Tensor, torch.Tensor]] = []  # kept: captured graphs may use them


def split_workspace(device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA-core kernel's split-K workspace on `device`: float32 sums and int32 counters,
    zero between products (each product leaves them so). Kept per device and grown to the
    largest M x N asked for; products on one device run one after another (one stream)."""
    ws = _WORKSPACES.get(device)
    if ws is None or ws[0].numel() < numel:
        if ws is not None:
            _OUTGROWN.append(ws)
        size = max(numel, 1 << 17)
        ws = (torch.zeros(size, dtype=torch.float32, device=device),
              torch.zeros(size, dtype=torch.int32, device=device))
        _WORKSPACES[device] = ws
    return ws


def wo_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None = None,
              config: WoConfig | None = None) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ dequant(w).T -> [M, N] in x's dtype. FP8: w [N, K]
    float8_e4m3fn, s [N]. int4 (z given): w [K / 8, N] int32, s [K / G, N], z [K / G, N]
    uint8 (the layout of the module docstring)."""
    int4 = z is not None
    m, k = x.shape
    n = w.shape[1] if int4 else w.shape[0]
    if x.stride(1) != 1 or w.stride(1) != 1 or (w.shape[0] * 8 if int4 else w.shape[1]) != k:
        raise ValueError(f"x {tuple(x.shape)} against a weight {tuple(w.shape)} {w.dtype}")
    group = k // s.shape[0] if int4 else 8  # (a constant for FP8: no recompilation per K)
    if (s.stride(-1) != 1
            or (int4 and (s.dim() != 2 or s.shape[1] != n or z.shape != s.shape
                          or z.stride(1) != 1 or s.shape[0] * group != k))
            or (not int4 and (s.shape[0] != n or s.numel() != n))):
        raise ValueError(f"scales {tuple(s.shape)}"
                         + (f" / zeros {tuple(z.shape)}" if int4 else "")
                         + f" against a weight of {n} x {k}")
    cfg = config or default_config(m, n, k, int4, group)
    if int4 and (group % 8 or group % cfg.BLOCK_K or cfg.BLOCK_K % 8):
        raise ValueError(f"int4 groups of {group} with BLOCK_K {cfg.BLOCK_K}")
    if cfg.UNROLL_N not in (1, 2) or cfg.ROWS not in (1, 2):
        raise ValueError(f"UNROLL_N {cfg.UNROLL_N}, ROWS {cfg.ROWS}: 1 or 2")
    split = cfg.SPLIT_K
    gemv = cfg.BLOCK_M == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    ws, cnt = split_workspace(x.device, m * n) if split > 1 else (out, out)
    zz = z if int4 else s  # unused by the FP8 kernel
    strides = (x.stride(0), w.stride(0), s.stride(0) if int4 else 1,
               zz.stride(0) if int4 else 1, out.stride(0))
    if gemv:
        if int4:
            grid = (triton.cdiv(m, cfg.ROWS), triton.cdiv(n, cfg.BLOCK_N * cfg.UNROLL_N), split)
            packed = bool(cfg.PACKED) and x.is_cuda and x.dtype != torch.float32
            # X_WORDS in the kernel: 1 float16 words, 2 bfloat16 words, 0 per-value loads
            words = (packed and bool(cfg.X_WORDS) and x.stride(0) % 2 == 0
                     and x.data_ptr() % 4 == 0) * (1 if x.dtype == torch.float16 else 2)
            _gemv_int4_kernel[grid](
                x, w, s, z, out, ws, cnt, m, n, k, *strides, *_NIBBLE_BITS, *_PACKED_BITS,
                GROUP=group, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_K=split,
                UNROLL_N=cfg.UNROLL_N, ROWS=cfg.ROWS, FOUR_SHIFTS=x.dtype != torch.float32,
                PACKED=packed, X_WORDS=words, num_warps=cfg.num_warps)
        else:
            _gemv_fp8_kernel[(triton.cdiv(n, cfg.BLOCK_N), m, split)](
                x, w, s, out, ws, cnt, n, k, x.stride(0), w.stride(0), out.stride(0),
                BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_K=split, REDUCE=cfg.REDUCE,
                num_warps=cfg.num_warps)
        return out
    else:
        _dot_kernel[(triton.cdiv(n, cfg.BLOCK_N), triton.cdiv(m, cfg.BLOCK_M), split)](
            x, w, s, zz, out, ws, cnt, m, n, k, *strides, INT4=int4, GROUP=group,
            BLOCK_M=cfg.BLOCK_M, BLOCK_N=cfg.BLOCK_N, BLOCK_K=cfg.BLOCK_K, SPLIT_K=split,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=cfg.num_warps, num_stages=3 if x.is_cuda else 1)
    return out
