"""Tensor parallelism over NCCL (needs two GPUs; skipped otherwise): a small random Llama served
with --tp-size 2 gives the greedy tokens of --tp-size 1 (float32), and each rank holds half the
KV heads."""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import ServerProcess
from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def two_gpus() -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")


def test_nccl_tp2_equals_tp1(two_gpus: None, tmp_path: Any) -> None:
    model = save_random_llama(str(tmp_path), num_hidden_layers=4, hidden_size=1024,
                              intermediate_size=2048, num_attention_heads=16,
                              num_key_value_heads=4, vocab_size=2048)
    prompts = [[(7 * i + 13 * j) % 2000 + 2 for j in range(10 + 9 * i)] for i in range(8)]
    params = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
    outs, pools = {}, {}
    for tp in (1, 2):
        srv = ServerProcess(["--model-path", model, "--device", "cuda", "--dtype", "float32",
                             "--attention-backend", "triton", "--tp-size", str(tp),
                             "--max-total-tokens", "8192", "--random-seed", "0"]).start()
        try:
            res = srv.generate({"input_ids": prompts, "sampling_params": params})
            outs[tp] = [r["output_ids"] for r in res]
            pools[tp] = srv.server_info()["kv_pool_per_rank"]
            srv.assert_kv_invariant()
        finally:
            srv.stop()
    same = sum(a == b for o1, o2 in zip(outs[1], outs[2]) for a, b in zip(o1, o2))
    assert same / (32 * len(prompts)) >= 0.95, same
    assert pools[1]["kv_heads"] == 4 and pools[2]["kv_heads"] == 2
