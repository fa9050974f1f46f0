"""ModelConfig: the few facts about a Hugging Face model directory that the engine needs.

We read `config.json` ourselves (and keep transformers' config object as `hf_config` when it can be
built) so that the engine does not depend on how a given transformers release names things: v4
writes `rope_theta` + `rope_scaling`, v5 writes `rope_parameters`.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

import torch

from engine.configs.mla_config import is_nextn_checkpoint, nextn_draft_config
from engine.configs.pooling_config import PoolingConfig, read_sentence_transformers_config, resolve_pooling

logger = logging.getLogger(__name__)

_DTYPE_NAMES: Dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass
class ModelConfig:
    model_path: str
    architectures: List[str]
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]
    context_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: torch.dtype
    eos_token_ids: Set[int] = field(default_factory=set)
    hidden_act: str = "silu"
    model_type: str = ""
    hf_config: Any = None
    raw_config: Dict[str, Any] = field(default_factory=dict)
    # Embedding models (is_generation False) return pooled hidden states instead of tokens.
    is_generation: bool = True
    is_encoder_only: bool = False  # bidirectional attention over each input (BERT)
    pooling: Optional[PoolingConfig] = None
    # Matryoshka models may be truncated to fewer dimensions (the `dimensions` request field).
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[List[int]] = None
    # Each layer's sliding window (-1: full attention); layer_windows_of says how it is read.
    layer_windows: List[int] = field(default_factory=list)

    @property
    def is_hybrid_swa(self) -> bool:
        """Some layer attends over a sliding window (every layer, for Mistral)."""
        return any(w > 0 for w in self.layer_windows)

    @classmethod
    def from_pretrained(
        cls,
        model_path: str,
        dtype: str = "auto",
        context_length: Optional[int] = None,
        device: Optional[str] = None,
        is_embedding: bool = False,
        eagle_draft: bool = False,
    ) -> "ModelConfig":
        """Parse `model_path/config.json` (+ `generation_config.json`).

        `device` only matters for dtype resolution (float16 is turned into bfloat16 on the CPU);
        None means "cuda if available else cpu". `is_embedding` (--is-embedding) serves any
        architecture as an embedding model (see `embedding_mode`). `eagle_draft`: the directory is an
        EAGLE draft, so a DeepSeek-V3 checkpoint stands for its MTP layer (mla_config.nextn_draft_config).
        """
        raw = _read_json(os.path.join(model_path, "config.json"))
        if raw is None:
            raise FileNotFoundError(f"no config.json in model directory {model_path!r}")
        if eagle_draft and is_nextn_checkpoint(raw):
            raw = nextn_draft_config(raw, model_path)
        # Checked here so that a bad model directory fails before any weight is read.
        from engine.models.registry import resolve_model_class

        architectures = list(raw.get("architectures") or [])
        resolve_model_class(architectures)

        hidden_size = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        head_dim = raw.get("head_dim") or hidden_size // num_heads
        rope_theta, rope_scaling = _parse_rope(raw)
        max_pos = int(raw.get("max_position_embeddings") or 2048)
        embedding = embedding_mode(model_path, architectures, is_embedding)
        default_len = max_pos
        if embedding is not None and embedding.st_max_seq_length is not None:
            # The longest input the sentence-transformers model was trained for (what its own
            # encode() truncates to), as vLLM does.
            default_len = min(max_pos, embedding.st_max_seq_length)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"

        config = cls(
            model_path=model_path,
            architectures=architectures,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden_size,
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            context_len=_context_len(raw, context_length, default_len),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            dtype=resolve_dtype(dtype, raw, device),
            hidden_act=str(raw.get("hidden_act", "silu")),
            model_type=str(raw.get("model_type", "")),
            raw_config=raw,
            layer_windows=layer_windows_of(raw, int(raw["num_hidden_layers"])),
        )
        if embedding is not None:
            config.is_generation = False
            config.is_encoder_only = embedding.is_encoder_only
            config.pooling = embedding.pooling
            dims = raw.get("matryoshka_dimensions")
            config.matryoshka_dimensions = [int(d) for d in dims] if isinstance(dims, list) and dims else None
            config.is_matryoshka = bool(raw.get("is_matryoshka")) or config.matryoshka_dimensions is not None
            if config.is_encoder_only and config.context_len > max_pos:
                # Absolute position embeddings have no row past max_position_embeddings.
                raise ValueError(f"--context-length {config.context_len} exceeds the encoder's "
                                 f"max_position_embeddings {max_pos}")
        if context_length is not None and context_length > max_pos:
            logger.warning(
                "context_length %d exceeds the model's max_position_embeddings %d", context_length, max_pos
            )
        config.eos_token_ids = _collect_eos_ids(raw, _read_json(os.path.join(model_path, "generation_config.json")))
        config.hf_config = _try_hf_config(model_path)
        return config

    def get_num_kv_heads(self, tp_size: int) -> int:
        """KV heads held by one TP rank (replicated when there are fewer KV heads than ranks)."""
        return max(1, self.num_key_value_heads // tp_size)

    def get_num_attention_heads(self, tp_size: int) -> int:
        return max(1, self.num_attention_heads // tp_size)


@dataclass(frozen=True)
class EmbeddingMode:
    is_encoder_only: bool
    pooling: PoolingConfig
    st_max_seq_length: Optional[int]


def embedding_mode(model_path: str, architectures: List[str], is_embedding: bool) -> Optional[EmbeddingMode]:
    """How the model embeds, or None for a generative model.

    A model embeds when its architecture can only embed (BertModel, MistralModel, ... as in
    SGLang), when --is-embedding is given, or when its directory is a sentence-transformers model
    (a Pooling module in modules.json: Qwen3-Embedding ships a Qwen3ForCausalLM config with one).
    """
    from engine.models.registry import is_embedding_only, is_encoder_only

    st_config = read_sentence_transformers_config(model_path)
    has_st_pooling = st_config is not None and st_config.pooling_mode is not None
    if not (is_embedding or is_embedding_only(architectures) or has_st_pooling):
        return None
    encoder = is_encoder_only(architectures)
    pooling = resolve_pooling(model_path, is_causal=not encoder, st_config=st_config)
    reason = ("--is-embedding" if is_embedding else "its architecture" if is_embedding_only(architectures)
              else "its sentence-transformers modules.json")
    logger.info("Serving %s as an embedding model (by %s): %s", model_path, reason, pooling.describe())
    return EmbeddingMode(encoder, pooling, st_config.max_seq_length if st_config is not None else None)


def resolve_dtype(dtype: str, raw_config: Dict[str, Any], device: str = "cpu") -> torch.dtype:
    """"auto" takes the checkpoint's dtype (float32 when it names none), except that a float32
    checkpoint runs in bfloat16 on CUDA (as SGLang does: half the memory, tensor-core matmuls)."""
    if dtype == "auto":
        name = raw_config.get("torch_dtype") or raw_config.get("dtype") or "float32"
        if name not in _DTYPE_NAMES:
            logger.warning("unknown checkpoint dtype %r; using float32", name)
            name = "float32"
        resolved = _DTYPE_NAMES[name]
        if resolved == torch.float32 and str(device).startswith("cuda"):
            resolved = torch.bfloat16
    elif dtype in _DTYPE_NAMES:
        resolved = _DTYPE_NAMES[dtype]
    else:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}")
    if resolved == torch.float16 and device == "cpu":
        # CPU kernels for float16 are slow or missing; bfloat16 has the same size and wider range.
        logger.warning("float16 is not well supported on the CPU; using bfloat16 instead")
        resolved = torch.bfloat16
    return resolved


def sliding_window_of(raw: Dict[str, Any]) -> Optional[int]:
    """The attention window of a config, or None for full attention. Qwen2/Qwen3 configs carry a
    `sliding_window` that only applies when `use_sliding_window` is true; Mistral's always does."""
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        return None
    window = raw.get("sliding_window")
    return int(window) if window else None


def _context_len(raw: Dict[str, Any], context_length: Optional[int], max_pos: int) -> int:
    """The context length to serve: --context-length, else the model's own."""
    return int(context_length) if context_length is not None else max_pos


def layer_windows_of(raw: Dict[str, Any], num_layers: int) -> List[int]:
    """Each layer's attention window (-1: full attention), as Hugging Face decides it: `layer_types`
    where the config lists them ("sliding_attention" layers use `sliding_window`), else the family's rule:
    Gemma 2 alternates local/global from layer 0, Gemma 3 makes every `sliding_window_pattern`-th layer
    global, Qwen2 windows the layers from `max_window_layers` on, Mistral windows every layer."""
    window = sliding_window_of(raw)
    if window is None:
        return [-1] * num_layers
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    types = raw.get("layer_types")
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
        return [window if t == "sliding_attention" else -1 for t in types]
    model_type = raw.get("model_type", "")
    if model_type == "gemma2":
        return [window if i % 2 == 0 else -1 for i in range(num_layers)]
    if model_type in ("gemma3", "gemma3_text"):
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        return [window if (i + 1) % pattern else -1 for i in range(num_layers)]
    if model_type in ("qwen2", "qwen2_moe") and "max_window_layers" in raw:
        first = int(raw["max_window_layers"])
        return [window if i >= first else -1 for i in range(num_layers)]
    return [window] * num_layers


def _parse_rope(raw: Dict[str, Any]):
    """Return (rope_theta, rope_scaling or None) from either the v4 or the v5 config layout."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        # v5 layout of models whose local layers have their own rope (Gemma 3): this is the global
        # layers' one; the model reads the local one itself.
        params = params["full_attention"]
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = params
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = rope_type
        if rope_type == "default":
            scaling = None
    else:
        scaling = None
    return float(theta if theta is not None else 10000.0), scaling


def _collect_eos_ids(raw: Dict[str, Any], gen: Optional[Dict[str, Any]]) -> Set[int]:
    ids: Set[int] = set()
    for source in (raw, gen or {}):
        eos = source.get("eos_token_id")
        if eos is None:
            continue
        if isinstance(eos, int):
            ids.add(eos)
        else:
            ids.update(int(e) for e in eos)
    return ids


def _read_json(path: str) -> Optional[Dict[str, Any]]:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _try_hf_config(model_path: str):
    # Only kept for callers that want extra fields; the engine itself reads raw_config.
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path)
    except Exception as e:  # an unknown model_type must not stop us: we parse config.json ourselves
        logger.debug("transformers could not parse %s: %s", model_path, e)
        return None
