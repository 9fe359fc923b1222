"""Triton attention kernels of the triton backend: prefill, extend (cached prefix) and decode.

Importing this package imports triton; set TRITON_INTERPRET=1 before that to run the kernels on
the CPU through the interpreter (tests only).
"""

from srt.layers.attention.triton_ops.decode_attention import (
    choose_num_kv_splits,
    decode_attention_fwd,
    decode_workspace,
)
from srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from srt.layers.attention.triton_ops.prefill_attention import context_attention_fwd

__all__ = [
    "choose_num_kv_splits",
    "context_attention_fwd",
    "decode_attention_fwd",
    "decode_workspace",
    "extend_attention_fwd",
]
