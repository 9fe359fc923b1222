"""The batch object against a plain reference: a list of (request, row, KV length) kept by hand.

Hypothesis drives random sequences of merge / filter / remove (retraction) / decode steps with
random launch masks / the resolution of launched steps / a jump and the mixed step after it, and
after every operation the batch's requests, rows and KV lengths must equal the reference's, and
the step plans must hold the reference's positions, rows and sequence lengths.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from srt.layers.forward_batch import ForwardMode
from srt.model_process.batch import Batch
from srt.model_process.req import Req
from srt.sampling_params import SamplingParams

OPS = st.lists(st.tuples(st.sampled_from(["merge", "filter", "remove", "decode", "resolve",
                                          "jump"]),
                         st.integers(0, 2**31 - 1)), min_size=1, max_size=40)


class Reference:
    """Requests in order with their row and KV length (positions computed or in flight)."""

    def __init__(self) -> None:
        self.items: list[list] = []  # [req, row, kv_len]
        self.next_row = 0

    def new_req(self, rng: np.random.Generator) -> Req:
        prompt = rng.integers(0, 1000, size=int(rng.integers(1, 9))).tolist()
        r = Req(f"r{self.next_row}", prompt, SamplingParams(max_new_tokens=1000))
        r.output_ids = [int(rng.integers(0, 1000))]  # as after its fill
        r.req_pool_idx = self.next_row
        self.next_row += 1
        return r


def _agree(batch: Batch, ref: Reference) -> None:
    assert [id(r) for r in batch.reqs] == [id(x[0]) for x in ref.items]
    assert batch.rows.tolist() == [x[1] for x in ref.items]
    assert batch.kv_lens.tolist() == [x[2] for x in ref.items]
    batch.check()


@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_batch_matches_reference(ops: list[tuple[str, int]]) -> None:
    ref, batch = Reference(), Batch()
    launched: list[list[Req]] = []  # steps launched and not resolved, oldest first
    for op, seed in ops:
        rng = np.random.default_rng(seed)
        busy = {id(r) for step in launched for r in step}
        if op == "merge":
            new = [ref.new_req(rng) for _ in range(int(rng.integers(0, 5)))]
            batch.merge(Batch.of(new))
            ref.items += [[r, r.req_pool_idx, r.kv_len] for r in new]
        elif op in ("filter", "remove"):
            # only requests without a step in flight leave (the loop resolves first)
            drop = {id(x[0]) for x in ref.items
                    if id(x[0]) not in busy and rng.random() < 0.4}
            if op == "filter":
                gone = batch.filter(lambda r: id(r) not in drop)
                assert {id(r) for r in gone} == drop
            else:
                batch.remove([x[0] for x in ref.items if id(x[0]) in drop])
            ref.items = [x for x in ref.items if id(x[0]) not in drop]
        elif op == "decode" and ref.items and len(launched) < 2:
            mask = rng.random(len(ref.items)) < 0.8
            plan = batch.prepare_decode(torch.arange(int(mask.sum()), dtype=torch.int64), mask)
            want = [x for x, m in zip(ref.items, mask) if m]
            assert plan.mode == ForwardMode.DECODE and plan.input_ids is None
            assert [id(r) for r in plan.reqs] == [id(x[0]) for x in want]
            assert plan.positions.tolist() == [x[2] for x in want]
            assert plan.rows.tolist() == [x[1] for x in want]
            assert plan.seq_lens.tolist() == [x[2] + 1 for x in want]
            for x in want:
                x[2] += 1
                x[0].in_flight += 1  # what the executor does at launch
            launched.append(plan.reqs)
        elif op == "resolve" and launched:
            for r in launched.pop(0):  # what the loop does with the ids
                r.in_flight -= 1
                r.output_ids.append(int(rng.integers(0, 1000)))
        elif op == "jump" and ref.items and not launched:
            # a jump inside the batch: new ids after the valid KV, then the mixed step
            x = ref.items[int(rng.integers(0, len(ref.items)))]
            r = x[0]
            r.kv_valid = int(rng.integers(len(r.origin_input_ids) // 2, r.kv_len + 1))
            r.output_ids += rng.integers(0, 1000, size=int(rng.integers(0, 3))).tolist()
            extra = sum(y[0].step_input_len for y in ref.items)
            assert batch.mixed_rows() == extra
            want_pos: list[int] = []
            want_rows: list[int] = []
            want_last: list[int] = []
            for y in ref.items:
                start = y[0].kv_valid if y[0].kv_valid is not None else y[2]
                n = len(y[0].fill_ids) - start
                want_pos += list(range(start, start + n))
                want_rows += [y[1]] * n
                want_last.append(len(want_pos) - 1)
                y[2] = len(y[0].fill_ids)
            plan = batch.prepare_mixed(torch.arange(extra, dtype=torch.int64))
            assert plan.positions.tolist() == want_pos and plan.rows.tolist() == want_rows
            assert plan.seq_lens.tolist() == [p + 1 for p in want_pos]
            assert plan.sample_rows == want_last
            assert plan.req_rows.tolist() == [y[1] for y in ref.items]
            assert r.kv_valid is None
            for y in ref.items:  # resolved at once: the sampled id of each request
                y[0].output_ids.append(0)
        _agree(batch, ref)
