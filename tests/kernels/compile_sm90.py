"""Compile GPU kernels for sm_90 without a GPU: Triton's front end, its PTX and ptxas all see
them, so a kernel the interpreter accepts but the compiler refuses (or a malformed inline
assembly string) fails here rather than on the first GPU. Run as a script (outside Triton's
interpreter):

    python tests/kernels/compile_sm90.py int4 X_DTYPE X_WORDS ROWS UNROLL_N
    python tests/kernels/compile_sm90.py sample
    python tests/kernels/compile_sm90.py fp8gemm

int4: the weight-only kernel's packed path (X_DTYPE fp16 or bf16; X_WORDS 0 or 1: the kernel's
constant is 1 for float16, 2 for bfloat16, as wo_matmul sets it); prints the cubin's size and
the number of byte permutes (prmt) in the PTX.
sample: the one-pass sampler's two kernels (float32 and bfloat16 logits); prints each cubin's
size and the number of Philox rounds' multiply-high instructions (mul.hi) in its PTX.
fp8gemm: the split-K FP8 product's kernels (128 x 64 tiles whose partial sums are stored, and
64 x 64 unsplit with bf16 out, then the second pass); prints each cubin's size and the number
of FP8 tensor-core instructions (wgmma on e4m3) in its PTX."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ptxas() -> str | None:
    """Triton's ptxas (or one on PATH); None where there is none (tests skip)."""
    try:
        import triton.backends.nvidia as nv
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    return path if os.path.exists(path) else shutil.which("ptxas")


def compile_in_subprocess(*args: str) -> list[int]:
    """This script's printed integers for `args`, run in a process outside Triton's
    interpreter (tests run inside it on the CPU); fails the caller with its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [int(x) for x in proc.stdout.split()]


def _compile(fn: Any, ptrs: dict[str, str], const: dict[str, Any], num_warps: int) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    sig = {n: "*" + ptrs[n] if n in ptrs else "constexpr" if n in const else "i32"
           for n in fn.arg_names}
    return compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                   target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": num_warps})


def int4(x_dtype: str, x_words: int, rows: int, unroll: int) -> None:
    from srt.layers.quant_gemm_triton import _gemv_int4_kernel

    words = x_words * (1 if x_dtype == "fp16" else 2)
    ptrs = {"x_ptr": x_dtype, "w_ptr": "i32", "s_ptr": x_dtype, "z_ptr": "u8",
            "out_ptr": x_dtype, "ws_ptr": "fp32", "cnt_ptr": "i32"}
    const = dict(GROUP=128, BLOCK_N=32, BLOCK_K=128, SPLIT_K=8, UNROLL_N=unroll, ROWS=rows,
                 FOUR_SHIFTS=True, PACKED=True, X_WORDS=words)
    kernel = _compile(_gemv_int4_kernel, ptrs, const, 2)
    print(len(kernel.asm["cubin"]), kernel.asm["ptx"].count("prmt.b32"))


def sample() -> None:
    from srt.layers.sample_triton import BLOCK, CHUNK, _chunk_kernel, _pick_kernel

    for logits in ("fp32", "bf16"):
        ptrs = {"logits_ptr": logits, "temp_ptr": "fp32", "seed_ptr": "i64",
                "best_ptr": "fp32", "best_id_ptr": "i32", "top_ptr": "fp32",
                "top_id_ptr": "i32"}
        k = _compile(_chunk_kernel, ptrs, dict(CHUNK=CHUNK, BLOCK=BLOCK), 4)
        print(len(k.asm["cubin"]), k.asm["ptx"].count("mul.hi"))
    ptrs = {"best_ptr": "fp32", "best_id_ptr": "i32", "top_ptr": "fp32", "top_id_ptr": "i32",
            "temp_ptr": "fp32", "out_ptr": "i64"}
    k = _compile(_pick_kernel, ptrs, dict(CHUNKS=32), 1)
    print(len(k.asm["cubin"]), 0)


def fp8gemm() -> None:
    from srt.layers.fp8_gemm_triton import SUM_BLOCK, _fp8_splitk_kernel, _splitk_sum_kernel

    for bm, warps, split in ((128, 8, 4), (64, 4, 1)):
        ptrs = {"x_ptr": "fp8e4nv", "xs_ptr": "fp32", "w_ptr": "fp8e4nv", "s_ptr": "fp32",
                "out_ptr": "bf16", "part_ptr": "fp32"}
        k = _compile(_fp8_splitk_kernel, ptrs,
                     dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, DIRECT=split == 1, EVEN_K=True,
                          UPCAST=False), warps)
        ptx = k.asm["ptx"]
        print(len(k.asm["cubin"]), sum("wgmma.mma_async" in ln and "e4m3" in ln
                                       for ln in ptx.splitlines()))
    ptrs = {"part_ptr": "fp32", "xs_ptr": "fp32", "s_ptr": "fp32", "out_ptr": "bf16"}
    k = _compile(_splitk_sum_kernel, ptrs, dict(SPLIT_K=4, BLOCK=SUM_BLOCK), 4)
    print(len(k.asm["cubin"]), 0)


if __name__ == "__main__":
    if sys.argv[1] == "int4":
        int4(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    elif sys.argv[1] == "sample":
        sample()
    elif sys.argv[1] == "fp8gemm":
        fp8gemm()
    else:
        raise SystemExit(f"unknown kernel {sys.argv[1]!r}")
