"""Compile the int4 weight-only kernel's packed path (inline PTX) for sm_90 without a GPU:
Triton's front end, its PTX and ptxas all see it, so a malformed assembly string fails here
rather than on the first GPU. Run as a script (outside Triton's interpreter):

    python tests/kernels/compile_sm90.py X_DTYPE X_WORDS ROWS UNROLL_N

(X_DTYPE fp16 or bf16; X_WORDS 0 or 1: the kernel's constant is 1 for float16, 2 for
bfloat16, as wo_matmul sets it)
prints the cubin's size and the number of byte permutes (prmt) in the PTX."""

from __future__ import annotations

import sys

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from srt.layers.quant_gemm_triton import _gemv_int4_kernel

CONSTEXPR = ("GROUP", "BLOCK_N", "BLOCK_K", "SPLIT_K", "UNROLL_N", "ROWS", "FOUR_SHIFTS",
             "PACKED", "X_WORDS")


def main() -> None:
    x_dtype, rows, unroll = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
    words = int(sys.argv[2]) * (1 if x_dtype == "fp16" else 2)
    ptrs = {"x_ptr": x_dtype, "w_ptr": "i32", "s_ptr": x_dtype, "z_ptr": "u8",
            "out_ptr": x_dtype, "ws_ptr": "fp32", "cnt_ptr": "i32"}
    fn = _gemv_int4_kernel
    sig = {n: "*" + ptrs[n] if n in ptrs else "constexpr" if n in CONSTEXPR else "i32"
           for n in fn.arg_names}
    const = dict(GROUP=128, BLOCK_N=32, BLOCK_K=128, SPLIT_K=8, UNROLL_N=unroll, ROWS=rows,
                 FOUR_SHIFTS=True, PACKED=True, X_WORDS=words)
    kernel = compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                     target=GPUTarget("cuda", 90, 32), options={"num_warps": 2})
    print(len(kernel.asm["cubin"]), kernel.asm["ptx"].count("prmt.b32"))


if __name__ == "__main__":
    main()
