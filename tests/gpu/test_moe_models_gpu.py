"""The mixture-of-experts and latent-attention models through their GPU kernels (GPU only): the
one-kernel router, the one-launch pair layout, the fused MoE GEMMs and MLA's input kernel, in
decode CUDA graphs and eager fills, in float32 on the Triton backend; greedy tokens equal to
transformers' (float32, CPU) on the small random checkpoints of tests/e2e/test_models.py."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.test_models import MODELS, PROMPTS, SMALL, _randomize, hf_reference
from tests.gpu.driver import ModelProcessDriver
from tests.random_models import save_random_model

pytestmark = pytest.mark.gpu
NEW = 16


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe", "deepseek_v2",
                                  "deepseek_v2_qlora", "deepseek_v3"])
def test_moe_models_on_gpu_kernels_equal_transformers(name: str, tmp_path: Any) -> None:
    import transformers

    cfg_cls, model_cls, overrides = MODELS[name]
    path = save_random_model(str(tmp_path), getattr(transformers, cfg_cls),
                             getattr(transformers, model_cls), random_vectors=True,
                             **{**SMALL, **overrides})
    if name == "deepseek_v3":
        _randomize(path, ".e_score_correction_bias", 0.0, 0.5)
    ref = hf_reference(path, PROMPTS, NEW)
    srt = ModelProcessDriver(path, "triton", "float32", cuda_graph_max_bs=8)
    assert srt.server.runner.graph_runner is not None
    got = srt.greedy(PROMPTS, [NEW] * len(PROMPTS))
    same = sum(a == b for g, r in zip(got, ref.greedy) for a, b in zip(g, r))
    print(f"{name}: {same}/{NEW * len(PROMPTS)} greedy tokens equal to transformers")
    assert got == ref.greedy
