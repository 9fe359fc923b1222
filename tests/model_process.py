"""Driving one model process (ModelProcess) in-process, without the router or HTTP."""

from __future__ import annotations

from typing import Any, Callable

from srt.managers.io_struct import StepInput, TokenizedGenerateReq, TokenOut
from srt.model_process.batch import VerifyRows
from srt.model_process.loop import ModelProcess
from srt.model_process.speculative import main_path
from srt.server_args import ServerArgs


def cpu_model_server(path: str, dummy: bool = False, **args: Any) -> ModelProcess:
    """Rank 0 of a float32 CPU server (torch attention unless `attention_backend` is given),
    seed 0 and no warm-up."""
    args = {"attention_backend": "torch", **args}
    return ModelProcess(ServerArgs(
        model_path=path, tokenizer_path=path, load_format="dummy" if dummy else "auto",
        dtype="float32", device="cpu", random_seed=0, skip_warmup=True, **args), 0, None)


def serve_all(server: ModelProcess, reqs: list[TokenizedGenerateReq],
              max_rounds: int = 10_000,
              after_step: Callable[[ModelProcess], None] | None = None
              ) -> dict[str, list[TokenOut]]:
    """Step until nothing runs or waits; every request's outputs in order (the last one carries
    its finish reason). `after_step` is called after every round."""
    outs: dict[str, list[TokenOut]] = {r.rid: [] for r in reqs}
    out = server.step(StepInput(reqs=reqs))
    for _ in range(max_rounds):
        if out.token_out is not None:
            for t in out.token_out.outs:
                outs[t.rid].append(t)
        if after_step is not None:
            after_step(server)
        if not out.has_work and not (server.running or server.waiting):
            break
        out = server.step(StepInput())
    unfinished = [rid for rid, o in outs.items() if not o or o[-1].finish_reason is None]
    assert not unfinished, unfinished
    return outs


def kv_is_free(server: ModelProcess) -> bool:
    """Every slot free or evictable, no tree lock, every req_to_token row free."""
    return server.kv.is_free()


def branch_counter(monkeypatch: Any) -> dict[str, int]:
    """Counts, over verification steps and their requests (observed on the real VerifyRows):
    the drafts that branch (`trees`), the accepted paths, and those that left the main path."""
    seen = {"trees": 0, "paths": 0, "off_main": 0}
    original = VerifyRows.accepted

    def accepted(self: VerifyRows, ids: list[int], i: int) -> list[int]:
        path = original(self, ids, i)
        seen["trees"] += len(main_path(self.parents[i])) < len(self.drafts[i])
        if path:
            seen["paths"] += 1
            seen["off_main"] += path != main_path(self.parents[i])[: len(path)]
        return path

    monkeypatch.setattr(VerifyRows, "accepted", accepted)
    return seen
