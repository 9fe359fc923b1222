"""The LoRA adapters of one model process: loaded on the host, placed in the device pool's slots
when a step needs them, and each step's grouping of rows by slot.

Every rank keeps the same adapters under the same ids (the HTTP process numbers them; 0 is the
base model) and makes the same slot choices, since every rank sees the same steps. The pool has
`--max-loras-per-batch` slots; the scheduler admits at most that many adapters into a batch, and an
adapter a step needs that is in no slot takes a free slot or, of those the step does not need, the
least recently used (`--lora-eviction-policy lru`) or the one placed first (fifo); its host copy
stays (eviction to host memory). A slot is written on the
device's stream, after the steps launched before it, so a step in flight keeps its weights.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from srt.lora.adapter import BaseShapes, LoraAdapter, LoraError
from srt.lora.layers import LoraBatchInfo, LoraLinear, Slice, SlotImage
from srt.lora.sgmv import FILL_ROWS, block_m_for, row_blocks
from srt.model_process.step_inputs import StagedCopier

logger = logging.getLogger(__name__)
_EMPTY = torch.empty(0, dtype=torch.int64)


def _attach(model: torch.nn.Module, base: BaseShapes, targets: tuple[str, ...], slots: int,
            max_rank: int, dtype: torch.dtype, device: torch.device
            ) -> dict[int, list[tuple[LoraLinear, tuple[str, ...]]]]:
    """A LoraLinear on each layer's adapted projections (`layer.lora`); per decoder layer, the
    LoraLinears and the PEFT projections each one takes. LoraError where the model's layers are
    not the Llama decoder's (fused q/k/v, gate/up; o and down row-parallel)."""
    out: dict[int, list[tuple[LoraLinear, tuple[str, ...]]]] = {}
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise LoraError(f"LoRA is not supported for {type(model).__name__}")
    for i, layer in enumerate(layers):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        found: list[tuple[LoraLinear, tuple[str, ...]]] = []
        qkv = [t for t in ("q_proj", "k_proj", "v_proj") if t in targets]
        if qkv:
            lin = getattr(attn, "qkv_proj", None)
            if not isinstance(lin, QKVParallelLinear):
                raise LoraError(f"LoRA on {', '.join(qkv)} is not supported for "
                                f"{type(model).__name__} (its attention has no fused q/k/v)")
            q, kv = lin.num_heads * lin.head_dim, lin.num_kv_heads * lin.head_dim
            where = {"q_proj": ("q", 0, q), "k_proj": ("k", q, kv), "v_proj": ("v", q + kv, kv)}
            slices = [Slice(t, *where[t]) for t in qkv]
            found.append((LoraLinear(lin, slices, base.shapes["q_proj"][0], False, slots,
                                     max_rank, dtype, device), tuple(qkv)))
        gate_up = [t for t in ("gate_proj", "up_proj") if t in targets]
        if gate_up:
            lin = getattr(mlp, "gate_up_proj", None)
            if not isinstance(lin, MergedColumnParallelLinear):
                raise LoraError(f"LoRA on {', '.join(gate_up)} is not supported for layer {i} "
                                f"of {type(model).__name__} (not a dense gated MLP)")
            inter = lin.sizes_per_rank[0]
            where = {"gate_proj": (0, 0, inter), "up_proj": (1, inter, inter)}
            slices = [Slice(t, *where[t]) for t in gate_up]
            found.append((LoraLinear(lin, slices, base.shapes["gate_proj"][0], False, slots,
                                     max_rank, dtype, device), tuple(gate_up)))
        for name, owner, attr in (("o_proj", attn, "o_proj"), ("down_proj", mlp, "down_proj")):
            if name not in targets:
                continue
            lin = getattr(owner, attr, None)
            if not isinstance(lin, RowParallelLinear):
                raise LoraError(f"LoRA on {name} is not supported for layer {i} of "
                                f"{type(model).__name__}")
            fan_in, fan_out = base.shapes[name]
            found.append((LoraLinear(lin, [Slice(name, None, 0, fan_out)], fan_in, True,
                                     slots, max_rank, dtype, device), (name,)))
        for lora, _ in found:
            lora.base.lora = lora
        out[i] = found
    return out


class LoraManager:
    def __init__(self, model: torch.nn.Module, hf_config: Any, num_slots: int, max_rank: int,
                 targets: tuple[str, ...], device: torch.device, dtype: torch.dtype,
                 eviction: str = "lru") -> None:
        self.base = BaseShapes.of(hf_config)
        self.num_slots, self.max_rank, self.targets = num_slots, max_rank, targets
        self.device = device
        self.layers = _attach(model, self.base, targets, num_slots, max_rank, dtype, device)
        self.adapters: dict[int, LoraAdapter] = {}
        # per adapter, each LoraLinear's slot image (layers' order), built once at load
        self.images: dict[int, list[SlotImage]] = {}
        self.slot_owner: list[int | None] = [None] * num_slots
        self.slot_of: dict[int, int] = {}
        self._last_use = [0] * num_slots
        self._placed_at = [0] * num_slots
        self.eviction = eviction  # lru: the least recently used slot goes; fifo: the oldest
        self._clock = 0
        self.triton = device.type == "cuda"
        self._copier = StagedCopier(device)
        self._warm_up()
        nbytes = sum(lo.a.nbytes + lo.b.nbytes for ls in self.layers.values() for lo, _ in ls)
        logger.info("LoRA: %d slots of rank %d over %s (%.1f MB on %s)", num_slots, max_rank,
                    ", ".join(targets), nbytes / 1e6, device)

    def _warm_up(self) -> None:
        """Compile the Triton kernels of every layer shape now, not at the first request of
        an adapter: one row through slot 0 (which holds zeros) with the block size of decode
        steps and with that of fills."""
        if not self.triton:
            return
        dev = self.device
        indptr = torch.ones(self.num_slots + 1, dtype=torch.int64, device=dev)
        indptr[0] = 0
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        seen: set[tuple] = set()
        for found in self.layers.values():
            for lora, _ in found:
                key = (lora.a.shape, lora.b.shape, tuple(lora.slices))
                if key in seen:
                    continue
                seen.add(key)
                for rows in (1, FILL_ROWS):
                    info = LoraBatchInfo(zero, indptr, zero, zero, block_m_for(rows), None)
                    x = torch.zeros(1, lora.a.shape[2], dtype=lora.a.dtype, device=dev)
                    out = torch.zeros(1, lora.col_hi, dtype=lora.b.dtype, device=dev)
                    lora.apply(x, out, info)

    # ------------------------------------------------------------ adapters

    def load(self, lora_id: int, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter (LoraError says why it cannot be served)."""
        if lora_id in self.adapters:
            raise LoraError(f"adapter id {lora_id} is already loaded")
        adapter = LoraAdapter.load(name, path, self.base, self.max_rank, self.targets)
        self.add(lora_id, adapter)
        return adapter

    def add(self, lora_id: int, adapter: LoraAdapter) -> None:
        """Hold a checked adapter under `lora_id`: its slot images are built now (its own
        tensors are dropped), so placing it in a slot later is two copies per layer."""
        self.images[lora_id] = [
            lora.image({m: adapter.weights[(layer, m)] for m in modules
                        if (layer, m) in adapter.weights})
            for layer, found in self.layers.items() for lora, modules in found]
        adapter.weights = {}  # the images hold them now
        self.adapters[lora_id] = adapter

    def unload(self, lora_id: int) -> None:
        self.adapters.pop(lora_id)
        self.images.pop(lora_id)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.slot_owner[slot] = None

    # ------------------------------------------------------------- a step

    def _place(self, lora_id: int, needed: set[int]) -> int:
        slot = self.slot_of.get(lora_id)
        if slot is None:
            free = [s for s, o in enumerate(self.slot_owner) if o is None]
            if free:
                slot = free[0]
            else:
                idle = [s for s, o in enumerate(self.slot_owner) if o not in needed]
                if not idle:
                    raise RuntimeError(f"a step needs more than {self.num_slots} adapters")
                age = self._last_use if self.eviction == "lru" else self._placed_at
                slot = min(idle, key=lambda s: age[s])
                del self.slot_of[self.slot_owner[slot]]
            loras = (lora for found in self.layers.values() for lora, _ in found)
            for lora, image in zip(loras, self.images[lora_id]):
                lora.put(slot, image)
            self.slot_owner[slot], self.slot_of[lora_id] = lora_id, slot
            self._placed_at[slot] = self._clock + 1
        self._clock += 1
        self._last_use[slot] = self._clock
        return slot

    def batch_info(self, row_ids: np.ndarray) -> LoraBatchInfo | None:
        """The grouping of a step whose row i uses adapter row_ids[i] (0: none); None when no
        row uses one."""
        used = np.unique(row_ids)
        used = used[used != 0]
        if used.size == 0:
            return None
        needed = set(int(i) for i in used)
        table = np.full(int(used.max()) + 1, -1, dtype=np.int64)
        for i in needed:
            table[i] = self._place(i, needed)
        slots = table[row_ids]
        valid = np.nonzero(slots >= 0)[0]
        rows = valid[np.argsort(slots[valid], kind="stable")]
        counts = np.bincount(slots[valid], minlength=self.num_slots)
        indptr = np.zeros(self.num_slots + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        if not self.triton:
            return LoraBatchInfo(torch.from_numpy(rows), torch.from_numpy(indptr), _EMPTY,
                                 _EMPTY, 0, indptr.tolist())
        block_m = block_m_for(len(row_ids))
        block_slot, block_start = row_blocks(counts, indptr, block_m)
        dev = self._copier.copy([rows, indptr, block_slot, block_start])
        return LoraBatchInfo(*dev, block_m, None)

    def info(self) -> dict[str, Any]:
        return {"max_loras_per_batch": self.num_slots, "max_lora_rank": self.max_rank,
                "lora_target_modules": list(self.targets),
                "adapters": {a.name: {"rank": a.rank, "path": a.path}
                             for a in self.adapters.values()}}
