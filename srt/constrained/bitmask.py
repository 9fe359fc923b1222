"""Per-step masks from packed bitmasks (xgrammar, llguidance): int32 words, bit 1 = allowed."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Sequence

import numpy as np

from srt.constrained.grammar import MaskBuilder, Matcher

if TYPE_CHECKING:
    import torch


class BitmaskMatcher(Matcher):
    """A matcher that writes its allowed tokens as one row of a packed bitmask."""

    @abstractmethod
    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write row `row` of the int32 [bs, ceil(vocab / 32)] host tensor `bitmask`."""

    @classmethod
    def fill_bitmasks(cls, matchers: list["BitmaskMatcher"], bitmask: "torch.Tensor",
                      rows: list[int]) -> None:
        """Rows `rows` of `bitmask` for `matchers` (all of this class) at once; a backend with
        a batched fill overrides this (the default fills one row after the other)."""
        for m, row in zip(matchers, rows):
            m.fill_bitmask(bitmask, row)


class BitmaskMasks(MaskBuilder):
    """Packed int32 bitmasks (bit 1 = allowed) filled on the host into a reused (pinned on a
    GPU) buffer, copied non-blocking and unpacked to the forbidden bool mask on the device."""

    def __init__(self, vocab_size: int, device: "torch.device") -> None:
        import torch

        self.vocab_size = vocab_size
        self.device = device
        self.words = (vocab_size + 31) // 32
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)
        # [words] uint32: the bits of the vocabulary's tokens (the last word's tail is padding)
        self._in_vocab = np.full(self.words, 0xFFFFFFFF, dtype=np.uint32)
        if vocab_size % 32:
            self._in_vocab[-1] = (1 << (vocab_size % 32)) - 1
        # Two host buffers, alternated: the copy from one may still be in flight while the
        # next step fills the other.
        self._host: list[torch.Tensor] = []
        self._turn = 0

    def _buffer(self, bs: int) -> "torch.Tensor":
        import torch

        if not self._host or self._host[0].shape[0] < bs:
            n = max(bs, 2 * (self._host[0].shape[0] if self._host else 8))
            pin = self.device.type == "cuda"
            self._host = [torch.empty((n, self.words), dtype=torch.int32, pin_memory=pin)
                          for _ in range(2)]
        self._turn ^= 1
        return self._host[self._turn][:bs]

    def batch(self, matchers: list[Matcher | None],
              keep_out: Sequence[tuple[int, Sequence[int]]] = ()) -> "torch.Tensor":
        # min_new_tokens' ids are cleared in the packed rows on the host: no second mask on
        # the device and no merge
        buf = self._buffer(len(matchers))
        words = buf.numpy()
        groups: dict[type, tuple[list[BitmaskMatcher], list[int]]] = {}
        for i, m in enumerate(matchers):
            if m is None:
                words[i] = -1  # every bit set: nothing forbidden
            else:
                assert isinstance(m, BitmaskMatcher)
                ms, rows = groups.setdefault(type(m), ([], []))
                ms.append(m)
                rows.append(i)
        for cls, (ms, rows) in groups.items():
            cls.fill_bitmasks(ms, buf, rows)
        if keep_out:
            self._keep_out(words.view(np.uint32), keep_out)
        packed = buf.to(self.device, non_blocking=True)
        bits = (packed.unsqueeze(-1) >> self.shifts) & 1
        return bits.view(len(matchers), -1)[:, : self.vocab_size] == 0

    def matcher_mask(self, matchers: list[Matcher | None]) -> "torch.Tensor":
        return self.batch(matchers)

    def _keep_out(self, words: np.ndarray, keep_out: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Clear the bits of each (row, ids) in the packed [bs, words] uint32 `words`, in one
        numpy pass over the rows, except in a row it would leave no token of the vocabulary
        (that row stays the matcher's)."""
        rows = np.fromiter((i for i, _ in keep_out), dtype=np.int64, count=len(keep_out))
        at = [(k, t) for k, (_, ids) in enumerate(keep_out) for t in ids if t < self.vocab_size]
        if not at:
            return
        pos, ids = np.array(at, dtype=np.int64).T
        cleared = words[rows]
        np.bitwise_and.at(cleared, (pos, ids >> 5), ~(np.uint32(1) << (ids & 31).astype(np.uint32)))
        ok = (cleared & self._in_vocab).any(axis=1)
        words[rows[ok]] = cleared[ok]
