"""The obvious alternative as a baseline: transformers' continuous batching (`generate_batch`) on
a model of the same shape with random weights, on the same device and dtype."""

from __future__ import annotations

import inspect
import time
from typing import Any

import torch

from benchmarks.common import SHAPES, default_device

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def build_hf_model(shape: str, dtype: str, device: str) -> Any:
    """A LlamaForCausalLM of `shape` with transformers' random initialization, built on the
    device (drawing 8B weights on the CPU would take minutes)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=1,
                      pad_token_id=0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(_DTYPES[dtype])
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def _generate_batch(model: Any, prompts: list[list[int]], out_len: int) -> list[Any]:
    from transformers import GenerationConfig

    # eos_token_id -1: no EOS, every request runs out_len tokens (srt's ignore_eos).
    gc = GenerationConfig(max_new_tokens=out_len, do_sample=True, temperature=0.6, top_k=0,
                          top_p=1.0, eos_token_id=-1, pad_token_id=0)
    kwargs: dict[str, Any] = {}
    if "progress_bar" in inspect.signature(model.generate_batch).parameters:
        kwargs["progress_bar"] = False
    out = model.generate_batch(inputs=prompts, generation_config=gc, **kwargs)
    return list(out.values())


def run_hf_generate_batch(shape: str, prompts: list[list[int]], out_len: int,
                          dtype: str = "bfloat16", device: str | None = None) -> dict[str, Any]:
    """Output tokens per second of `generate_batch` on `prompts` (after a small warm-up call);
    the wall time includes whatever set-up transformers does inside the call."""
    device = device or default_device()
    model = build_hf_model(shape, dtype, device)
    _generate_batch(model, [p[:16] for p in prompts[:2]], 4)  # warm-up: kernels, allocator
    t = time.perf_counter()
    results = _generate_batch(model, prompts, out_len)
    wall = time.perf_counter() - t
    tokens = sum(len(r.generated_tokens) for r in results)
    failed = sum(1 for r in results if getattr(r, "error", None))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"requests": len(results), "failed": failed, "output_tokens": tokens, "wall_s": wall,
            "out_tok_per_s": tokens / wall}
