"""Small random checkpoints saved with transformers, for tests that need a model but not a real one."""

from __future__ import annotations

import os
from typing import Any


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer over tokens "t0".."t{n-1}" plus specials (eos id 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(path)


SMALL_CONFIG: dict[str, Any] = dict(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=1, pad_token_id=0)


def save_random_model(path: str, config_cls: Any, model_cls: Any, dtype: str = "float32",
                      seed: int = 0, init_std: float = 0.08, random_vectors: bool = False,
                      **overrides: Any) -> str:
    """A random `model_cls(config_cls(**SMALL_CONFIG | overrides))` and a word tokenizer saved
    under `path`; returns `path`.

    init_std: the normal std of every matrix (and stacked expert tensor). 0.08 makes greedy tokens
    far from near-ties in float32; in bf16 such large weights make the network chaotic (measured
    on CPU with transformers, 4 layers, hidden 1024: bf16 argmax equals float32 argmax at 80% of
    positions with 0.08, 96% with 0.02, 98% with 0.015), so bf16 comparisons use a small std.
    random_vectors: biases N(0, init_std) and norm weights 1 + N(0, 0.2) instead of HF's zeros
    and ones, so that loading them wrongly changes the tokens."""
    import torch

    cfg = {**SMALL_CONFIG, **overrides}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).to(getattr(torch, dtype))
    # Larger weights than the default init so greedy tokens are not dominated by near-ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)
        if random_vectors:
            for name, p in model.named_parameters():
                if p.dim() == 1 and "norm" in name:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
                elif p.dim() == 1:
                    p.normal_(0.0, init_std)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    save_word_tokenizer(path, cfg["vocab_size"])
    return path


def save_random_llama(path: str, dtype: str = "float32", seed: int = 0, init_std: float = 0.08,
                      **overrides: Any) -> str:
    """A random LlamaForCausalLM (and a tokenizer) saved under `path`; see save_random_model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_random_model(path, LlamaConfig, LlamaForCausalLM, dtype, seed, init_std,
                             **overrides)


IMAGE_TOKEN = "<image>"


def save_random_llava(path: str, tokenizer_dir: str, seed: int = 0, init_std: float = 0.08,
                      image_size: int = 56, patch_size: int = 14,
                      vision_feature_select_strategy: str = "default") -> str:
    """A small random LlavaForConditionalGeneration (CLIP vision tower, projector, Llama) saved
    under `path` with the tokenizer of `tokenizer_dir` plus an added `<image>` token and a
    CLIP image processor config (shortest edge and crop = image_size); returns `path`.

    Weights as in save_random_model (matrices N(0, init_std); biases N(0, init_std) and norm
    weights 1 + N(0, 0.2)), so that a loading mistake anywhere changes the tokens."""
    import torch
    from transformers import (AutoTokenizer, CLIPImageProcessor, CLIPVisionConfig, LlamaConfig,
                              LlavaConfig, LlavaForConditionalGeneration)

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens([IMAGE_TOKEN], special_tokens=True)
    image_token_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
    text = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tok),
                       max_position_embeddings=1024, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=image_size,
                              patch_size=patch_size, projection_dim=32)
    config = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                         image_token_index=image_token_id, vision_feature_layer=-2,
                         vision_feature_select_strategy=vision_feature_select_strategy,
                         image_seq_length=(image_size // patch_size) ** 2)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, init_std)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, init_std)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}
                       ).save_pretrained(path)
    return path
