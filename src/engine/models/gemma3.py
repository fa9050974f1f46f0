"""Gemma 3's text model (Gemma3ForCausalLM): Gemma 2's decoder (gemma2.py) with per-head RMSNorm of q and k
before rotary, five local layers to a global one by default (`sliding_window_pattern`, or `layer_types`),
and its own rotary base on the local layers (`rope_local_base_freq`, or transformers v5's
rope_parameters["sliding_attention"]) while the global layers keep rope_theta and its scaling. Its
attention is not soft-capped; the final logits are where the config says so."""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from engine.models.gemma2 import Gemma2ForCausalLM, RopeParams

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig

# Hugging Face's default base of the local layers.
_LOCAL_ROPE_THETA = 10000.0


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    def layer_ropes(self, config: "ModelConfig") -> List[RopeParams]:
        raw = config.raw_config
        local_theta = float(raw.get("rope_local_base_freq") or _LOCAL_ROPE_THETA)
        params = raw.get("rope_parameters")
        if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
            local_theta = float(params["sliding_attention"].get("rope_theta") or local_theta)
        # Local layers rotate unscaled: the scaling stretches the global layers' long context only.
        return [(local_theta, None) if window > 0 else (config.rope_theta, config.rope_scaling)
                for window in config.layer_windows]
