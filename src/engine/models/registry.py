"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

import importlib
from typing import Dict, List, Sequence, Tuple, Type

from torch import nn

# name -> (module, class); imported on demand so that reading a config stays cheap.
_MODELS: Dict[str, Tuple[str, str]] = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("engine.models.qwen3", "Qwen3ForCausalLM"),
}


def supported_architectures() -> List[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: Sequence[str]) -> Type[nn.Module]:
    """The class of the first supported architecture; ValueError listing the supported ones."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    raise ValueError(
        f"model architectures {list(architectures or [])} are not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )
