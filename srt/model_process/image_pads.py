"""A request's image inside the model process: the pad ids that stand for it in the prompt,
what the prefix cache may share of it, and the part of it an extend step computes.

The prompt holds the image token once; it is replaced by one pad id per position the image
fills. The pad ids are valid token ids (below the vocabulary size) derived from the image's
hash: the same image always gets the same ids, so the radix cache matches its whole span, and
different images get different ids. The first pad id is the image token itself, which a prompt
without an image can never hold (the HTTP process refuses it), so text never shares KV with an
image position. Two different images share that first id; a match that ends inside an image's
span must therefore cover at least MIN_IMAGE_MATCH of its positions (the chance that two images
agree on the next MIN_IMAGE_MATCH - 1 hashed ids is vocab^-(MIN_IMAGE_MATCH - 1)), else it is
cut back to the start of the span.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from srt.layers.forward_batch import ImageSpanInput
from srt.managers.io_struct import ImageInput

MIN_IMAGE_MATCH = 4


def pad_ids(image_hash: str, length: int, vocab_size: int, image_token_id: int) -> list[int]:
    """`length` token ids for an image: the image token, then ids drawn from the hash."""
    stream = hashlib.shake_256(bytes.fromhex(image_hash)).digest(4 * (length - 1))
    drawn = [int.from_bytes(stream[4 * i : 4 * i + 4], "little") % vocab_size
             for i in range(length - 1)]
    return [image_token_id, *drawn]


@dataclass(frozen=True)
class ReqImage:
    """A request's image: its pixels (on the host) and the prompt positions
    offset .. offset + length - 1 that its features fill."""

    pixel_values: torch.Tensor
    offset: int
    length: int

    @classmethod
    def expand_prompt(cls, input_ids: list[int], image: ImageInput, image_token_id: int,
                      length: int, vocab_size: int) -> tuple[list[int], "ReqImage"]:
        """The prompt with its image token replaced by the pad ids, and the image."""
        offset = input_ids.index(image_token_id)
        pads = pad_ids(image.hash, length, vocab_size, image_token_id)
        pixels = torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32)
        ids = input_ids[:offset] + pads + input_ids[offset + 1 :]
        return ids, cls(pixels.reshape(image.shape), offset, length)

    def safe_prefix_len(self, matched: int) -> int:
        """How much of a cached prefix of `matched` tokens may be used (see the module
        docstring): all of it, unless it ends inside the span having covered fewer than
        MIN_IMAGE_MATCH of its positions."""
        covered = matched - self.offset
        if 0 < covered < min(MIN_IMAGE_MATCH, self.length):
            return self.offset
        return matched

    def step_span(self, prefix_len: int, extend_len: int, row_offset: int
                  ) -> ImageSpanInput | None:
        """The part of the image an extend step computes: the step covers prompt positions
        prefix_len .. prefix_len + extend_len - 1, its rows start at row_offset in the batch.
        None when no image position is computed (all cached, or past the prompt)."""
        start = max(self.offset, prefix_len)
        end = min(self.offset + self.length, prefix_len + extend_len)
        if start >= end:
            return None
        return ImageSpanInput(self.pixel_values, row_offset + start - prefix_len,
                              start - self.offset, end - start)
