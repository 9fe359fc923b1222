"""What one forward pass needs to know besides the token ids, scoped by a `with` block.

The model runner builds a `ForwardBatch` once per step and enters `forward_context(fb)`; the
attention layers read it with `get_forward_batch()`. Nothing threads it through layer signatures
and nothing sets a global by hand.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import torch

if TYPE_CHECKING:
    from srt.layers.logprobs import PromptLogprobRequest
    from srt.memory_pool import ReqToTokenPool, TokenToKVPool


class ForwardMode(enum.Enum):
    PREFILL = enum.auto()  # no request in the batch has a cached prefix
    EXTEND = enum.auto()  # only the uncached suffix is computed; the prefix is read from the pool
    DECODE = enum.auto()  # one new token per request

    def is_extend(self) -> bool:
        """PREFILL is the special case of EXTEND with every prefix empty."""
        return self in (ForwardMode.PREFILL, ForwardMode.EXTEND)


@dataclass(frozen=True)
class ImageSpanInput:
    """The part of one image that an extend step computes: the image's projected features
    `feature_start .. feature_start + count - 1` replace the embeddings of the step's new tokens
    `row_start .. row_start + count - 1` (rows of `input_ids`). Positions of the image that the
    prefix cache already holds are not part of the step and need no features."""

    pixel_values: torch.Tensor  # [channels, height, width], preprocessed, on the host
    row_start: int
    feature_start: int
    count: int


@dataclass
class ForwardBatch:
    """Inputs of one forward pass. Tensors are on the model's device unless named *_cpu.

    input_ids, positions, out_cache_loc: one entry per new token (sum of extend_lens, or batch size
    in DECODE). seq_lens = prefix_lens + extend_lens per request (DECODE: the length including the
    new token). req_pool_indices select the requests' rows of req_to_token.
    """

    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "TokenToKVPool"
    attn_backend: Any  # srt.layers.attention.AttentionBackend
    # Per-step metadata the backend computed in init_forward_metadata.
    attn_metadata: Any = None
    # EXTEND/PREFILL only: prompt positions whose logprobs the logits processor writes (None: no
    # request asked, and no extra work is done).
    prompt_logprobs: "PromptLogprobRequest | None" = None
    # EXTEND/PREFILL only: image features to write over new tokens' embeddings (None: no image).
    images: list[ImageSpanInput] | None = None
    # DECODE only: the first shared_prefix_len context positions of every request are the same
    # pool slots (a prefix they all matched in the radix cache); 0 when none or not computed.
    shared_prefix_len: int = 0
    # EXTEND only (a mixed step): the last decode_tail requests each compute one token at the
    # end of their context (decode rows riding in a fill step); a backend that sets
    # `supports_decode_tail` may compute them as DECODE rows. 0: every request is an extend.
    decode_tail: int = 0
    # An EAGLE draft head's step only: the features of each row (the target's hidden states,
    # or the head's own from the draft step before).
    spec_hidden: torch.Tensor | None = None
    # EXTEND/PREFILL only: the rows whose logits the forward returns, one per request (device;
    # None: each request's last new token, from extend_lens_cpu). Set by the prefill graphs,
    # whose requests' lengths are not known when the graph is captured.
    sample_rows: torch.Tensor | None = None
    # The step's rows that use LoRA adapters, grouped by pool slot (srt.lora.layers.
    # LoraBatchInfo); None: no row uses one.
    lora: Any = None
    # EXTEND only: the pool slots of every request's cached prefix, packed by request in
    # position order; set by the first layer that reads them (MLA's expanded EXTEND), None
    # until then.
    prefix_slots: torch.Tensor | None = None


_current: list[ForwardBatch] = []


@contextlib.contextmanager
def forward_context(fb: ForwardBatch) -> Iterator[ForwardBatch]:
    _current.append(fb)
    try:
        yield fb
    finally:
        _current.pop()


def current_lora() -> Any:
    """The LoRA grouping of the step being computed (None: none, or outside a step)."""
    return _current[-1].lora if _current else None


def get_forward_batch() -> ForwardBatch:
    if not _current:
        raise RuntimeError("attention called outside forward_context()")
    return _current[-1]
