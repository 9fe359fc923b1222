"""The interface every grammar backend implements (outlines-core, xgrammar, llguidance).

A request's constraint (`ConstraintSpec`: a regex, a JSON schema or an EBNF grammar) is compiled
once per process into a `CompiledGrammar`, shared read-only by every request with the same
constraint. Each request then walks it with its own `Matcher`. Per decode step, a `MaskBuilder`
turns the batch's matchers into one forbidden-token mask on the device.

Imports nothing heavy: the HTTP process loads this to validate constraints.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Sequence

if TYPE_CHECKING:
    import torch

ConstraintKind = Literal["regex", "json_schema", "ebnf"]

_SERIALS = itertools.count()


def next_serial() -> int:
    """A number unique per compiled grammar in this process (device mask rows are keyed by it)."""
    return next(_SERIALS)


@dataclass(frozen=True)
class ConstraintSpec:
    """One request's constraint: `kind` is also the name of the sampling parameter it came from
    (the `param` of a 400); `text` is the regex, the compact JSON schema or the grammar."""

    kind: ConstraintKind
    text: str

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.text}"


class GrammarError(ValueError):
    """A constraint the backend refuses (invalid, unsupported keyword, too large, admits no
    output). The message is for the client."""


class Matcher(ABC):
    """One request's position in a compiled grammar. Owned by one request, used by one thread.

    Contract: `accept` advances by one token or returns False and leaves the state unchanged;
    `rollback(n)` undoes the last n accepted tokens (any n up to the number accepted);
    `fork` copies the state (the copy's accept/rollback never affect this one). Stop tokens
    (EOS) are not accepted here: the caller ends the request when one is sampled.
    """

    @abstractmethod
    def is_stop_token(self, token: int) -> bool:
        """The token ends the output (the grammar's EOS)."""

    @abstractmethod
    def accept(self, token: int) -> bool: ...

    @abstractmethod
    def rollback(self, n: int) -> None: ...

    @abstractmethod
    def fork(self) -> "Matcher": ...

    @abstractmethod
    def is_dead_end(self) -> bool:
        """The output is complete and nothing but a stop token may follow."""

    @classmethod
    def prefetch(cls, matchers: list["Matcher"]) -> None:
        """Get ready for `is_dead_end` and the next mask of each of `matchers` (all of this
        class, after a step's tokens were accepted) at once, e.g. their mask rows on several
        threads. The default does nothing: each matcher answers on its own."""

    @abstractmethod
    def forced_bytes(self) -> bytes:
        """Bytes every continuation starts with: b"" where the output may end here or there is a
        choice now. Used by jump-forward."""


class CompiledGrammar(ABC):
    """A compiled constraint, shared read-only by every request that uses it."""

    serial: int  # unique in this process
    size: int  # in the backend's unit (`GrammarBackend.size_unit`), for the size limit

    @abstractmethod
    def matcher(self) -> Matcher:
        """A matcher at the start of the grammar."""

    @abstractmethod
    def admits_output(self) -> bool:
        """Some non-empty output (or an immediate end) is allowed from the start."""


class MaskBuilder(ABC):
    """Builds the batch's forbidden-token mask, once per step, on the model's device."""

    def batch(self, matchers: list[Matcher | None],
              keep_out: Sequence[tuple[int, Sequence[int]]] = ()) -> "torch.Tensor":
        """[bs, vocab] bool on the device, True where a token is forbidden: what each row's
        matcher forbids (nothing for rows without one), and for each (row, ids) of `keep_out`
        (min_new_tokens keeping stop tokens out) those ids too, unless that leaves the row no
        token: then the matcher's rule alone (the pattern is the harder rule). Copies are
        non-blocking: the forward in flight is not waited for."""
        from srt.constrained.mask import keep_out_mask, merge_forbidden

        mask = self.matcher_mask(matchers)
        if not keep_out:
            return mask
        return merge_forbidden(
            keep_out_mask(keep_out, len(matchers), mask.shape[-1], mask.device), mask)

    @abstractmethod
    def matcher_mask(self, matchers: list[Matcher | None]) -> "torch.Tensor":
        """`batch` without `keep_out`."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer, in the background, with an LRU cache.

    `compile(spec)` never blocks: it returns a Future of a `CompiledGrammar`, failed with a
    GrammarError for a constraint the backend refuses (checked before compiling, so unsupported
    JSON-Schema keywords never reach the compiler). The same spec gets the same future while it
    is cached; a failed compile is not cached.
    """

    name: str
    size_unit: str  # what `CompiledGrammar.size` counts, for the 400 message

    @abstractmethod
    def compile(self, spec: ConstraintSpec) -> Future: ...

    @abstractmethod
    def mask_builder(self, vocab_size: int, device: "torch.device") -> MaskBuilder: ...

    def max_size(self, args: object) -> int:
        """The largest `CompiledGrammar.size` accepted under the server's arguments."""
        return int(getattr(args, "constrained_max_states"))


def failed(error: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(error)
    return fut
