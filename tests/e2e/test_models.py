"""Each supported architecture besides Llama, served by the real server in float32 on a small
random checkpoint, gives transformers' greedy tokens, and prompt and output logprobs equal to its
log_softmax within 1e-4; Mixtral also under --tp-size 2 (gloo); Phi-3, Qwen2-MoE, Qwen3-MoE,
Gemma 2 / 3, DeepSeek-V2 (MLA) and sliding windows (Mistral's, Qwen2's on some layers) over
48 tokens at 1 and 2,
well past the window. An unsupported architecture is a clear start-up error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

from tests.conftest import REPO, ServerProcess
from tests.random_models import save_random_model

# 8 prompts of varied lengths (1 to 12 tokens)
PROMPTS = [[5 + i, 17, 99, 3, 42 + i, 7, 250, 31, 64, 11, 300, 8][:n]
           for i, n in enumerate([1, 2, 3, 5, 7, 9, 11, 12])]
NEW_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
WINDOW = 8  # sliding windows: most prompts and every 48-token output pass it
SMALL = dict(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=8,
             num_key_value_heads=4)

def gemma3_multimodal_config(**text: Any) -> Any:
    """Gemma 3's multimodal config around a text config of `text` and a one-layer vision
    tower (as the 4B-27B checkpoints are laid out)."""
    from transformers import Gemma3Config

    vocab = text["vocab_size"]
    return Gemma3Config(
        text_config=text, tie_word_embeddings=text.pop("tie_word_embeddings", True),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=vocab - 3, boi_token_index=vocab - 2,
        eoi_token_index=vocab - 1)


# architecture -> (transformers config class name or a builder, model class name, overrides)
MODELS: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "qwen2_tied": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=128)),
    # Qwen3-MoE: 4 experts (top 2, renormalized), q/k norm, a dense layer (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True, mlp_only_layers=[1])),
    # Qwen2-MoE: top-2 weights as softmax probabilities, a shared expert under its gate
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, norm_topk_prob=False)),
    # LongRoPE within the original context (the short factors) and its attention factor
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=1, max_position_embeddings=4096,
        original_max_position_embeddings=1024, rope_scaling={
            "type": "longrope", "short_factor": [1.0 + 0.3 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]})),
    # Qwen2 with its window on the layers from max_window_layers on (the second only)
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    # Gemma 2: a sliding layer then a global one, soft-capped scores and logits (caps small
    # enough to bite on random weights), query_pre_attn_scalar unlike head_dim
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    # Gemma 3 (text): q/k norms, the sliding layer's own rotary base, linear scaling on the
    # global one, untied LM head
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0}})),
    # DeepSeek-V2 (Lite's layout: no q LoRA): MLA with a latent of 32 + 16 rotary values,
    # YaRN, a dense first layer, then 4 routed experts (top 2, greedy) and a shared one
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=24, v_head_dim=20, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
        routed_scaling_factor=1.5, max_position_embeddings=4096,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 1024, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707})),
    # a latent wide enough (64 + 16 against 16 + 16 per head) that EXTEND steps of many new
    # tokens expand the cached latents (srt.models.deepseek_v2.expanded_extend_pays)
    "deepseek_v2_wide": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=8, q_lora_rank=None, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1)),
    # DeepSeek-V2's full layout: q LoRA, grouped routing (2 of 4 groups), two shared experts
    "deepseek_v2_qlora": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        num_key_value_heads=8, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=24, v_head_dim=20, n_routed_experts=8, n_shared_experts=2,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.0)),
    # DeepSeek-V3: sigmoid router with a correction bias (randomized below: transformers saves
    # zeros) choosing 2 of 8 experts in the best 2 of 4 groups, renormalized and scaled
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_key_value_heads=8, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=24, v_head_dim=20, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
        n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    # Gemma 3's multimodal layout (4B-27B), served for text
    "gemma3_mm": (gemma3_multimodal_config, "Gemma3ForConditionalGeneration", dict(
        head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention"])),
    # Phi-4-mini's shape: a partial rotary factor (12 of 16 dimensions rotate), tied embeddings
    "phi3_partial": ("Phi3Config", "Phi3ForCausalLM", dict(
        pad_token_id=0, bos_token_id=1, eos_token_id=1, partial_rotary_factor=0.75,
        tie_word_embeddings=True)),
}


TOL = 1e-4


@dataclass
class Reference:
    """transformers' greedy tokens per prompt, and log_softmax values: of each prompt token
    after the first, and of each greedy token."""

    greedy: list[list[int]]
    prompt_logprobs: list[list[float]]
    output_logprobs: list[list[float]]


def hf_reference(path: str, prompts: list[list[int]], n: int) -> Reference:
    """Greedy continuation by argmax of the full forward, n times (no eos stop)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = Reference([], [], [])
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(n):
                logits = model(torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)
            ref.greedy.append(seq[len(ids):])
            ref.prompt_logprobs.append([float(lp[p - 1, seq[p]]) for p in range(1, len(ids))])
            ref.output_logprobs.append(
                [float(lp[p - 1, seq[p]]) for p in range(len(ids), len(seq))])
    return ref


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: Any) -> Any:
    """name -> (path, transformers' reference), built on first use."""
    import transformers

    cache: dict[str, tuple[str, Reference]] = {}

    def get(name: str) -> tuple[str, Reference]:
        if name not in cache:
            cfg_cls, model_cls, overrides = MODELS[name]
            path = save_random_model(
                str(tmp_path_factory.mktemp(name)),
                cfg_cls if callable(cfg_cls) else getattr(transformers, cfg_cls),
                getattr(transformers, model_cls), random_vectors=True, **{**SMALL, **overrides})
            if name == "deepseek_v3":
                _randomize(path, ".e_score_correction_bias", 0.0, 0.5)
            cache[name] = (path, hf_reference(path, PROMPTS, NEW_TOKENS))
        return cache[name]

    return get


_REF48: dict[str, Reference] = {}  # transformers' 48 greedy steps, by checkpoint name


def _randomize(path: str, suffix: str, low: float, high: float) -> None:
    """Give the checkpoint's tensors named ...`suffix` uniform values in [low, high)."""
    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    g = torch.Generator().manual_seed(7)
    for name, t in tensors.items():
        if name.endswith(suffix):
            tensors[name] = torch.rand(t.shape, generator=g) * (high - low) + low
    save_file(tensors, file, metadata={"format": "pt"})


def start_fails(path: str, *extra: str) -> subprocess.CompletedProcess:
    """Run the server on `path` to its exit (for checkpoints it must refuse at start-up)."""
    return subprocess.run(
        [sys.executable, "-m", "srt.server", "--model-path", path, "--device", "cpu",
         "--port", "0", "--max-total-tokens", "256", *extra],
        cwd=REPO, capture_output=True, text=True, timeout=180,
        env=dict(os.environ, PYTHONPATH=REPO))


def _serve(path: str, *extra: str) -> ServerProcess:
    return ServerProcess(["--model-path", path, "--device", "cpu", "--dtype", "float32",
                          "--random-seed", "0", "--max-total-tokens", "512", *extra]).start()


def _check(srv: ServerProcess, ref: Reference, new: int = NEW_TOKENS) -> None:
    """Greedy tokens (`new` of them) equal transformers'; prompt and output logprobs within
    TOL."""
    res = srv.generate({"input_ids": PROMPTS, "sampling_params": {**GREEDY, "max_new_tokens": new},
                        "return_logprob": True, "logprob_start_len": 0})
    assert [r["output_ids"] for r in res] == ref.greedy
    for r, want_in, want_out in zip(res, ref.prompt_logprobs, ref.output_logprobs):
        got_in = r["meta_info"]["input_token_logprobs"]
        assert got_in[0][0] is None  # the first prompt token has no logprob
        assert [x[0] for x in got_in[1:]] == pytest.approx(want_in, abs=TOL)
        got_out = [x[0] for x in r["meta_info"]["output_token_logprobs"]]
        assert got_out == pytest.approx(want_out, abs=TOL)


@pytest.mark.parametrize("name", ["qwen2_tied", "qwen3", "mixtral"])
def test_greedy_equals_transformers(checkpoints: Any, name: str) -> None:
    path, expected = checkpoints(name)
    srv = _serve(path)
    try:
        _check(srv, expected)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


@pytest.mark.parametrize("name,flags", [
    ("phi3", []), ("phi3", ["--tp-size", "2"]), ("phi3_partial", ["--tp-size", "2"]),
    ("qwen3_moe", []), ("qwen3_moe", ["--tp-size", "2"]),
    ("qwen3_moe", ["--tp-size", "2", "--ep-size", "2"]),
    ("qwen2_moe", []), ("qwen2_moe", ["--tp-size", "2"]),
    ("qwen2_moe", ["--tp-size", "2", "--ep-size", "2"]),
    ("mistral", []), ("qwen2_window", ["--tp-size", "2"]),
    ("gemma2", []), ("gemma2", ["--tp-size", "2"]), ("gemma3", []), ("gemma3", ["--tp-size", "2"]),
    ("gemma3_mm", []),
    ("deepseek_v2", []), ("deepseek_v2", ["--tp-size", "2", "--ep-size", "2"]),
    ("deepseek_v2_qlora", ["--tp-size", "2"]), ("deepseek_v3", ["--tp-size", "2"]),
], ids=["phi3-tp1", "phi3-tp2", "phi3_partial-tp2", "qwen3_moe-tp1", "qwen3_moe-tp2",
        "qwen3_moe-ep2", "qwen2_moe-tp1", "qwen2_moe-tp2", "qwen2_moe-ep2", "mistral-tp1",
        "qwen2_window-tp2", "gemma2-tp1", "gemma2-tp2", "gemma3-tp1", "gemma3-tp2", "gemma3_mm-tp1",
        "deepseek_v2-tp1", "deepseek_v2-ep2", "deepseek_v2_qlora-tp2", "deepseek_v3-tp2"])
def test_48_steps_equal_transformers(checkpoints: Any, name: str, flags: list[str]) -> None:
    """Phi-3's fused qkv / gate_up checkpoints (split as they load, so each rank reads its
    shard), LongRoPE's short factors and attention factor, a partial rotary factor; Qwen3-MoE
    and Qwen2-MoE (experts sliced under TP, or whole experts split over the ranks with
    --ep-size; the shared expert and its gate): 48 greedy tokens and the logprobs of
    transformers, at --tp-size 1 and 2 (gloo)."""
    path, _ = checkpoints(name)
    if name not in _REF48:  # (shared by a model's --tp-size 1 and 2 cases)
        _REF48[name] = hf_reference(path, PROMPTS, 48)
    srv = _serve(path, *flags)
    try:
        _check(srv, _REF48[name], new=48)
        if "moe" in name or name == "deepseek_v2":  # 4 experts: 2 a rank with --ep-size 2
            info = srv.server_info()
            assert info["experts_per_rank"] == (2 if "--ep-size" in flags else 4), info
        srv.assert_kv_invariant()
    finally:
        srv.stop()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_deepseek_extends_over_expanded_prefixes_equal_transformers(checkpoints: Any,
                                                                    backend: str) -> None:
    """EXTEND steps that expand their cached latents into per-head keys and values: the next
    32-token chunks of an 80-token prompt (`--chunked-prefill-size 32`), and a second prompt
    whose first 63 tokens the radix cache holds; through the torch backend and the Triton
    kernels (in Triton's interpreter on the CPU). Prompt logprobs of every computed position
    and 8 greedy tokens equal transformers' (prefix latents halved fail it)."""
    import random

    from srt.models.deepseek_v2 import expanded_extend_pays

    # these steps take the expanded path on this checkpoint's shapes
    assert expanded_extend_pays([32], [32], 64, 16, 16, 16)
    assert expanded_extend_pays([64], [16], 64, 16, 16, 16)
    assert expanded_extend_pays([63], [31], 64, 16, 16, 16)
    rng = random.Random(3)
    first = [rng.randrange(3, 250) for _ in range(80)]
    second = first[:64] + [rng.randrange(3, 250) for _ in range(30)]
    path, _ = checkpoints("deepseek_v2_wide")
    ref = hf_reference(path, [first, second], NEW_TOKENS)
    srv = _serve(path, "--chunked-prefill-size", "32", "--attention-backend", backend)
    try:
        for k, (ids, start) in enumerate(((first, 0), (second, 64))):
            want_in = ref.prompt_logprobs[k][max(0, start - 1):]
            want_out = ref.output_logprobs[k]
            res = srv.generate({"input_ids": ids, "sampling_params": GREEDY,
                                "return_logprob": True, "logprob_start_len": start})
            assert res["output_ids"] == ref.greedy[k]
            got_in = [x[0] for x in res["meta_info"]["input_token_logprobs"]]
            if start == 0:
                assert got_in[0] is None
                got_in = got_in[1:]
            assert got_in == pytest.approx(want_in, abs=TOL)
            got_out = [x[0] for x in res["meta_info"]["output_token_logprobs"]]
            assert got_out == pytest.approx(want_out, abs=TOL)
        # (the logprob of position 64 needs position 63 computed: 63 cached)
        assert res["meta_info"]["cached_tokens"] == 63
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def test_mixtral_tp2_equals_transformers(checkpoints: Any) -> None:
    path, expected = checkpoints("mixtral")
    srv = _serve(path, "--tp-size", "2")
    try:
        assert srv.server_info()["tp_size"] == 2
        _check(srv, expected)
        srv.assert_kv_invariant()
    finally:
        srv.stop()


def test_unsupported_architecture_is_a_startup_error(checkpoints: Any,
                                                     tmp_path: Any) -> None:
    path, _ = checkpoints("qwen3")
    bad = str(tmp_path / "bad")
    shutil.copytree(path, bad)
    with open(os.path.join(bad, "config.json")) as f:
        cfg = json.load(f)
    cfg["architectures"] = ["FooForCausalLM"]
    with open(os.path.join(bad, "config.json"), "w") as f:
        json.dump(cfg, f)
    proc = start_fails(bad)
    assert proc.returncode != 0
    assert ("unsupported architecture 'FooForCausalLM'; supported: DeepseekV2ForCausalLM, "
            "DeepseekV3ForCausalLM, Gemma2ForCausalLM, "
            "Gemma3ForCausalLM, Gemma3ForConditionalGeneration, LlamaForCausalLM, "
            "LlavaForConditionalGeneration, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, "
            "Qwen2ForCausalLM, Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"
            ) in proc.stderr
