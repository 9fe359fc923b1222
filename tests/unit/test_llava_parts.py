"""LLaVA's parts on the CPU: our image preprocessing against transformers' CLIPImageProcessor
(Pillow backend), our vision tower + projector against transformers' image features, weight
loading from each checkpoint layout, the image sources the policy allows, and the pad ids and
prefix-cache rules of an image span."""

from __future__ import annotations

import base64
import io
import os
from typing import Any

import numpy as np
import pytest
import torch

from srt.managers.image_processor import ClipPreprocessConfig, image_hash, preprocess
from srt.managers.image_source import ImageError, ImagePolicy, read_image_bytes
from srt.managers.io_struct import ImageInput
from srt.model_process.image_pads import MIN_IMAGE_MATCH, ReqImage, pad_ids


def _image(seed: int, w: int, h: int, mode: str) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    a = (rng.random((h, w, 4)) * 255).astype(np.uint8)
    if mode == "RGBA":
        return Image.fromarray(a, "RGBA")
    if mode == "L":
        return Image.fromarray(a[..., 0], "L")
    if mode == "P":
        return Image.fromarray(a[..., :3], "RGB").convert("P")
    return Image.fromarray(a[..., :3], "RGB")


def _hf_processor(**kwargs: Any) -> Any:
    import transformers

    cls = getattr(transformers, "CLIPImageProcessorPil", transformers.CLIPImageProcessor)
    return cls(**kwargs)


@pytest.mark.parametrize("size,crop", [(56, 56), (224, 224), (40, 48), (336, 336)])
@pytest.mark.parametrize("w,h,mode", [(70, 40, "RGB"), (37, 90, "RGB"), (20, 15, "RGB"),
                                      (64, 64, "L"), (50, 80, "RGBA"), (61, 33, "P")])
def test_preprocess_equals_clip_image_processor(size: int, crop: int, w: int, h: int,
                                                mode: str) -> None:
    img = _image(w * h, w, h, mode)
    hf = _hf_processor(size={"shortest_edge": size}, crop_size={"height": crop, "width": crop})
    want = hf(images=img, return_tensors="np")["pixel_values"][0]
    cfg = ClipPreprocessConfig.from_dict(hf.to_dict())
    got = preprocess(img, cfg)
    assert got.shape == want.shape == (3, crop, crop)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def test_image_hash_follows_pixels_not_encoding() -> None:
    a = np.random.default_rng(0).random((3, 4, 4)).astype(np.float32)
    assert image_hash(a) == image_hash(a.copy())
    b = a.copy()
    b[0, 0, 0] += 1e-3
    assert image_hash(a) != image_hash(b)
    assert image_hash(a) != image_hash(a.reshape(3, 2, 8))


# ---------------------------------------------------------------------- vision tower


@pytest.fixture(scope="module")
def tp1() -> None:
    from srt.layers import parallel_state

    parallel_state.init_tp_group(0, 1, torch.device("cpu"), None)


def _hf_llava(layer: Any, strategy: str) -> Any:
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    from transformers import LlavaForConditionalGeneration as HF

    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, image_size=42, patch_size=14)
    text = LlamaConfig(hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    cfg = LlavaConfig(vision_config=vision.to_dict(), text_config=text.to_dict(),
                      image_token_index=299, vision_feature_layer=layer,
                      vision_feature_select_strategy=strategy)
    torch.manual_seed(0)
    model = HF(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.08 + (1.0 if "norm" in name and p.dim() == 1 else 0))
    return model


def _ours(hf: Any, weights: dict[str, torch.Tensor]) -> Any:
    from srt.models.llava import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration(hf.config, 256)
    model.load_weights(weights.items())
    return model


@pytest.mark.parametrize("layer,strategy", [(-2, "default"), (-1, "full"), ([-3, -2], "default")])
def test_image_features_equal_transformers(tp1: None, layer: Any, strategy: str) -> None:
    hf = _hf_llava(layer, strategy)
    ours = _ours(hf, hf.state_dict())
    pixels = torch.randn(2, 3, 42, 42)
    with torch.no_grad():
        out = hf.model.get_image_features(pixels, vision_feature_layer=layer,
                                          vision_feature_select_strategy=strategy)
        want = torch.stack(list(getattr(out, "pooler_output", out)))
        got = ours.image_features(pixels)
    assert got.shape == want.shape == (2, 9 + (strategy == "full"), 48)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _rename(weights: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Our canonical parts -> a checkpoint layout's names."""
    from srt.models.llava import split_checkpoint_name

    out = {}
    for name, t in weights.items():
        part, inner = split_checkpoint_name(name)
        if layout == "4.52":  # model.language_model.*, lm_head.*, model.vision_tower.vision_model.*
            if part == "language_model":
                key = inner if inner.startswith("lm_head.") else \
                    "model.language_model." + inner.removeprefix("model.")
            elif part == "vision_tower":
                key = "model.vision_tower.vision_model." + inner
            else:
                key = "model.multi_modal_projector." + inner
        else:  # older files: language_model.model.*, vision_tower.vision_model.*
            key = {"language_model": "language_model.", "multi_modal_projector":
                   "multi_modal_projector.", "vision_tower": "vision_tower.vision_model."}[part]
            key += inner
        out[key] = t
    return out


@pytest.mark.parametrize("layout", ["4.52", "old"])
def test_checkpoint_layouts_load_the_same(tp1: None, tmp_path: Any, layout: str) -> None:
    from safetensors.torch import load_file

    hf = _hf_llava(-2, "default")
    hf.save_pretrained(str(tmp_path))
    saved = load_file(os.path.join(tmp_path, "model.safetensors"))
    a = dict(_ours(hf, saved).named_parameters())
    b = dict(_ours(hf, _rename(saved, layout)).named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    with pytest.raises(ValueError, match="unexpected weight"):
        _ours(hf, {**saved, "vision_tower.bogus.weight": torch.zeros(1)})
    missing = {k: v for k, v in saved.items() if "linear_2" not in k}
    with pytest.raises(ValueError, match="missing"):
        _ours(hf, missing)


# ---------------------------------------------------------------------- sources


def _png() -> bytes:
    buf = io.BytesIO()
    _image(1, 8, 8, "RGB").save(buf, "PNG")
    return buf.getvalue()


def test_image_sources_and_policy(tmp_path: Any) -> None:
    data = _png()
    default = ImagePolicy(max_bytes=10_000, max_pixels=1000)
    assert read_image_bytes(base64.b64encode(data).decode(), default) == data
    assert read_image_bytes("data:image/png;base64," + base64.b64encode(data).decode(),
                            default) == data
    f = tmp_path / "a.png"
    f.write_bytes(data)
    for source in (str(f), "file://" + str(f), "https://example.com/a.png"):
        with pytest.raises(ImageError) as e:
            read_image_bytes(source, default)
        assert e.value.code == "image_source_not_allowed"
    allowed = ImagePolicy(10_000, 1000, allowed_local_dir=str(tmp_path))
    assert read_image_bytes(str(f), allowed) == data
    small = ImagePolicy(len(data) - 1, 1000, allowed_local_dir=str(tmp_path))
    for source in (str(f), base64.b64encode(data).decode()):
        with pytest.raises(ImageError) as e:
            read_image_bytes(source, small)
        assert e.value.code == "image_too_large"


# ---------------------------------------------------------------------- pad ids


def test_pad_ids_are_valid_deterministic_and_distinct() -> None:
    h1, h2 = "ab" * 32, "cd" * 32
    a = pad_ids(h1, 576, 32064, 32000)
    assert a == pad_ids(h1, 576, 32064, 32000)
    assert a[0] == 32000 and all(0 <= t < 32064 for t in a)
    assert len(set(a)) > 500
    b = pad_ids(h2, 576, 32064, 32000)
    assert a[1:MIN_IMAGE_MATCH] != b[1:MIN_IMAGE_MATCH]


def test_image_span_cache_rules() -> None:
    image = ImageInput(np.zeros((3, 2, 2), "<f4").tobytes(), [3, 2, 2], "00" * 32)
    ids, req_image = ReqImage.expand_prompt([5, 6, 99, 7], image, 99, 16, 100)
    assert len(ids) == 3 + 16 and ids[:2] == [5, 6] and ids[2] == 99 and ids[-1] == 7
    assert (req_image.offset, req_image.length) == (2, 16)
    assert req_image.pixel_values.shape == (3, 2, 2)
    # a match ending inside the span keeps at least MIN_IMAGE_MATCH positions of it
    assert req_image.safe_prefix_len(2) == 2
    assert req_image.safe_prefix_len(2 + MIN_IMAGE_MATCH - 1) == 2
    assert req_image.safe_prefix_len(2 + MIN_IMAGE_MATCH) == 2 + MIN_IMAGE_MATCH
    assert req_image.safe_prefix_len(18) == 18
    # the step's part of the image: all, a tail, or nothing
    full = req_image.step_span(0, 19, row_offset=7)
    assert (full.row_start, full.feature_start, full.count) == (9, 0, 16)
    tail = req_image.step_span(10, 9, row_offset=0)
    assert (tail.row_start, tail.feature_start, tail.count) == (0, 8, 8)
    assert req_image.step_span(18, 1, row_offset=0) is None
