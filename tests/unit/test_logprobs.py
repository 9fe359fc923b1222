"""Logprob rows on the device (srt.layers.logprobs) and the per-step plan of the model process
(srt.model_process.logprob_step), against torch's log_softmax on random logits."""

from __future__ import annotations

import pytest
import torch

from srt.layers.forward_batch import ForwardMode
from srt.layers.logprobs import row_width, write_logprob_rows
from srt.managers.io_struct import LogprobOptions
from srt.model_process.req import Req
from srt.model_process.logprob_step import StepLogprobs, prefix_limit
from srt.sampling_params import SamplingParams

CPU = torch.device("cpu")


def random_logits(n: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * 4 + torch.linspace(-3, 3, vocab)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_rows_equal_torch_log_softmax(k: int) -> None:
    logits = random_logits(7, 300, seed=k)
    next_ids = torch.tensor([0, 299, 5, 17, 5, 123, 42])
    # the rows are a view in the middle of a poisoned buffer: every entry of the view is written
    # and nothing around it is touched
    buf = torch.full((3 + 7 * row_width(k) + 3,), float("nan"), dtype=torch.float64)
    out = buf[3 : 3 + 7 * row_width(k)].view(7, row_width(k))
    write_logprob_rows(logits, next_ids, k, out)
    assert not out.isnan().any()
    assert buf[:3].isnan().all() and buf[-3:].isnan().all()
    ref = torch.log_softmax(logits.double(), dim=-1)
    torch.testing.assert_close(out[:, 0], ref[torch.arange(7), next_ids], rtol=0, atol=1e-5)
    if k:
        values, ids = ref.topk(k, dim=-1)
        torch.testing.assert_close(out[:, 1 : 1 + k], values, rtol=0, atol=1e-5)
        assert torch.equal(out[:, 1 + k :].long(), ids)
        assert (out[:, 1 + k :] == out[:, 1 + k :].round()).all()  # exact integers


def test_rows_from_half_precision_logits_are_computed_in_float32() -> None:
    logits = random_logits(3, 64, seed=9).to(torch.bfloat16)
    out = torch.full((3, row_width(2)), float("nan"), dtype=torch.float64)
    write_logprob_rows(logits, torch.tensor([1, 2, 3]), 2, out)
    ref = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(out[:, 0].float(), ref[torch.arange(3), torch.tensor([1, 2, 3])])


def req(prompt: list[int], logprob: LogprobOptions | None, out: list[int] | None = None) -> Req:
    return Req("r", list(prompt), SamplingParams(), output_ids=list(out or []), logprob=logprob)


def test_prefix_limit_keeps_asked_positions_out_of_the_cache() -> None:
    prompt = list(range(10, 20))
    assert prefix_limit(req(prompt, None)) == 9
    assert prefix_limit(req(prompt, LogprobOptions())) == 9  # output logprobs only
    assert prefix_limit(req(prompt, LogprobOptions(logprob_start_len=0))) == 0
    assert prefix_limit(req(prompt, LogprobOptions(logprob_start_len=1))) == 0
    assert prefix_limit(req(prompt, LogprobOptions(logprob_start_len=6))) == 5
    done = req(prompt, LogprobOptions(logprob_start_len=0), out=[3, 4])
    done.prompt_logprobs_done = True  # computed at the first fill: a re-fill may use the cache
    assert prefix_limit(done) == 11


def _simulate_step(batch: list[Req], prefix_lens: list[int], vocab: int, seed: int):
    """What the model process does around one EXTEND forward, with random per-position logits
    standing in for the model: returns (the plan's results, the logits of every new position)."""
    ext_lens = [len(r.fill_ids) - p for r, p in zip(batch, prefix_lens)]
    all_logits = random_logits(sum(ext_lens), vocab, seed)
    mode = ForwardMode.EXTEND if any(prefix_lens) else ForwardMode.PREFILL
    step = StepLogprobs(batch, mode, prefix_lens, ext_lens, CPU)
    step.buffer.fill_(float("nan"))  # poison: everything read back must have been written
    if step.prompt_request is not None:  # the logits processor's part
        pr = step.prompt_request
        write_logprob_rows(all_logits[pr.rows], pr.next_ids, pr.top_k, pr.out)
    ends = torch.tensor(ext_lens).cumsum(0) - 1
    last = all_logits[ends]
    sampled = last.argmax(-1)
    step.launch(last, sampled)
    return step.collect(), all_logits, ext_lens, sampled


def test_step_plan_maps_rows_to_prompt_positions() -> None:
    vocab = 50
    a = req([1, 2, 3, 4, 5, 6], LogprobOptions(logprob_start_len=0, top_logprobs_num=3))
    b = req([7, 8, 9], None)  # asks nothing, shares the batch
    c = req([10, 11, 12, 13, 14, 15, 16], LogprobOptions(logprob_start_len=4, top_logprobs_num=1))
    d = req([20, 21, 22, 23], LogprobOptions(top_logprobs_num=2))  # output logprobs only
    e = req([30], LogprobOptions(logprob_start_len=0))  # one-token prompt: only the None entry
    batch = [a, b, c, d, e]
    prefix = [0, 1, 3, 2, 0]  # c: its cache match was cut to logprob_start_len - 1
    (ids, inputs, outputs), all_logits, ext_lens, sampled = _simulate_step(batch, prefix, vocab, 1)
    ref = torch.log_softmax(all_logits.double(), dim=-1)
    assert ids == sampled.tolist()
    offsets = [sum(ext_lens[:i]) for i in range(len(batch))]

    def pos_row(i: int, p: int) -> int:  # the new-token row whose logits predict token p
        return offsets[i] + (p - 1 - prefix[i])

    # a: every prompt token, the first without a logprob
    lp = inputs[0]
    assert lp.token_ids == a.origin_input_ids
    assert lp.logprobs[0] is None and lp.top_logprobs[0] is None and lp.top_ids[0] is None
    for p in range(1, 6):
        row = ref[pos_row(0, p)]
        assert lp.logprobs[p] == pytest.approx(float(row[a.origin_input_ids[p]]), abs=1e-5)
        values, top = row.topk(3)
        assert lp.top_ids[p] == top.tolist()
        assert lp.top_logprobs[p] == pytest.approx(values.tolist(), abs=1e-5)
    # c: tokens 4.. only, its own k (1) although the batch's widest is 3
    lp = inputs[2]
    assert lp.token_ids == [14, 15, 16]
    for j, p in enumerate(range(4, 7)):
        row = ref[pos_row(2, p)]
        assert lp.logprobs[j] == pytest.approx(float(row[c.origin_input_ids[p]]), abs=1e-5)
        assert lp.top_ids[j] == [int(row.argmax())]
    assert inputs[1] is None and inputs[3] is None  # no prompt logprobs asked
    assert inputs[4].token_ids == [30] and inputs[4].logprobs == [None]
    # outputs: the sampled token of every request that set logprob options
    assert outputs[1] is None
    for i in (0, 2, 3, 4):
        row = ref[offsets[i] + ext_lens[i] - 1]
        out = outputs[i]
        assert out.token_ids == [ids[i]]
        assert out.logprobs[0] == pytest.approx(float(row[ids[i]]), abs=1e-5)
        values, top = row.topk(batch[i].logprob.top_logprobs_num)
        assert out.top_ids[0] == top.tolist()  # [] where top_logprobs_num is 0
        assert out.top_logprobs[0] == pytest.approx(values.tolist(), abs=1e-5)


def test_step_plan_refuses_a_cached_asked_position() -> None:
    a = req([1, 2, 3, 4], LogprobOptions(logprob_start_len=2))
    with pytest.raises(RuntimeError, match="cached"):
        StepLogprobs([a], ForwardMode.EXTEND, [2], [2], CPU)


def test_decode_step_has_output_rows_only() -> None:
    a = req([1, 2], LogprobOptions(logprob_start_len=0, top_logprobs_num=2), out=[3])
    a.prompt_logprobs_done = True
    b = req([4, 5], None, out=[6])
    step = StepLogprobs([a, b], ForwardMode.DECODE, [2, 2], [1, 1], CPU)
    assert step.prompt_request is None
    logits = random_logits(2, 40, seed=3)
    step.launch(logits, torch.tensor([7, 8]))
    ids, inputs, outputs = step.collect()
    assert ids == [7, 8] and inputs == [None, None] and outputs[1] is None
    ref = torch.log_softmax(logits.double(), dim=-1)
    assert outputs[0].logprobs == pytest.approx([float(ref[0, 7])], abs=1e-5)
    assert outputs[0].top_ids == [ref[0].topk(2).indices.tolist()]
