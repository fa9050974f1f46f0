"""How an embedding model turns its hidden states into one vector per input.

A sentence-transformers model directory says it in its own files: `modules.json` lists the
pipeline (Transformer -> Pooling -> optional Normalize), the Pooling module's `config.json` names
the mode, and `sentence_bert_config.json` the longest input the model was trained for. We follow
those files exactly, so that our vectors are the ones `SentenceTransformer.encode` returns. A
directory without them gets SGLang's defaults: CLS pooling for BERT-style encoders, last-token
pooling for decoders, both L2-normalised.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Dict, List, Optional

logger = logging.getLogger(__name__)


class PoolingType(IntEnum):
    LAST = 0  # the hidden state of the last token (decoder embedding models)
    CLS = 1  # the hidden state of the first token
    MEAN = 2  # the mean over every token of the input


# sentence-transformers' pooling mode names (new "pooling_mode" form and legacy boolean keys).
_MODE_NAMES = {"lasttoken": PoolingType.LAST, "cls": PoolingType.CLS, "mean": PoolingType.MEAN}
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# Modules of a sentence-transformers pipeline that change nothing we compute.
_NEUTRAL_MODULES = {"Transformer"}


@dataclass(frozen=True)
class PoolingConfig:
    pooling_type: PoolingType
    normalize: bool
    source: str  # where the choice came from (for the start-up log)

    def describe(self) -> str:
        norm = ", L2-normalised" if self.normalize else ""
        return f"{self.pooling_type.name.lower()} pooling{norm} ({self.source})"


@dataclass(frozen=True)
class SentenceTransformersConfig:
    modules: List[str]  # the class names of the pipeline, in order
    pooling_mode: Optional[str]  # None when the pipeline has no Pooling module
    normalize: bool
    max_seq_length: Optional[int]


def read_sentence_transformers_config(model_path: str) -> Optional[SentenceTransformersConfig]:
    """The pipeline described by `modules.json` (None when the directory has none)."""
    modules = _read_json(os.path.join(model_path, "modules.json"))
    if not isinstance(modules, list):
        return None
    names: List[str] = []
    pooling_mode: Optional[str] = None
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        names.append(kind)
        if kind == "Pooling":
            pooling_mode = _pooling_mode(_read_json(os.path.join(model_path, module.get("path", ""), "config.json")))
    bert_config = _read_json(os.path.join(model_path, "sentence_bert_config.json")) or {}
    max_seq = bert_config.get("max_seq_length")
    return SentenceTransformersConfig(
        modules=names,
        pooling_mode=pooling_mode,
        normalize="Normalize" in names,
        max_seq_length=int(max_seq) if isinstance(max_seq, int) and max_seq > 0 else None,
    )


def resolve_pooling(model_path: str, is_causal: bool,
                    st_config: Optional[SentenceTransformersConfig] = None) -> PoolingConfig:
    """The pooling of an embedding model; ValueError for a pipeline we cannot reproduce."""
    st_config = st_config if st_config is not None else read_sentence_transformers_config(model_path)
    if st_config is None or st_config.pooling_mode is None:
        default = PoolingType.LAST if is_causal else PoolingType.CLS
        return PoolingConfig(default, True, "default")
    unsupported = [m for m in st_config.modules if m not in _NEUTRAL_MODULES | {"Pooling", "Normalize"}]
    if unsupported:
        raise ValueError(f"the sentence-transformers pipeline of {model_path!r} has modules that are not "
                         f"supported: {', '.join(unsupported)} (supported: Transformer, Pooling, Normalize)")
    mode = st_config.pooling_mode
    if mode not in _MODE_NAMES:
        raise ValueError(f"sentence-transformers pooling mode {mode!r} of {model_path!r} is not supported "
                         f"(supported: {', '.join(sorted(_MODE_NAMES))})")
    return PoolingConfig(_MODE_NAMES[mode], st_config.normalize, "sentence-transformers modules.json")


def _pooling_mode(config: Optional[Dict[str, Any]]) -> Optional[str]:
    """One mode name from a Pooling config of either format; a combination is returned joined
    with '+' (which no mode name matches, so it is refused with its name)."""
    if not config:
        return None
    mode = config.get("pooling_mode")
    if mode is None:
        mode = [name for key, name in _LEGACY_KEYS.items() if config.get(key)]
    if isinstance(mode, list):
        if not mode:
            return None
        return mode[0] if len(mode) == 1 else "+".join(str(m) for m in mode)
    return str(mode)


def _read_json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("could not read %s: %s", path, e)
        return None
