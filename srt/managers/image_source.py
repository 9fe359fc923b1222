"""Where an image of a request comes from, and what the server allows.

`image_data` is base64 (plain, or a `data:image/...;base64,` URI) by default. A local path
(absolute, or a `file://` URI) is read only under `--allowed-local-media-path DIR`; an
`http(s)://` URL is fetched only with `--allow-image-urls`. Every source is bounded by
`--max-image-bytes`. Errors are `ImageError`, which the HTTP process answers with a 400 naming
the field. Blocking I/O: called from a worker thread, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import os
from dataclasses import dataclass

_URL_TIMEOUT_S = 10.0


class ImageError(ValueError):
    """An image that cannot be used; `code` says why (a 400 for the client)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ImagePolicy:
    max_bytes: int
    max_pixels: int
    allow_urls: bool = False
    allowed_local_dir: str | None = None  # None: no file access


def read_image_bytes(source: str, policy: ImagePolicy) -> bytes:
    """The bytes of the image file that `source` names or holds."""
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageError("an image data URI must be data:<type>;base64,<data>",
                             "image_not_decodable")
        return _b64(payload, policy)
    if source.startswith(("http://", "https://")):
        if not policy.allow_urls:
            raise ImageError("image URLs are not allowed on this server (start it with "
                             "--allow-image-urls)", "image_source_not_allowed")
        return _fetch(source, policy)
    if source.startswith("file://"):
        return _read_file(source[len("file://"):], policy)
    if source.startswith("/") and len(source) < 4096 and not _is_base64(source):
        return _read_file(source, policy)
    return _b64(source, policy)


def _is_base64(s: str) -> bool:
    try:
        base64.b64decode(s, validate=True)
        return True
    except (binascii.Error, ValueError):
        return False


def _b64(payload: str, policy: ImagePolicy) -> bytes:
    payload = "".join(payload.split())  # line breaks are common in pasted base64
    if len(payload) // 4 * 3 > policy.max_bytes:
        raise ImageError(f"the image is larger than {policy.max_bytes} bytes", "image_too_large")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image is neither valid base64 nor an allowed path or URL",
                         "image_not_decodable") from None
    if len(data) > policy.max_bytes:
        raise ImageError(f"the image is larger than {policy.max_bytes} bytes", "image_too_large")
    return data


def _read_file(path: str, policy: ImagePolicy) -> bytes:
    if policy.allowed_local_dir is None:
        raise ImageError("local image paths are not allowed on this server (start it with "
                         "--allowed-local-media-path DIR)", "image_source_not_allowed")
    # Resolve symlinks and '..' first, so neither can lead outside the allowed directory.
    root = os.path.realpath(policy.allowed_local_dir)
    real = os.path.realpath(path)
    if not os.path.isabs(path) or os.path.commonpath([root, real]) != root:
        raise ImageError("the image path is outside the allowed directory",
                         "image_source_not_allowed")
    try:
        with open(real, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError as e:
        raise ImageError(f"the image file cannot be read: {e.strerror}",
                         "image_not_found") from None
    if len(data) > policy.max_bytes:
        raise ImageError(f"the image is larger than {policy.max_bytes} bytes", "image_too_large")
    return data


def _fetch(url: str, policy: ImagePolicy) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=_URL_TIMEOUT_S) as resp:
            data = resp.read(policy.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ImageError(f"the image URL cannot be fetched: {e}", "image_fetch_failed") from None
    if len(data) > policy.max_bytes:
        raise ImageError(f"the image is larger than {policy.max_bytes} bytes", "image_too_large")
    return data
