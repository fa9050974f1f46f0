"""Triton attention kernels over the paged KV pool (decode: split-K flash-decoding; extend: prefix + causal)."""

from __future__ import annotations

from engine.layers.attention.triton_ops.decode_attention import compute_num_kv_splits, decode_attention_fwd
from engine.layers.attention.triton_ops.extend_attention import extend_attention_fwd

__all__ = ["compute_num_kv_splits", "decode_attention_fwd", "extend_attention_fwd"]
