"""Multi-LoRA on the GPU (Triton SGMV kernels): a float32 random Llama and 3 random adapters
(ranks 8 and 16, all seven projections), requests of the base model and every adapter mixed in
one batch, 2 pool slots (so adapters are swapped in and out). Greedy tokens with CUDA graphs
equal those without, and each adapter's tokens agree with the base model with the adapter merged
into its weights (teacher-forced; float32, so only near-ties may differ)."""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

from tests.gpu.driver import NEW_TOKENS, ModelProcessDriver, teacher_forced_agreement
from tests.random_models import save_random_llama

pytestmark = pytest.mark.gpu
VOCAB = 2048
DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
            num_hidden_layers=2, vocab_size=VOCAB)
MODULES = {"q_proj": (256, 256), "k_proj": (256, 64), "v_proj": (256, 64), "o_proj": (256, 256),
           "gate_proj": (256, 512), "up_proj": (256, 512), "down_proj": (512, 256)}
RANKS = [8, 16, 8]


def _write(base: str, root: str) -> tuple[list[str], list[str]]:
    """The adapters (PEFT layout) and, for each, the base checkpoint with it merged in."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(base, "model.safetensors"))
    adapters, merged = [], []
    for k, rank in enumerate(RANKS):
        g = torch.Generator().manual_seed(10 + k)
        lora, full = {}, dict(weights)
        for layer in range(DIMS["num_hidden_layers"]):
            for m, (fan_in, fan_out) in MODULES.items():
                part = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                name = f"model.layers.{layer}.{part}.{m}"
                a = torch.randn(rank, fan_in, generator=g) * 0.1
                b = torch.randn(fan_out, rank, generator=g) * 0.1
                lora[f"base_model.model.{name}.lora_A.weight"] = a
                lora[f"base_model.model.{name}.lora_B.weight"] = b
                full[f"{name}.weight"] = weights[f"{name}.weight"] + 2.0 * (b @ a)  # alpha 2r
        d = os.path.join(root, f"adapter{k}")
        os.makedirs(d)
        save_file(lora, os.path.join(d, "adapter_model.safetensors"))
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
                   "target_modules": list(MODULES)}, open(os.path.join(d, "adapter_config.json"),
                                                          "w"))
        m = shutil.copytree(base, os.path.join(root, f"merged{k}"))
        save_file(full, os.path.join(m, "model.safetensors"), metadata={"format": "pt"})
        adapters.append(d)
        merged.append(m)
    return adapters, merged


def test_lora_graphs_equal_eager_and_merged(tmp_path: Any) -> None:
    base = save_random_llama(str(tmp_path / "base"), dtype="float32", **DIMS)
    adapters, merged = _write(base, str(tmp_path))
    rng = random.Random(2)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randrange(8, 120))]
               for _ in range(11)]
    ids = [k % 4 for k in range(11)]  # 0: the base model, 1-3: the adapters
    lora = dict(lora_paths=tuple(f"a{k}={p}" for k, p in enumerate(adapters)),
                enable_lora=True, max_loras_per_batch=2, max_lora_rank=16,
                lora_target_modules=tuple(MODULES))
    graphs = ModelProcessDriver(base, "triton", "float32", cuda_graph_max_bs=8, **lora)
    assert graphs.server.runner.graph_runner is not None
    eager = ModelProcessDriver(base, "triton", "float32", disable_cuda_graph=True, **lora)
    lens = [NEW_TOKENS - 3 * i for i in range(11)]
    want = eager.greedy(prompts, lens, ids)
    assert graphs.greedy(prompts, lens, ids) == want
    for k in range(1, 4):  # each adapter against its merged weights
        mine = [i for i in range(11) if ids[i] == k]
        ref = ModelProcessDriver(merged[k - 1], "triton", "float32", disable_cuda_graph=True)
        ref_out = ref.greedy([prompts[i] for i in mine], [NEW_TOKENS] * len(mine))
        same, total = teacher_forced_agreement(
            lambda p, n, k=k: graphs.greedy(p, n, [k] * len(p)), [prompts[i] for i in mine],
            ref_out)
        assert same >= 0.97 * total, (k, same, total)
    base_ref = ModelProcessDriver(base, "triton", "float32", disable_cuda_graph=True)
    assert base_ref.greedy([prompts[0]], [NEW_TOKENS]) != \
        ModelProcessDriver(merged[0], "triton", "float32",
                           disable_cuda_graph=True).greedy([prompts[0]], [NEW_TOKENS])
