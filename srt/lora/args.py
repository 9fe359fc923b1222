"""The LoRA part of ServerArgs: `--lora-paths` parsed, the pool's limits settled at start-up and
the start-up checks of the `--*lora*` flags (their fields are ServerArgs')."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from srt.lora.adapter import LoraError, expand_targets


@dataclass(frozen=True)
class LoraSpec:
    """One adapter to load: its name (what requests ask for) and its PEFT directory."""

    name: str
    path: str


def parse_lora_path(entry: str) -> LoraSpec:
    """SGLang's forms: `name=path`, a bare path (named by itself), or a JSON object with
    `lora_name` and `lora_path`."""
    text = entry.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-paths entry {entry!r} is not valid JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("lora_name"), str) \
                or not isinstance(obj.get("lora_path"), str):
            raise ValueError(f"--lora-paths entry {entry!r} needs string lora_name and lora_path")
        return LoraSpec(obj["lora_name"], obj["lora_path"])
    name, sep, path = text.partition("=")
    if not sep:
        return LoraSpec(text, text)
    if not name or not path:
        raise ValueError(f"--lora-paths entry {entry!r} must be NAME=PATH or PATH")
    return LoraSpec(name, path)


def adapter_rank_and_targets(path: str) -> tuple[int, tuple[str, ...]]:
    """An adapter's rank and target modules from its adapter_config.json (no tensors read)."""
    file = os.path.join(path, "adapter_config.json")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path!r}: cannot read adapter_config.json ({e})") from None
    rank, targets = config.get("r"), config.get("target_modules")
    if not isinstance(rank, int) or rank <= 0:
        raise ValueError(f"LoRA adapter {path!r}: adapter_config.json has no positive rank `r`")
    if isinstance(targets, str):  # PEFT allows a regex or "all-linear"
        targets = ["all"] if targets == "all-linear" else None
    if not isinstance(targets, list):
        raise ValueError(f"LoRA adapter {path!r}: target_modules must be a list of module "
                         "names (or all-linear)")
    try:
        return rank, expand_targets([t.rsplit(".", 1)[-1] for t in targets])
    except LoraError as e:
        raise ValueError(f"LoRA adapter {path!r}: {e}") from None


class LoraArgs:
    """Mixed into ServerArgs, whose LoRA fields these read."""

    enable_lora: bool
    lora_paths: tuple[str, ...]
    max_loras_per_batch: int
    max_lora_rank: int | None
    lora_target_modules: tuple[str, ...]
    max_loaded_loras: int | None
    is_embedding: bool
    speculative_algorithm: str | None

    @property
    def lora_specs(self) -> list[LoraSpec]:
        """The adapters of --lora-paths, in order (their ids are 1, 2, ...)."""
        return [parse_lora_path(p) for p in self.lora_paths]

    def lora_limits(self) -> tuple[int, tuple[str, ...]]:
        """(max rank, target modules) of the pool: the flags, else what --lora-paths' adapters
        need (the largest rank, the union of their targets). Reads adapter configs only."""
        rank, targets = self.max_lora_rank, tuple(self.lora_target_modules)
        if rank is not None and targets:
            return rank, expand_targets(list(targets))
        found = [adapter_rank_and_targets(s.path) for s in self.lora_specs]
        if not found:
            raise ValueError("--enable-lora without adapters in --lora-paths needs "
                             "--max-lora-rank and --lora-target-modules (to size the pool)")
        if rank is None:
            rank = max(r for r, _ in found)
        union = {t for _, ts in found for t in ts}
        return rank, expand_targets(list(targets) if targets else sorted(union))

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            return
        if self.max_loras_per_batch < 1:
            raise ValueError("--max-loras-per-batch must be >= 1")
        if self.max_lora_rank is not None and self.max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be >= 1")
        if self.lora_target_modules:
            try:
                expand_targets(list(self.lora_target_modules))
            except LoraError as e:
                raise ValueError(f"--lora-target-modules: {e}") from None
        specs = self.lora_specs
        names = [s.name for s in specs]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"--lora-paths names {sorted(dup)} more than once")
        limit = self.max_loaded_loras
        if limit is not None and (limit < 1 or len(specs) > limit):
            raise ValueError(f"--max-loaded-loras ({limit}) must be >= 1 and hold the "
                             f"{len(specs)} adapters of --lora-paths")
        if self.is_embedding:
            raise ValueError("--enable-lora is not supported with --is-embedding")
        if self.speculative_algorithm not in (None, "NGRAM"):
            raise ValueError(f"--enable-lora works with --speculative-algorithm NGRAM only "
                             f"(the {self.speculative_algorithm} draft has no adapters)")
