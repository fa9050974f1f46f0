"""Rotary position embedding (GPT-NeoX layout, as Hugging Face Llama/Qwen use) with a cos/sin cache.

Supported `rope_scaling` types: none/"default", "linear", "llama3", "yarn".
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from engine.kernels import ops as kernel_ops


def _base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: Dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by `factor`, short ones kept,
    a smooth interpolation in between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(inv_freq: torch.Tensor, rotary_dim: int, base: float, max_position_embeddings: int,
                   scaling: Dict[str, Any]) -> Tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than `beta_slow` times over the original
    context are interpolated by `factor`, those that turn more than `beta_fast` times are kept, a
    linear ramp blends the ones between; cos/sin are scaled by the attention factor. Returns
    (inv_freq, attention factor)."""
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return inv_freq / factor * (1 - keep) + inv_freq * keep, float(attention_factor)


class RotaryEmbedding(nn.Module):
    cos_sin_cache: torch.Tensor  # a buffer (register_buffer below)

    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position_embeddings: int,
        base: float,
        rope_scaling: Optional[Dict[str, Any]] = None,
    ) -> None:
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        inv_freq = _base_inv_freq(rotary_dim, base)
        scaling = rope_scaling or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        magnitude = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / float(scaling["factor"])
        elif rope_type == "yarn":
            inv_freq, magnitude = _yarn_inv_freq(inv_freq, rotary_dim, base, max_position_embeddings, scaling)
        elif rope_type != "default":
            raise ValueError(
                f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3, yarn)")
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # [max_pos, rotary_dim]: cos of the half-dims then sin; kept in float32 (not a weight,
        # so it is not saved or loaded) and cast per call to the activations' dtype.
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * magnitude
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self._cast_cache: Optional[torch.Tensor] = None

    def _cache_for(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # One cast per dtype, not one per layer per forward.
        c = self._cast_cache
        if c is None or c.dtype != dtype or c.device != device:
            c = self.cos_sin_cache.to(device=device, dtype=dtype)
            self._cast_cache = c
        return c

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, inplace: bool = False
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """query [T, H*D] (or [T, H, D]), key [T, KH*D]; returns rotated copies of the same shapes.

        With `inplace` the caller lets the CPU kernel rotate query and key where they are (slices of
        its fused qkv output); the torch path always returns new tensors.
        """
        if positions.is_cpu and kernel_ops.rope_usable(query, key, self.cos_sin_cache, self.rotary_dim):
            if not inplace:
                query, key = query.clone(), key.clone()
            kernel_ops.rope_neox_(positions, query, key, self.cos_sin_cache, self.head_size, self.rotary_dim)
            return query, key
        cos_sin = self._cache_for(query.dtype, query.device).index_select(0, positions)
        half = self.rotary_dim // 2
        cos = cos_sin[:, :half].unsqueeze(1)
        sin = cos_sin[:, half:].unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        rot = x[..., : self.rotary_dim]
        half = self.rotary_dim // 2
        x1 = rot[..., :half]
        x2 = rot[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        if self.rotary_dim < self.head_size:
            out = torch.cat([out, x[..., self.rotary_dim :]], dim=-1)
        return out.reshape(shape)


def get_rope(
    head_size: int,
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: Optional[Dict[str, Any]] = None,
) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, rope_scaling)
