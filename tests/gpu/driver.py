"""Drive one model process's ModelProcess in this process (GPU tests), and compare greedy
streams position by position."""

from __future__ import annotations

import itertools
from typing import Any, Callable

NEW_TOKENS = 64
_rids = itertools.count()


class ModelProcessDriver:
    """One model process's ModelProcess, stepped in this process."""

    def __init__(self, model_dir: str, backend: str, dtype: str, **extra: Any) -> None:
        from srt.model_process.loop import ModelProcess
        from srt.server_args import ServerArgs

        # Few graph sizes: capture time adds to every start-up and the tests run small batches.
        extra = {"cuda_graph_max_bs": 16, **extra}
        args = ServerArgs(model_path=model_dir, tokenizer_path=model_dir, device="cuda",
                          dtype=dtype, attention_backend=backend, max_total_tokens=32768,
                          random_seed=0, **extra)
        self.server = ModelProcess(args, 0)

    def greedy(self, prompts: list[list[int]], max_new: list[int],
               lora_ids: list[int] | None = None) -> list[list[int]]:
        """`lora_ids`: each prompt's LoRA adapter (the model process's ids; 0: none)."""
        from srt.managers.io_struct import StepInput, TokenizedGenerateReq

        rids = [f"r{next(_rids)}" for _ in prompts]
        lora_ids = lora_ids or [0] * len(prompts)
        step = StepInput(reqs=[
            TokenizedGenerateReq(rid, ids, {"temperature": 0.0, "max_new_tokens": n,
                                            "ignore_eos": True}, lora_id=lora)
            for rid, ids, n, lora in zip(rids, prompts, max_new, lora_ids)])
        out: dict[str, list[int]] = {rid: [] for rid in rids}
        while True:
            res = self.server.step(step)
            step = StepInput()
            if res.token_out is not None:
                for o in res.token_out.outs:
                    out[o.rid].extend(o.new_ids)
            if not res.has_work:
                break
        s = self.server
        assert s.kv.pool.available_size() + s.kv.tree.evictable_size() == \
            s.runner.max_total_num_tokens
        return [out[r] for r in rids]


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


Greedy = Callable[[list[list[int]], list[int]], list[list[int]]]


def teacher_forced_agreement(engine: ModelProcessDriver | Greedy, prompts: list[list[int]],
                             ref: list[list[int]]) -> tuple[int, int]:
    """Positions where the engine's greedy token equals the reference given the reference
    prefix (`engine`: a driver, or any greedy(prompts, max_new) -> outputs function)."""
    greedy = engine.greedy if isinstance(engine, ModelProcessDriver) else engine
    same = 0
    pos = [0] * len(prompts)
    while True:
        todo = [i for i in range(len(prompts)) if pos[i] < NEW_TOKENS]
        if not todo:
            return same, NEW_TOKENS * len(prompts)
        outs = greedy([prompts[i] + ref[i][:pos[i]] for i in todo],
                             [NEW_TOKENS - pos[i] for i in todo])
        for i, out in zip(todo, outs):
            k = first_diff(out, ref[i][pos[i]:])
            same += k
            pos[i] += k + 1  # the diverging position counts as a miss


