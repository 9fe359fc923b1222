"""Start-up warm-up: a few requests served before the model process reports ready."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from srt.managers.io_struct import StepInput, TokenizedGenerateReq

if TYPE_CHECKING:
    from srt.model_process.loop import ModelProcess

logger = logging.getLogger(__name__)

# The cached prefix of the warm-up's EXTEND rounds over many new tokens
EXPAND_PREFIX = 8


def warm_up(p: ModelProcess) -> None:
    """Serve a few requests before reporting ready, so that the kernels of the fill paths (a
    PREFILL batch of three prompts, then an EXTEND batch with and without a cached prefix; odd
    and even token counts; then two EXTEND steps of many new tokens over a short cached
    prefix), of sampling and of decode steps are compiled and loaded now rather
    than inside the first users' requests (a fill otherwise pays seconds of Triton
    compilation), then the fused MoE kernel's larger tile sizes, which only fills of a few
    hundred tokens or more take (`warm_up_experts`). Every rank runs the same requests; the
    cache, the random generator and the statistics are reset afterwards."""
    # Small enough for any pool and context that can serve anything at all.
    n = min(96, p.kv.pool.size // 8, p.config.context_len - 8)
    if n < 8:
        return
    t = time.perf_counter()
    rng_state = p.rng.getstate()
    vocab = p.config.vocab_size

    def ids(mult: int, length: int) -> list[int]:
        return [(mult * i + mult) % vocab for i in range(length)]

    # the warm-up's fills take the eager path they exist to compile (short fills can take
    # the decode graphs, PREFILL steps the prefill graphs, which need nothing compiled)
    graph_fill, p.graph_fill.off = p.graph_fill.off, True
    prefill_graphs, p.runner.prefill_graphs = p.runner.prefill_graphs, None
    embedding = p.args.is_embedding  # (no decode steps then)
    # the first round samples under top-p (the torch sequence), the second at a temperature
    # alone (on a GPU the one-pass sampling kernel, `srt/layers/sample_triton.py`)
    params = [{"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 0 if embedding else 3,
               "ignore_eos": True}, {"temperature": 0.7, "max_new_tokens": 0 if embedding else 3,
                                    "ignore_eos": True}]
    first = ids(7, n)
    rounds = [[first, ids(11, n // 2 + 1), ids(13, n // 3)],          # PREFILL, 3 prompts
              [first[: n // 2] + ids(17, n // 4 + 1), ids(19, n // 5)]]  # EXTEND, mixed
    # EXTEND steps of many new tokens over a short cached prefix (a multiple of 16 new tokens,
    # then one fewer): the steps MLA models compute over expanded latents (a chunked prompt's
    # next chunk; `deepseek_v2.expanded_extend_pays`), whose kernels the round above, with
    # few new tokens a cached one, does not compile
    new = (n - EXPAND_PREFIX) // 16 * 16
    if new >= 48:
        rounds += [[first[:EXPAND_PREFIX] + ids(23, new), ids(29, n // 48 * 16)],
                   [first[:EXPAND_PREFIX] + ids(31, new - 1)]]
    params += [params[1]] * (len(rounds) - len(params))
    for k, prompts in enumerate(rounds):
        reqs = [TokenizedGenerateReq(f"warmup-{k}-{i}", x, dict(params[k]))
                for i, x in enumerate(prompts)]
        p.step(StepInput(reqs=reqs))
        for _ in range(100):
            if not (p.waiting or p.running):
                break
            p.step(StepInput())
        else:
            raise RuntimeError("warm-up requests did not finish in 100 rounds")
    warm = None if embedding else getattr(p.runner.attn_backend, "warm_up_eager_decode", None)
    if warm is not None:
        warm(p.kv.req_pool.req_to_token, *p.kv.pool.get_kv_buffer(0))
    moe_layers = warm_up_experts(p.runner.model, p.runner.dtype)
    p.graph_fill.off = graph_fill
    p.runner.prefill_graphs = prefill_graphs
    p.kv.tree.reset()
    p.rng.setstate(rng_state)
    p.arrivals = 0
    p.reset_stats()
    logger.info("warm-up requests served in %.2f s%s", time.perf_counter() - t,
                f" (the fused MoE's tile sizes compiled for {moe_layers} expert shape(s))"
                if moe_layers else "")


def warm_up_experts(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Compile the fused MoE kernel's every tile configuration (`FusedMoE.warm_up`) once per
    distinct expert shape of `model`: the warm-up's small fills take only the decode-sized
    tiles, and a fill of a few hundred tokens or more would otherwise compile the larger ones
    (seconds) while users wait. Returns the number of shapes compiled for."""
    from srt.layers.moe import FusedMoE

    seen: set[tuple] = set()
    for m in model.modules():
        if not isinstance(m, FusedMoE):
            continue
        key = (tuple(m.w13_weight.shape), tuple(m.w2_weight.shape), m.w13_weight.dtype,
               m.top_k, m.fp8)
        if key not in seen and m.warm_up(dtype):
            seen.add(key)
    return len(seen)
