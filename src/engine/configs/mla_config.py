"""The multi-head latent attention (MLA) shape of a DeepSeek-V2/V3 config.

MLA keeps one compressed latent per token (kv_lora_rank values) plus the rotary part of the key
(qk_rope_head_dim values), shared by every head: that is all the KV pool stores. The model runner
reads this to size the pool, the model to build its attention. A config without kv_lora_rank is
not MLA (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

# The architectures whose attention is MLA (models/deepseek_v2.py).
MLA_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"})

# Bounds on what a config may ask (a bad config.json fails at load with a clear message).
MAX_LATENT_DIM = 1 << 14
MAX_HEAD_DIM = 1 << 12


@dataclass(frozen=True)
class MLADims:
    kv_lora_rank: int  # the latent: K's no-rope part and V both come out of it
    qk_rope_head_dim: int  # the rotary part of q and k (k's is shared by all heads)
    qk_nope_head_dim: int  # each head's query / key part without rotary
    v_head_dim: int  # each head's value size (after the latent is expanded)
    q_lora_rank: Optional[int]  # None: q comes straight from the hidden state (q_proj)

    def __post_init__(self) -> None:
        for name, value, bound in (("kv_lora_rank", self.kv_lora_rank, MAX_LATENT_DIM),
                                   ("qk_rope_head_dim", self.qk_rope_head_dim, MAX_HEAD_DIM),
                                   ("qk_nope_head_dim", self.qk_nope_head_dim, MAX_HEAD_DIM),
                                   ("v_head_dim", self.v_head_dim, MAX_HEAD_DIM)):
            if not 1 <= value <= bound:
                raise ValueError(f"the config's {name} {value} must be in [1, {bound}]")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even (rotary pairs)")
        if self.q_lora_rank is not None and not 1 <= self.q_lora_rank <= MAX_LATENT_DIM:
            raise ValueError(f"the config's q_lora_rank {self.q_lora_rank} must be in [1, {MAX_LATENT_DIM}] or null")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Elements per token per layer in the pool: the latent, then the rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_dims_of(raw: Dict[str, Any]) -> Optional[MLADims]:
    """The MLA dimensions of a config.json, None for a model without MLA."""
    if not MLA_ARCHITECTURES.intersection(raw.get("architectures") or []) or raw.get("kv_lora_rank") is None:
        return None
    q_lora = raw.get("q_lora_rank")
    return MLADims(kv_lora_rank=int(raw["kv_lora_rank"]), qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
                   qk_nope_head_dim=int(raw["qk_nope_head_dim"]), v_head_dim=int(raw["v_head_dim"]),
                   q_lora_rank=None if q_lora is None else int(q_lora))


def check_mla_server_args(speculative_algorithm: Optional[str], enable_lora: bool) -> None:
    """Refuse, at start-up, what an MLA model cannot be served with yet (ValueError saying so).

    Speculative decoding keeps a draft's K/V in an MHA pool beside the target's and LoRA adapts the fused
    qkv projection: neither knows the latent pool or MLA's projections."""
    if speculative_algorithm is not None:
        raise ValueError(f"--speculative-algorithm {speculative_algorithm} is not supported for DeepSeek-V2/V3 "
                         "(MLA) models yet")
    if enable_lora:
        raise ValueError("LoRA adapters are not supported for DeepSeek-V2/V3 (MLA) models yet")
