"""The HTTP process's table of LoRA adapters: names to the ids the model processes know them by.

Ids are never reused (0 is the base model), so a request, a cached prefix or a pool slot of an
unloaded adapter can never be taken for a later adapter of the same name. A name is `loading`
from the load call until every rank answered and `unloading` from the unload call until they
answered: a request naming it meanwhile is refused, so an adapter is never unloaded under a
request that asked for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from srt.lora.args import LoraSpec
from srt.managers.request_types import RequestError


@dataclass
class LoraRef:
    lora_id: int
    name: str
    path: str
    state: str = "ready"  # loading | ready | unloading


class LoraRegistry:
    def __init__(self, enabled: bool, specs: list[LoraSpec], max_loaded: int | None) -> None:
        """`specs`: the adapters the model processes load at start-up, ids 1, 2, ..."""
        self.enabled = enabled
        self.max_loaded = max_loaded
        self.refs: dict[str, LoraRef] = {
            s.name: LoraRef(i + 1, s.name, s.path) for i, s in enumerate(specs)}
        self._next_id = len(specs) + 1

    def ready(self) -> list[LoraRef]:
        return [r for r in self.refs.values() if r.state == "ready"]

    def resolve(self, name: str, field: str) -> int:
        """The id of a ready adapter (RequestError naming `field` otherwise)."""
        if not self.enabled:
            raise RequestError(f"{field} names a LoRA adapter but this server was started "
                               "without --enable-lora", field)
        ref = self.refs.get(name)
        if ref is None:
            known = ", ".join(sorted(r.name for r in self.ready())) or "none"
            raise RequestError(f"unknown LoRA adapter {name!r} (loaded: {known})", field)
        if ref.state != "ready":
            raise RequestError(f"LoRA adapter {name!r} is {ref.state}", field)
        return ref.lora_id

    def begin_load(self, name: str, path: str) -> LoraRef:
        if not self.enabled:
            raise RequestError("this server was started without --enable-lora", None)
        if not name or not isinstance(name, str):
            raise RequestError("lora_name must be a non-empty string", "lora_name")
        if name in self.refs:
            raise RequestError(f"a LoRA adapter named {name!r} is already "
                               f"{self.refs[name].state}", "lora_name")
        if self.max_loaded is not None and len(self.refs) >= self.max_loaded:
            raise RequestError(f"{len(self.refs)} adapters are loaded, the most "
                               f"--max-loaded-loras allows: unload one first", "lora_name")
        ref = LoraRef(self._next_id, name, path, "loading")
        self._next_id += 1
        self.refs[name] = ref
        return ref

    def end_load(self, ref: LoraRef, ok: bool) -> None:
        if ok:
            ref.state = "ready"
        else:
            del self.refs[ref.name]

    def begin_unload(self, name: str, in_flight: int) -> LoraRef:
        """`in_flight`: requests of this adapter still running (refused if any)."""
        if not self.enabled:
            raise RequestError("this server was started without --enable-lora", None)
        ref = self.refs.get(name)
        if ref is None:
            raise RequestError(f"unknown LoRA adapter {name!r}", "lora_name", status=404)
        if ref.state != "ready":
            raise RequestError(f"LoRA adapter {name!r} is {ref.state}", "lora_name")
        if in_flight:
            raise RequestError(f"LoRA adapter {name!r} has {in_flight} request(s) in flight; "
                               "unload it when they have finished", "lora_name")
        ref.state = "unloading"
        return ref

    def end_unload(self, ref: LoraRef, ok: bool) -> None:
        if ok:
            del self.refs[ref.name]
        else:
            ref.state = "ready"
