"""StepInputBuilder: the five integer inputs of a step, each at a 128-byte aligned offset."""

import random

import pytest
import torch

from srt.model_process.step_inputs import StepInputBuilder


@pytest.mark.parametrize("t,bs", [(1, 1), (7, 3), (16, 16), (33, 5), (1000, 17)])
def test_values_and_alignment(t: int, bs: int) -> None:
    rng = random.Random(t * 31 + bs)
    ids = [rng.randrange(50000) for _ in range(t)]
    pos = [rng.randrange(4096) for _ in range(t)]
    loc = torch.tensor([rng.randrange(10**6) for _ in range(t)], dtype=torch.int64)
    rows = [rng.randrange(512) for _ in range(bs)]
    lens = [rng.randrange(1, 4096) for _ in range(bs)]
    out = StepInputBuilder(torch.device("cpu")).build(ids, pos, loc, rows, lens)
    assert out.input_ids.tolist() == ids and out.positions.tolist() == pos
    assert out.out_cache_loc.tolist() == loc.tolist()
    assert out.req_pool_indices.tolist() == rows and out.seq_lens.tolist() == lens
    base = out.input_ids.data_ptr()
    for v in (out.positions, out.out_cache_loc, out.req_pool_indices, out.seq_lens):
        assert (v.data_ptr() - base) % 128 == 0
        assert v.dtype == torch.int64 and v.is_contiguous()
