"""Image preprocessing in the HTTP process: decode (Pillow), then CLIP's resize, center crop,
rescale and normalize, as transformers' CLIPImageProcessor does with its Pillow backend; and the
image hash the scheduler turns into pad token ids.

No torch here: the result is a float32 numpy array [3, height, width] sent on as bytes.
The settings come from the model's `preprocessor_config.json` (or the `image_processor` entry of
`processor_config.json`).
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from srt.managers.image_source import ImageError, ImagePolicy, read_image_bytes
from srt.managers.io_struct import ImageInput
from srt.server_args import ServerArgs

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3


@dataclass(frozen=True)
class ClipPreprocessConfig:
    """The CLIPImageProcessor settings. Resize: to `shortest_edge` on the short side (aspect
    kept), or to exactly `resize_hw`; then a center crop to `crop_hw`."""

    shortest_edge: int | None = 224
    resize_hw: tuple[int, int] | None = None
    crop_hw: tuple[int, int] = (224, 224)
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = _CLIP_MEAN
    image_std: tuple[float, float, float] = _CLIP_STD
    resample: int = _BICUBIC  # a PIL resampling filter
    do_convert_rgb: bool = True

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ClipPreprocessConfig":
        size = d.get("size", {"shortest_edge": 224})
        shortest, resize_hw = None, None
        if isinstance(size, int):
            shortest = size
        elif "shortest_edge" in size:
            shortest = int(size["shortest_edge"])
        elif "height" in size and "width" in size:
            resize_hw = (int(size["height"]), int(size["width"]))
        else:
            raise ValueError(f"unsupported image processor size {size!r}")
        crop = d.get("crop_size", {"height": 224, "width": 224})
        crop_hw = (crop, crop) if isinstance(crop, int) else (int(crop["height"]),
                                                                int(crop["width"]))
        return cls(
            shortest_edge=shortest, resize_hw=resize_hw, crop_hw=crop_hw,
            do_resize=bool(d.get("do_resize", True)),
            do_center_crop=bool(d.get("do_center_crop", True)),
            do_rescale=bool(d.get("do_rescale", True)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            do_normalize=bool(d.get("do_normalize", True)),
            image_mean=tuple(d.get("image_mean", _CLIP_MEAN)),
            image_std=tuple(d.get("image_std", _CLIP_STD)),
            resample=int(d.get("resample", _BICUBIC)),
            do_convert_rgb=bool(d.get("do_convert_rgb", True)),
        )

    @classmethod
    def from_model_dir(cls, path: str) -> "ClipPreprocessConfig":
        """From preprocessor_config.json, else processor_config.json's image_processor."""
        pre = os.path.join(path, "preprocessor_config.json")
        if os.path.exists(pre):
            with open(pre) as f:
                return cls.from_dict(json.load(f))
        proc = os.path.join(path, "processor_config.json")
        if os.path.exists(proc):
            with open(proc) as f:
                d = json.load(f)
            if isinstance(d.get("image_processor"), dict):
                return cls.from_dict(d["image_processor"])
        raise ValueError(f"{path} has no preprocessor_config.json: the image preprocessing "
                         "(size, crop, mean, std) is unknown")

    def output_hw(self) -> tuple[int, int]:
        """(height, width) of every preprocessed image."""
        if self.do_center_crop:
            return self.crop_hw
        if self.resize_hw is not None:
            return self.resize_hw
        raise ValueError("without a center crop, images of different shapes would have "
                         "different sizes; only a crop to a fixed size is supported")


def decode_image(data: bytes, max_pixels: int) -> Any:
    """Bytes of an image file -> a loaded PIL image. ImageError when Pillow cannot read it or it
    has more than max_pixels pixels (checked from the header, before decoding the pixels)."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(data))
        pixels = img.size[0] * img.size[1]
        if pixels > max_pixels:
            raise ImageError(f"the image has {img.size[0]}x{img.size[1]} = {pixels} pixels, "
                             f"more than the {max_pixels} allowed", "image_too_many_pixels")
        img.load()
    except Image.DecompressionBombError as e:
        raise ImageError(f"the image has too many pixels: {e}", "image_too_many_pixels") from None
    except ImageError:
        raise
    except Exception as e:  # Pillow raises many types for corrupt or unknown data
        raise ImageError(f"the image cannot be decoded: {e}", "image_not_decodable") from None
    return img


def _to_rgb(img: Any) -> Any:
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        # Transparent pixels become white, as CLIPImageProcessor does.
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def _resize_hw(h: int, w: int, cfg: ClipPreprocessConfig) -> tuple[int, int]:
    if cfg.resize_hw is not None:
        return cfg.resize_hw
    assert cfg.shortest_edge is not None
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = cfg.shortest_edge, int(cfg.shortest_edge * long / short)
    return (new_long, new_short) if w <= h else (new_short, new_long)


def _center_crop(a: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """[C, H, W] -> [C, h, w] around the center; zero padding where the image is smaller."""
    _, h, w = a.shape
    ch, cw = hw
    if h < ch or w < cw:
        ph, pw = max(ch, h), max(cw, w)
        padded = np.zeros(a.shape[:1] + (ph, pw), dtype=a.dtype)
        top, left = -(-(ph - h) // 2), -(-(pw - w) // 2)  # ceil: the extra row goes on top
        padded[:, top : top + h, left : left + w] = a
        a, h, w = padded, ph, pw
    top, left = (h - ch) // 2, (w - cw) // 2
    return a[:, top : top + ch, left : left + cw]


def preprocess(img: Any, cfg: ClipPreprocessConfig) -> np.ndarray:
    """A PIL image -> float32 [3, height, width] as the vision tower takes it."""
    if cfg.do_convert_rgb:
        img = _to_rgb(img)
    if cfg.do_resize:
        h, w = _resize_hw(img.height, img.width, cfg)
        img = img.resize((w, h), resample=cfg.resample)
    a = np.asarray(img)
    a = a[None] if a.ndim == 2 else np.moveaxis(a, -1, 0)
    if cfg.do_center_crop:
        a = _center_crop(a, cfg.crop_hw)
    if cfg.do_rescale:
        a = (a.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    if cfg.do_normalize:
        a = a.astype(np.float32)
        mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(cfg.image_std, dtype=np.float32)[:, None, None]
        a = (a - mean) / std
    return np.ascontiguousarray(a, dtype=np.float32)


def image_hash(pixels: np.ndarray) -> str:
    """Hex SHA-256 of a preprocessed image (shape and values): equal pixels, equal hash,
    whatever file or encoding they came from."""
    h = hashlib.sha256(repr(pixels.shape).encode())
    h.update(np.ascontiguousarray(pixels, dtype="<f4").tobytes())
    return h.hexdigest()


def to_image_input(pixels: np.ndarray) -> ImageInput:
    data = np.ascontiguousarray(pixels, dtype="<f4")
    return ImageInput(data.tobytes(), list(data.shape), image_hash(data))


def load_image(source: str, policy: ImagePolicy, cfg: ClipPreprocessConfig) -> ImageInput:
    """Read, decode, preprocess and hash one image (blocking: run it on a worker thread).
    ImageError for anything the client must fix."""
    img = decode_image(read_image_bytes(source, policy), policy.max_pixels)
    return to_image_input(preprocess(img, cfg))


# Decoding and resizing are mostly C code that releases the GIL: a few threads keep several
# images in flight without holding up the event loop.
_IMAGE_WORKERS = 2


@dataclass
class ImageLoader:
    """The HTTP process's image pipeline: the server's policy, the model's preprocessing and
    the worker threads that run `load_image`."""

    policy: ImagePolicy
    config: ClipPreprocessConfig
    executor: ThreadPoolExecutor

    @classmethod
    def create(cls, args: ServerArgs, image_size: int) -> "ImageLoader":
        """ValueError when the model directory has no usable preprocessing config, or its
        output size is not what the vision tower takes."""
        cfg = ClipPreprocessConfig.from_model_dir(args.model_path or "")
        if cfg.output_hw() != (image_size, image_size):
            raise ValueError(f"the image processor makes {cfg.output_hw()} images but the vision "
                             f"tower takes {image_size}x{image_size}")
        policy = ImagePolicy(args.max_image_bytes, args.max_image_pixels, args.allow_image_urls,
                             args.allowed_local_media_path)
        return cls(policy, cfg, ThreadPoolExecutor(_IMAGE_WORKERS, "srt-image"))

    async def load(self, source: str) -> ImageInput:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, load_image, source, self.policy,
                                          self.config)
