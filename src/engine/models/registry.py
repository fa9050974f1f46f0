"""Architecture name (config.json "architectures") -> model class, and generation vs embedding."""

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
    # Local (sliding-window) and global layers (models/gemma2.py).
    "Gemma2ForCausalLM": ("engine.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("engine.models.gemma3", "Gemma3ForCausalLM"),
    "GptOssForCausalLM": ("engine.models.gpt_oss", "GptOssForCausalLM"),
    # EAGLE's draft head (speculative decoding: --speculative-algorithm EAGLE).
    "LlamaForCausalLMEagle": ("engine.models.llama_eagle", "LlamaForCausalLMEagle"),
    "LlamaForCausalLMEagle3": ("engine.models.llama_eagle3", "LlamaForCausalLMEagle3"),
    # Mixture-of-experts decoders (models/sparse_moe.py).
    "MixtralForCausalLM": ("engine.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("engine.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    # Multi-head latent attention and DeepSeek's experts (models/deepseek_v2.py).
    "DeepseekV2ForCausalLM": ("engine.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("engine.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    # DeepSeek-V3's MTP layer as a speculative draft (--speculative-algorithm NEXTN).
    "DeepseekV3ForCausalLMNextN": ("engine.models.deepseek_nextn", "DeepseekV3ForCausalLMNextN"),
    # Embedding models: a BERT-style encoder, and decoders saved without their LM head.
    "BertModel": ("engine.models.bert", "BertModel"),
    "Contriever": ("engine.models.bert", "BertModel"),
    "LlamaModel": ("engine.models.decoder_embedding", "LlamaEmbeddingModel"),
    "LlamaEmbeddingModel": ("engine.models.decoder_embedding", "LlamaEmbeddingModel"),
    "MistralModel": ("engine.models.decoder_embedding", "LlamaEmbeddingModel"),
    "Qwen2Model": ("engine.models.decoder_embedding", "Qwen2EmbeddingModel"),
    "Qwen3Model": ("engine.models.decoder_embedding", "Qwen3EmbeddingModel"),
}

# Architectures that can only embed (SGLang's list, for those we implement). Any other
# architecture embeds when the server runs with --is-embedding or the model directory is a
# sentence-transformers one (model_config.is_generation_model).
EMBEDDING_ARCHITECTURES = frozenset(
    {"BertModel", "Contriever", "LlamaModel", "LlamaEmbeddingModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
# Encoders: every token attends to every other token of its input (no causal mask).
ENCODER_ONLY_ARCHITECTURES = frozenset({"BertModel", "Contriever"})
# Heads SGLang serves as scores (classification, reward): recognised, so the error says what is missing.
_SCORE_HEAD_SUFFIXES = ("ForSequenceClassification", "ForRewardModel", "ForProcessRewardModel")


def supported_architectures() -> List[str]:
    return sorted(_MODELS)


def resolve_model_class(architectures: Sequence[str]) -> Type[nn.Module]:
    """The class of the first supported architecture; ValueError listing the supported ones."""
    for arch in architectures or []:
        if arch in _MODELS:
            module_name, class_name = _MODELS[arch]
            return getattr(importlib.import_module(module_name), class_name)
    heads = [a for a in architectures or [] if a.endswith(_SCORE_HEAD_SUFFIXES)]
    if heads:
        raise ValueError(f"model architectures {list(architectures)} carry a classification/reward head, which "
                         f"is not supported; embedding models supported: {', '.join(sorted(EMBEDDING_ARCHITECTURES))} "
                         "(or a generative architecture with --is-embedding)")
    raise ValueError(
        f"model architectures {list(architectures or [])} are not supported; "
        f"supported architectures: {', '.join(supported_architectures())}"
    )


def is_embedding_only(architectures: Sequence[str]) -> bool:
    return any(a in EMBEDDING_ARCHITECTURES for a in architectures or [])


def is_encoder_only(architectures: Sequence[str]) -> bool:
    return any(a in ENCODER_ONLY_ARCHITECTURES for a in architectures or [])
