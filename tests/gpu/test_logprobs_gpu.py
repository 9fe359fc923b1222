"""On a GPU: prompt and output logprobs of the model process (float32, torch and triton attention,
a cached prefix included) equal transformers' log_softmax of its own logits."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu

VOCAB = 2048
TOL = 1e-3  # float32 on the GPU: other kernels, other summation orders than transformers
_rids = itertools.count()


def run(server: Any, prompts: list[list[int]], options: list[Any], new: int) -> list[Any]:
    """Step a ModelProcess until every request finished; the TokenOuts merged per request."""
    from srt.managers.io_struct import StepInput, TokenizedGenerateReq, TokenLogprobs

    rids = [f"r{next(_rids)}" for _ in prompts]
    step = StepInput(reqs=[
        TokenizedGenerateReq(rid, ids, {"temperature": 0.0, "max_new_tokens": new,
                                        "ignore_eos": True}, logprob=opt)
        for rid, ids, opt in zip(rids, prompts, options)])
    out = {rid: {"ids": [], "input": TokenLogprobs(), "output": TokenLogprobs()} for rid in rids}
    while True:
        res = server.step(step)
        step = StepInput()
        for o in res.token_out.outs if res.token_out is not None else []:
            out[o.rid]["ids"] += o.new_ids
            if o.input_logprobs is not None:
                out[o.rid]["input"].extend(o.input_logprobs)
            if o.output_logprobs is not None:
                out[o.rid]["output"].extend(o.output_logprobs)
        if not res.has_work:
            return [out[r] for r in rids]


def check(ref: Any, ids: list[int], first: int, lp: Any, k: int) -> None:
    assert lp.token_ids == ids[first : first + len(lp.token_ids)]
    for j, value in enumerate(lp.logprobs):
        p = first + j
        if p == 0:
            assert value is None
            continue
        row = ref[p - 1]
        assert value == pytest.approx(float(row[ids[p]]), abs=TOL)
        assert lp.top_logprobs[j] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_logprobs_equal_transformers(backend: str, tmp_path: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from srt.managers.io_struct import LogprobOptions
    from srt.model_process.loop import ModelProcess
    from srt.server_args import ServerArgs

    path = save_random_llama(str(tmp_path), dtype="float32", hidden_size=512,
                             intermediate_size=1024, num_attention_heads=8,
                             num_key_value_heads=2, vocab_size=VOCAB)
    args = ServerArgs(model_path=path, tokenizer_path=path, device="cuda", dtype="float32",
                      attention_backend=backend, max_total_tokens=16384, random_seed=0)
    server = ModelProcess(args, 0)
    rng = random.Random(1)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(n)] for n in (40, 200, 7)]
    options = [LogprobOptions(0, 5), None, LogprobOptions(-1, 3)]
    first = run(server, prompts, options, 12)
    # the prompts are cached now: ask again from position 30 of the first
    again = run(server, prompts[:1], [LogprobOptions(30, 2)], 4)[0]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for res, ids, opt in zip(first, prompts, options):
        full = ids + res["ids"]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([full]).cuda()).logits[0].float(), -1).cpu()
        assert res["ids"] == ref[len(ids) - 1 : -1].argmax(-1).tolist()
        if opt is None:
            assert res["output"].token_ids == [] and res["input"].token_ids == []
            continue
        if opt.logprob_start_len >= 0:
            assert len(res["input"].token_ids) == len(ids) - opt.logprob_start_len
            check(ref, full, opt.logprob_start_len, res["input"], opt.top_logprobs_num)
        check(ref, full, len(ids), res["output"], opt.top_logprobs_num)
        if res is first[0]:
            assert len(again["input"].token_ids) == len(ids) - 30
            check(ref, full, 30, again["input"], 2)
            check(ref, full, len(ids), again["output"], 2)
    s = server
    assert s.kv.pool.available_size() + s.kv.tree.evictable_size() == s.runner.max_total_num_tokens
