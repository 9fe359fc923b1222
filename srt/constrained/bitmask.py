"""Per-step masks from packed bitmasks (xgrammar, llguidance): int32 words, bit 1 = allowed."""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

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

    def batch(self, matchers: list[Matcher | None]) -> "torch.Tensor":
        buf = self._buffer(len(matchers))
        groups: dict[type, tuple[list[BitmaskMatcher], list[int]]] = {}
        for i, m in enumerate(matchers):
            if m is None:
                buf[i].fill_(-1)  # every bit set: nothing forbidden
            else:
                assert isinstance(m, BitmaskMatcher)
                ms, rows = groups.setdefault(type(m), ([], []))
                ms.append(m)
                rows.append(i)
        for cls, (ms, rows) in groups.items():
            cls.fill_bitmasks(ms, buf, rows)
        packed = buf.to(self.device, non_blocking=True)
        bits = (packed.unsqueeze(-1) >> self.shifts) & 1
        return bits.view(len(matchers), -1)[:, : self.vocab_size] == 0
