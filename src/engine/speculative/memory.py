"""What a speculative draft model costs in memory, so the target's KV pool is sized together with it.

The draft's K/V pool has as many slots as the target's (draft_model.py: one slot numbering), an
EAGLE head also keeps the target's feature of every slot (eagle.py; a PD prefill server keeps only
those, features.py), and the draft's weights are
loaded after the target's pool is allocated. As SGLang does (its pool configurator scales the
target's bytes per token by 1 + draft layers / target layers), the target's pool size is computed
from one memory budget with the draft's bytes per slot added to the target's, and the draft's
weights are taken off the free memory first (ModelRunner.profile_max_num_token); here the draft's
own geometry is read from its config instead of assuming the target's per-layer size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch

from engine.configs.mla_config import mla_dims_of, nextn_weight_prefix

if TYPE_CHECKING:
    from engine.configs.model_config import ModelConfig
    from engine.server_args import ServerArgs

# The algorithms with a draft model beside the target (server_args_check.DRAFT_MODEL_ALGORITHMS).
_DRAFT_MODEL_ALGORITHMS = ("STANDALONE", "EAGLE", "EAGLE3")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


@dataclass(frozen=True)
class DraftMemory:
    kv_bytes_per_token: int  # the draft model's K/V of one slot on this rank
    feature_bytes_per_token: int  # an EAGLE head's stored target feature of one slot (0: STANDALONE)
    weight_bytes: int  # the draft checkpoint's bytes, shared out over the TP ranks (an estimate)

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token + self.feature_bytes_per_token


def draft_memory(server_args: ServerArgs, target: ModelConfig, tp_size: int) -> Optional[DraftMemory]:
    """The draft model's memory beside `target` (None: no draft model)."""
    algo = server_args.speculative_algorithm
    path = server_args.speculative_draft_model_path
    if algo not in _DRAFT_MODEL_ALGORITHMS or path is None:
        return None
    from engine.configs.model_config import ModelConfig

    # As TpModelWorker.make_draft_runner builds it: the target's dtype.
    config = ModelConfig.from_pretrained(path, dtype=str(target.dtype).removeprefix("torch."),
                                         context_length=target.context_len, device=server_args.device,
                                         eagle_draft=algo == "EAGLE")
    element = torch.tensor([], dtype=target.dtype).element_size()
    dims = mla_dims_of(config.raw_config)
    if dims is not None:  # a DeepSeek-shaped draft: one latent + rope key per layer (mem_cache/mla_pool.py)
        kv = config.num_hidden_layers * dims.cache_dim * element
    else:
        kv = 2 * config.num_hidden_layers * config.get_num_kv_heads(tp_size) * config.head_dim * element
    features = 0
    if algo != "STANDALONE":  # the target's final hidden state (EAGLE3: three layer inputs) per slot
        features = config.hidden_size * (3 if algo == "EAGLE3" else 1) * element
    if server_args.disaggregation_mode == "prefill":
        # A PD prefill server keeps the features only (speculative/features.py): no head, no head K/V.
        return DraftMemory(kv_bytes_per_token=0, feature_bytes_per_token=features, weight_bytes=0)
    weights = _checkpoint_bytes(path)
    if nextn_weight_prefix(config.raw_config) is not None:
        # An MTP draft reads one layer of its target's checkpoint (the target's layers, then its own):
        # its share of the bytes, not the whole directory.
        weights //= int(config.raw_config["nextn_layer_index"]) + 1
    return DraftMemory(kv_bytes_per_token=kv, feature_bytes_per_token=features,
                       weight_bytes=weights // max(1, tp_size))


def _checkpoint_bytes(path: str) -> int:
    if not os.path.isdir(path):
        return 0
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path)
               if name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(os.path.join(path, name)))


def pool_bytes(k_buffers: List[torch.Tensor], v_buffers: List[torch.Tensor]) -> int:
    """The bytes of a K/V pool's buffers (what /get_server_info reports). An MLA pool's V buffers are
    views of its K buffers (mem_cache/mla_pool.py): memory counted once."""
    keys = {t.untyped_storage().data_ptr() for t in k_buffers}
    own_v = [t for t in v_buffers if t.untyped_storage().data_ptr() not in keys]
    return sum(t.numel() * t.element_size() for t in (*k_buffers, *own_v))
