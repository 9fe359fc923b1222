"""Phi-3 (`Phi3ForCausalLM`, also Phi-3.5 and Phi-4-mini): the Llama decoder; its checkpoints
fuse q, k and v into one `qkv_proj` and gate and up into one `gate_up_proj`, which are split
back into their parts as they load (so tensor parallelism shards them as Llama's). LongRoPE
scaling (`longrope` / `su`) and a partial rotary factor are the rotary embedding's."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

from srt.models.llama import LlamaForCausalLM
from srt.models.loader import RowSlice


class Phi3ForCausalLM(LlamaForCausalLM):
    def _parts(self) -> dict[str, list[tuple[str, int]]]:
        """Fused checkpoint name -> its parts in row order: (name, rows)."""
        c = self.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        q, kv = heads * head_dim, (c.num_key_value_heads or heads) * head_dim
        inter = c.intermediate_size
        return {".self_attn.qkv_proj.": [(".self_attn.q_proj.", q), (".self_attn.k_proj.", kv),
                                          (".self_attn.v_proj.", kv)],
                ".mlp.gate_up_proj.": [(".mlp.gate_proj.", inter), (".mlp.up_proj.", inter)]}

    def _split(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        parts = self._parts()
        for name, tensor in weights:
            fused = next((f for f in parts if f in name), None)
            if fused is None or name.endswith((".input_scale", ".k_scale", ".v_scale")):
                yield name, tensor
                continue
            rows = sum(n for _, n in parts[fused])
            if tuple(tensor.shape)[0] != rows:
                raise ValueError(f"{name!r} has {tuple(tensor.shape)[0]} rows; the config says "
                                 f"{rows}")
            start = 0
            for part, n in parts[fused]:
                yield name.replace(fused, part), RowSlice(tensor, start, n)
                start += n

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._split(weights))
