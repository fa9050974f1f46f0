"""Mistral: the Llama architecture under another name.

Sliding-window attention is not implemented: a window shorter than the context length is
reported, since sequences longer than the window would then differ from the reference.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig

logger = logging.getLogger(__name__)


class MistralForCausalLM(LlamaForCausalLM):
    def __init__(self, config: "ModelConfig") -> None:
        super().__init__(config)
        window = config.raw_config.get("sliding_window")
        if window is not None and window < config.context_len:
            logger.warning(
                "sliding_window %d < context length %d is not supported; attention spans the whole sequence",
                window,
                config.context_len,
            )
