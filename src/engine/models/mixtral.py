"""Mixtral: Llama attention, a sparse block on every layer (experts.N.w1/w3/w2 under block_sparse_moe),
softmax top-k routing renormalised over the chosen experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.layers.moe.layer import MIXTRAL_EXPERT_NAMES
from engine.models.sparse_moe import MoeForCausalLM, MoeSpec

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig


class MixtralForCausalLM(MoeForCausalLM):
    block_name = "block_sparse_moe"
    expert_names = MIXTRAL_EXPERT_NAMES

    @staticmethod
    def moe_spec(config: "ModelConfig") -> MoeSpec:
        return MoeSpec.from_mixtral(config.raw_config)
