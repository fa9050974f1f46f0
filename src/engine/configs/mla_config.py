"""The multi-head latent attention (MLA) shape of a DeepSeek-V2/V3 config.

MLA keeps one compressed latent per token (kv_lora_rank values) plus the rotary part of the key
(qk_rope_head_dim values), shared by every head: that is all the KV pool stores. The model runner
reads this to size the pool, the model to build its attention. A config without kv_lora_rank is
not MLA (None).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

# DeepSeek-V3's multi-token prediction (MTP) layer served as a speculative draft (models/deepseek_nextn.py).
NEXTN_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"
# The architectures whose attention is MLA (models/deepseek_v2.py).
MLA_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", NEXTN_ARCHITECTURE})

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


def check_mla_server_args(enable_lora: bool) -> None:
    """Refuse, at start-up, what an MLA model cannot be served with yet (ValueError saying so).

    LoRA adapts the fused qkv projection, which MLA's projections are not. Speculative decoding runs (its
    verify and draft forwards attend over the latent pool like any extend, tree masks included), PD moves
    the latent pool's one plane per layer, and the latent pool stores fp8 with a k_scale per layer."""
    if enable_lora:
        raise ValueError("LoRA adapters are not supported for DeepSeek-V2/V3 (MLA) models yet")


def nextn_draft_config(raw: Dict[str, Any], path: str) -> Dict[str, Any]:
    """The config.json of a DeepSeek-V3 checkpoint read as its MTP layer's (SGLang's NEXTN draft: what a
    draft directory of architecture DeepseekV3ForCausalLM means to --speculative-algorithm NEXTN / EAGLE).

    The checkpoint stores the layer after the last decoder layer, as model.layers.{num_hidden_layers};
    the draft is one decoder layer (always a mixture-of-experts one, as DeepSeek trained it) and keeps
    that index in `nextn_layer_index` for its weight names. Only the first MTP layer is used (SGLang
    serves one too), every drafting step reusing it."""
    layers = raw.get("num_nextn_predict_layers") or 0
    if not isinstance(layers, int) or layers < 1:
        raise ValueError(f"{path} has no multi-token prediction layer (config.json num_nextn_predict_layers is "
                         f"{raw.get('num_nextn_predict_layers')!r}): --speculative-algorithm NEXTN needs a "
                         "DeepSeek-V3 checkpoint that keeps its MTP weights")
    return {**raw, "architectures": [NEXTN_ARCHITECTURE], "num_hidden_layers": 1,
            "nextn_layer_index": int(raw["num_hidden_layers"]), "first_k_dense_replace": 0, "moe_layer_freq": 1}


def is_nextn_checkpoint(raw: Dict[str, Any]) -> bool:
    """A DeepSeek-V3 checkpoint given as an EAGLE draft: its MTP layer is the draft (SGLang's rule)."""
    return "DeepseekV3ForCausalLM" in (raw.get("architectures") or [])


def nextn_weight_prefix(raw: Dict[str, Any]) -> Optional[str]:
    """Where an MTP draft's weights sit in its checkpoint (None: any other model reads the whole of it)."""
    if NEXTN_ARCHITECTURE not in (raw.get("architectures") or []):
        return None
    return f"model.layers.{int(raw['nextn_layer_index'])}."
