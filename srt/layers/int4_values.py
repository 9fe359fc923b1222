"""int4 values for the weight-only products' CUDA-core kernel (srt/layers/quant_gemm_triton.py):
the helpers that turn the packed words of a tile into sums with x.

No integer-to-float conversions (an eighth of the floating-point rate): an int4 value becomes
a float through its bits (`_nibble`: the nibble moved into the mantissa of 1.0, so one shift, a
masked OR and a multiply-add per value; the zero point is a multiply-add per word). On a GPU
with half-precision x the packed path computes two values per instruction in inline PTX
(`_WORD_ASM`), which the interpreter cannot run (the tests compile it for sm_90 through ptxas on
the CPU); `_x_pairs_words` reads half-precision activations as words of two channels.
"""

from __future__ import annotations

import triton
import triton.language as tl

@triton.jit
def _nibble(moved, x, hi, one):
    """(1 + q / 128) * x for the nibble q at bits 16..19 of `moved`: those bits become the
    top of the mantissa of 1.0 (a masked OR, no integer-to-float conversion)."""
    return ((moved & hi) | one).to(tl.float32, bitcast=True) * x[:, None]


@triton.jit
def _words_dot(init, words, x0, x1, x2, x3, x4, x5, x6, x7, hi, lo, one):
    """init + sum_i (1 + q_i / 128) x_i per word, q_i the nibble at bits 4 i."""
    acc = init + _nibble(words << 16, x0, hi, one)
    acc += _nibble(words << 12, x1, hi, one)
    acc += _nibble(words << 8, x2, hi, one)
    acc += _nibble(words << 4, x3, hi, one)
    acc += _nibble(words, x4, hi, one)
    acc += _nibble(words >> 4, x5, hi, one)
    acc += _nibble(words >> 8, x6, hi, one)
    acc += _nibble(words >> 12, x7, hi, one)
    return acc


@triton.jit
def _nibble_low(moved, x, lo, one):
    """(1 + q / 2048) * x for the nibble q at bits 12..15 of `moved`."""
    return ((moved & lo) | one).to(tl.float32, bitcast=True) * x[:, None]


@triton.jit
def _words_dot_4_shifts(init, words, x0, x1, x2, x3, x4, x5, x6, x7, hi, lo, one):
    """init + sum_i c_i (1 + q_i / 128 or / 2048) x_i, with c_i = 16 for the nibbles read at bits
    12..15 (0, 1, 3, 5) and 1 for those at bits 16..19 (2, 4, 6, 7): four shifts per word where
    _words_dot takes seven. The low position keeps 2^-13 of a value's relative precision
    instead of 2^-19, well below a half-precision activation's (hence only for those)."""
    w8 = words << 8
    r8 = words >> 8
    acc = init + _nibble_low(words << 12, x0 * 16.0, lo, one)
    acc += _nibble_low(w8, x1 * 16.0, lo, one)
    acc += _nibble(w8, x2, hi, one)
    acc += _nibble_low(words, x3 * 16.0, lo, one)
    acc += _nibble(words, x4, hi, one)
    acc += _nibble_low(r8, x5 * 16.0, lo, one)
    acc += _nibble(r8, x6, hi, one)
    acc += _nibble(words >> 12, x7, hi, one)
    return acc


@triton.jit
def _x_tile(xp, mask, FOUR_SHIFTS: tl.constexpr):
    """The activations of a tile's word rows (xp: their first channels), x0 .. x7 in float32,
    and the start of each word's sum: xs = -sum_i x_i and xc = -sum_i c_i x_i (c_i: the
    weight of the 1 of value i, 16 at the low position of _words_dot_4_shifts, else 1)."""
    x0 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x1 = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + 2, mask=mask, other=0.0).to(tl.float32)
    x3 = tl.load(xp + 3, mask=mask, other=0.0).to(tl.float32)
    x4 = tl.load(xp + 4, mask=mask, other=0.0).to(tl.float32)
    x5 = tl.load(xp + 5, mask=mask, other=0.0).to(tl.float32)
    x6 = tl.load(xp + 6, mask=mask, other=0.0).to(tl.float32)
    x7 = tl.load(xp + 7, mask=mask, other=0.0).to(tl.float32)
    xs = -(((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))
    xc = xs
    if FOUR_SHIFTS:
        xc = xs - 15.0 * ((x0 + x1) + (x3 + x5))
    return x0, x1, x2, x3, x4, x5, x6, x7, xs, xc


@triton.jit
def _tile_part(words, s, zc, xs, xc, x0, x1, x2, x3, x4, x5, x6, x7, hi, lo, one,
               FOUR_SHIFTS: tl.constexpr):
    """s * sum_i (q_i - z) x_i / 128 per word of the tile (zc = z / 128)."""
    init = xc[:, None] + xs[:, None] * zc[None, :]
    if FOUR_SHIFTS:
        part = _words_dot_4_shifts(init, words, x0, x1, x2, x3, x4, x5, x6, x7, hi, lo, one)
    else:
        part = _words_dot(init, words, x0, x1, x2, x3, x4, x5, x6, x7, hi, lo, one)
    return part * s[None, :]


# Packed half-precision arithmetic (GPU only: inline PTX, which the interpreter does not run).
# A word's eight nibbles become four pairs of half-precision values with a masked OR each
# (0x6400 | q is 1024 + q; a nibble four bits up gives 1024 + 16 q), the zero point comes off
# both values of a pair at once (exact: q - z is -15..15), and each pair multiplies a pair of
# activations in one instruction: about two instructions per weight value instead of four.
_PAIR_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")  # float32 (lo, hi) -> half2 bits
_WORD_ASM = tl.constexpr("""{
.reg .b32 t, a, b, c, d, p;
.reg .b16 lo, hi;
shr.u32 t, $1, 8;
lop3.b32 a, $1, 0x000f000f, $8, 0xea;
lop3.b32 b, $1, 0x00f000f0, $8, 0xea;
lop3.b32 c, t, 0x000f000f, $8, 0xea;
lop3.b32 d, t, 0x00f000f0, $8, 0xea;
sub.f16x2 a, a, $6;
sub.f16x2 c, c, $6;
fma.rn.f16x2 b, b, $9, $7;
fma.rn.f16x2 d, d, $9, $7;
mul.f16x2 p, a, $2;
fma.rn.f16x2 p, b, $3, p;
fma.rn.f16x2 p, c, $4, p;
fma.rn.f16x2 p, d, $5, p;
mov.b32 {lo, hi}, p;
add.rn.f16 lo, lo, hi;
cvt.f32.f16 $0, lo;
}""")
# Float16 activations read as 32-bit words (X_WORDS): a word holds channels (2i, 2i + 1);
# one byte permute takes the pair (x_i, x_i+4) from two words (0x5410: both low halves,
# 0x7632: both high halves) and one packed multiply scales it by 2^-6 (exact, rounded as the
# float32 path rounds it): two instructions a pair instead of two loads, two conversions, two
# multiplies and a pack.
_PAIR_LO_ASM = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $1, $2, 0x5410; "
                            "mul.rn.f16x2 $0, t, $3; }")
_PAIR_HI_ASM = tl.constexpr("{ .reg .b32 t; prmt.b32 t, $1, $2, 0x7632; "
                            "mul.rn.f16x2 $0, t, $3; }")
# Bfloat16 words: a value's float32 is its bits moved up (low half) or masked (high half),
# scaled by 2^-6 (0f3C800000) and the pair converted at once, as the per-value path does it
# ($3 unused: the same operands as the float16 pair).
_BF_PAIR_LO_ASM = tl.constexpr(
    "{ .reg .b32 a, b; shl.b32 a, $1, 16; shl.b32 b, $2, 16; mul.rn.f32 a, a, 0f3C800000; "
    "mul.rn.f32 b, b, 0f3C800000; cvt.rn.f16x2.f32 $0, b, a; }")
_BF_PAIR_HI_ASM = tl.constexpr(
    "{ .reg .b32 a, b; and.b32 a, $1, 0xffff0000; and.b32 b, $2, 0xffff0000; "
    "mul.rn.f32 a, a, 0f3C800000; mul.rn.f32 b, b, 0f3C800000; cvt.rn.f16x2.f32 $0, b, a; }")
# 0x6400 x2: the bits of 1024.0 in both halves; 0x2c00 x2: 1/16 in both; 0x2400 x2: 2^-6 in
# both (runtime arguments, so that they stay in registers)
_PACKED_BITS = (0x64006400, 0x2C002C00, 0x24002400)
# activations are scaled by 2^-6 into half precision: a pair's four products stay below
# 65504 while |x| < 65504 (|q - z| <= 15), and only |x| < 2^-8 reaches fp16's subnormals
_PACKED_X_SCALE = tl.constexpr(1.0 / 64.0)


@triton.jit
def _half2(lo, hi):
    """The bits (int32) of the half-precision pair (lo, hi), rounded from float32."""
    return tl.inline_asm_elementwise(_PAIR_ASM, "=r,f,f", [lo, hi], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _x_pairs(xp, mask):
    """A tile's activations (xp: each word row's first channel) scaled by 2^-6 as the
    half-precision pairs (x_i, x_i+4), i = 0..3, that _packed_part multiplies."""
    sc = _PACKED_X_SCALE
    x0 = tl.load(xp, mask=mask, other=0.0).to(tl.float32) * sc
    x1 = tl.load(xp + 1, mask=mask, other=0.0).to(tl.float32) * sc
    x2 = tl.load(xp + 2, mask=mask, other=0.0).to(tl.float32) * sc
    x3 = tl.load(xp + 3, mask=mask, other=0.0).to(tl.float32) * sc
    x4 = tl.load(xp + 4, mask=mask, other=0.0).to(tl.float32) * sc
    x5 = tl.load(xp + 5, mask=mask, other=0.0).to(tl.float32) * sc
    x6 = tl.load(xp + 6, mask=mask, other=0.0).to(tl.float32) * sc
    x7 = tl.load(xp + 7, mask=mask, other=0.0).to(tl.float32) * sc
    return _half2(x0, x4), _half2(x1, x5), _half2(x2, x6), _half2(x3, x7)


@triton.jit
def _word_pair(a, b, x_scale, HIGH: tl.constexpr, BF16: tl.constexpr):
    """The half-precision pair (a's, b's) low (HIGH 0) or high halves, scaled by 2^-6."""
    if BF16 and HIGH:
        p = tl.inline_asm_elementwise(_BF_PAIR_HI_ASM, "=r,r,r,r", [a, b, x_scale],
                                      dtype=tl.int32, is_pure=True, pack=1)
    elif BF16:
        p = tl.inline_asm_elementwise(_BF_PAIR_LO_ASM, "=r,r,r,r", [a, b, x_scale],
                                      dtype=tl.int32, is_pure=True, pack=1)
    elif HIGH:
        p = tl.inline_asm_elementwise(_PAIR_HI_ASM, "=r,r,r,r", [a, b, x_scale],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        p = tl.inline_asm_elementwise(_PAIR_LO_ASM, "=r,r,r,r", [a, b, x_scale],
                                      dtype=tl.int32, is_pure=True, pack=1)
    return p


@triton.jit
def _x_pairs_words(xp, mask, x_scale, BF16: tl.constexpr):
    """_x_pairs for half-precision x read as words of two channels (X_WORDS; xp as in
    _x_pairs, 4-byte aligned)."""
    xw = xp.to(tl.pointer_type(tl.int32))
    w0 = tl.load(xw, mask=mask, other=0)  # channels (0, 1)
    w1 = tl.load(xw + 1, mask=mask, other=0)  # (2, 3)
    w2 = tl.load(xw + 2, mask=mask, other=0)  # (4, 5)
    w3 = tl.load(xw + 3, mask=mask, other=0)  # (6, 7)
    return (_word_pair(w0, w2, x_scale, 0, BF16), _word_pair(w0, w2, x_scale, 1, BF16),
            _word_pair(w1, w3, x_scale, 0, BF16), _word_pair(w1, w3, x_scale, 1, BF16))


@triton.jit
def _zero_pairs(z):
    """The zero points (float32, per column) as the pairs _packed_part subtracts: 1024 + z
    from the values read at the low nibble position, -(64 + z) added to a sixteenth of those
    read four bits up."""
    return _half2(z + 1024.0, z + 1024.0), _half2(-64.0 - z, -64.0 - z)


@triton.jit
def _packed_part(words, x04, x15, x26, x37, zlo, zhi, magic, sixteenth):
    """sum_i (q_i - z) x_i 2^-6 per word of the tile (float32), in packed half precision."""
    return tl.inline_asm_elementwise(
        _WORD_ASM, "=f,r,r,r,r,r,r,r,r,r",
        [words, x04[:, None], x15[:, None], x26[:, None], x37[:, None], zlo[None, :],
         zhi[None, :], magic, sixteenth], dtype=tl.float32, is_pure=True, pack=1)
