"""Changing and reading a running model's weights (SGLang's weight-update APIs).

Every TP rank runs the same call: each loads the full checkpoint tensors through the model's
weight loaders, which cut out that rank's shard, so an update is TP-correct by construction.
Parameters are written in place (`param.data.copy_`), so CUDA graphs and the oneDNN packing stay
valid after the packed copies are rebuilt.

- update_from_disk: a checkpoint of the same architecture (config compared first); on a failure
  midway the previous checkpoint is loaded back, as SGLang does.
- update_from_tensors: some named full tensors; every name is routed before anything is written,
  and the touched parameters are restored from a copy if a loader fails.
- full_weight: a checkpoint weight (e.g. `model.layers.0.self_attn.q_proj.weight`) reassembled
  from the shards of all ranks (a collective over the TP CPU group).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple, cast

import torch
from torch import nn

from engine.configs.model_config import ModelConfig
from engine.distributed.parallel_state import gather_objects_to_rank0, get_tp_rank, get_tp_size
from engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    is_quantized,
    prepack_linear_weights,
)
from engine.layers.moe.layer import FusedMoE, StackedExpertWeight
from engine.layers.mla_linear import LatentExpansion
from engine.layers.vocab_parallel_embedding import VocabParallelEmbedding
from engine.model_loader.weight_utils import ShardId, route_weight_names, safetensors_weights_iterator

logger = logging.getLogger(__name__)

SUPPORTED_LOAD_FORMATS = (None, "auto", "safetensors")
# Config fields a checkpoint must share with the running model to be loaded into it.
class UpdatableModel(Protocol):
    """What weight updates use of a model: the generation models (models/llama.py) have it."""

    # (checkpoint piece, our fused parameter's piece, shard id), e.g. ("q_proj", "qkv_proj", "q").
    stacked_params: Sequence[Tuple[str, str, ShardId]]

    def weight_skip_substrings(self) -> List[str]: ...

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]], require_all: bool = True) -> None: ...


SAME_ARCHITECTURE_FIELDS = (
    "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings", "attention_bias",
    "hidden_act", "rms_norm_eps", "rope_theta", "rope_scaling",
)


class WeightUpdater:
    def __init__(self, model: nn.Module, model_config: ModelConfig, device: str) -> None:
        self.model = model
        # The same object through the protocol above: torch types every other attribute of an
        # nn.Module as Tensor | Module (its __getattr__), so it cannot say that the model has these.
        self.loading = cast(UpdatableModel, model)
        self.model_config = model_config
        self.device = device
        # How to undo the last update until the TP ranks agreed on it (commit()): the previous
        # checkpoint's path, or a copy of the parameters an update from tensors changed.
        self._undo_path: Optional[str] = None
        self._undo_params: Optional[Dict[str, torch.Tensor]] = None
        # A quantized model's linears hold no float weight to load into (layers/quantization.py).
        self._refusal = ("Weight updates are not supported yet with --quantization (the linears hold quantized "
                         "weights only)." if is_quantized(model) else None)

    # ------------------------------------------------------------------ from disk
    def update_from_disk(self, model_path: str, load_format: Optional[str] = None) -> Tuple[bool, str]:
        if self._refusal is not None:
            return False, self._refusal
        if load_format not in SUPPORTED_LOAD_FORMATS:
            return False, f"load_format {load_format!r} is not supported (only safetensors checkpoints: auto)."
        try:
            new_config = ModelConfig.from_pretrained(model_path, dtype="auto", device=self.device)
        except Exception as e:  # noqa: BLE001 - a missing or bad directory is the caller's error
            return False, f"Failed to read the model config at {model_path!r}: {e}"
        mismatch = architecture_mismatch(self.model_config, new_config)
        if mismatch is not None:
            return False, (f"The checkpoint at {model_path!r} is not the running model's architecture ({mismatch}); "
                           "update_weights_from_disk loads a new checkpoint of the same architecture.")
        current = self.model_config.model_path
        try:
            self._load(safetensors_weights_iterator(model_path), require_all=True)
        except Exception as e:  # noqa: BLE001 - reported to the caller, the old weights come back
            logger.error("Failed to update weights from %s: %s; rolling back to %s", model_path, e, current)
            return False, f"Failed to update weights: {e}. {self._reload(current)}"
        self._undo_path, self._undo_params = current, None
        self.model_config.model_path = model_path
        logger.info("Updated the weights from %s", model_path)
        return True, "Succeeded to update model weights."

    def commit(self) -> None:
        """Every TP rank succeeded: forget how to undo the update."""
        self._undo_path = self._undo_params = None

    def rollback(self) -> str:
        """Undo the last successful update (another TP rank failed its part)."""
        if self._undo_params is not None:
            self._restore(self._undo_params)
            self._undo_params = None
            return "Rolled back to the previous weights."
        if self._undo_path is None:
            return "Nothing to roll back."
        path, self._undo_path = self._undo_path, None
        message = self._reload(path)
        self.model_config.model_path = path
        return message

    def _restore(self, saved: Dict[str, torch.Tensor]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for target, data in saved.items():
                params[target].data.copy_(data)
        self._after_load()

    def _reload(self, path: str) -> str:
        try:
            self._load(safetensors_weights_iterator(path), require_all=True)
            return f"Rolled back to the weights of {path!r}."
        except Exception as e:  # noqa: BLE001
            logger.error("Rolling back to %s failed too: %s", path, e)
            return f"Rolling back to {path!r} failed too ({e}): the weights are inconsistent; restart the server."

    # ------------------------------------------------------------------ from tensors
    def update_from_tensors(self, named_tensors: Sequence[Tuple[str, torch.Tensor]]) -> Tuple[bool, str]:
        if self._refusal is not None:
            return False, self._refusal
        names = [name for name, _ in named_tensors]
        if len(set(names)) != len(names):
            return False, "Each weight name may appear once in named_tensors."
        try:
            routes = route_weight_names(self.model, names, self.loading.stacked_params,
                                        self.loading.weight_skip_substrings())
        except ValueError as e:
            return False, f"Failed to update weights: {e}."
        params = dict(self.model.named_parameters())
        backup = {target: params[target].data.clone() for target, _ in set(routes.values())}
        try:
            self._load(named_tensors, require_all=False)
        except Exception as e:  # noqa: BLE001 - e.g. a shape mismatch: nothing changes
            self._restore(backup)
            return False, f"Failed to update weights: {e}. The weights are unchanged."
        self._undo_path, self._undo_params = None, backup
        return True, "Succeeded to update model weights."

    def _load(self, weights: Any, require_all: bool) -> None:
        try:
            self.loading.load_weights(weights, require_all=require_all)
        finally:
            self._after_load()

    def _after_load(self) -> None:
        # Loading dropped the oneDNN-packed copies (stale); pack the new weights again.
        if str(self.device) == "cpu":
            prepack_linear_weights(self.model)
        elif str(self.device).startswith("cuda"):
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ reading
    def full_weight(self, name: str, truncate_size: int) -> Tuple[Optional[List[Any]], str]:
        """The first `truncate_size` rows of checkpoint weight `name`, unsharded (on TP rank 0;
        a collective: every rank calls it). (None, reason) for an unknown name."""
        if self._refusal is not None:  # every rank of a quantized model returns here: no collective is left half-run
            return None, "Reading weights by name is not supported yet with --quantization."
        target, shard, error = self._route_one(name)
        piece = None if target is None else local_piece(self.model, target, shard, truncate_size)
        pieces = gather_objects_to_rank0(piece)
        if error is not None:
            return None, error
        if pieces is None:  # not rank 0
            return None, ""
        full = assemble(pieces)
        if full is None:
            return None, f"Weight {name!r} is not available."
        return full[:truncate_size].float().tolist(), ""

    def _route_one(self, name: str) -> Tuple[Optional[str], ShardId, Optional[str]]:
        stacked, skip = self.loading.stacked_params, self.loading.weight_skip_substrings()
        if name == "lm_head.weight" and self.model_config.tie_word_embeddings:
            name = "model.embed_tokens.weight"  # tied: the head is the embedding (SGLang answers so too)
        try:
            routes = route_weight_names(self.model, [name], stacked, skip)
        except ValueError:
            routes = {}
        if name not in routes:
            return None, None, f"Get parameter by name failed: the model has no weight {name!r}."
        target, shard = routes[name]
        return target, shard, None


def architecture_mismatch(current: ModelConfig, new: ModelConfig) -> Optional[str]:
    for field in SAME_ARCHITECTURE_FIELDS:
        a, b = getattr(current, field), getattr(new, field)
        if a != b:
            return f"{field}: {a!r} running, {b!r} in the checkpoint"
    return None


# ---------------------------------------------------------------------- TP shard reassembly
def local_piece(model: nn.Module, target: str, shard: ShardId, truncate_size: int) -> Dict[str, Any]:
    """This rank's part of a checkpoint weight, with how the parts combine (see `assemble`).

    Only the first `truncate_size` rows of each part are kept: along the concatenation dimension 0
    the first rows of the whole come from the first parts, whatever their sizes.
    """
    module_name, _, param_name = target.rpartition(".")
    module = model.get_submodule(module_name)
    data = getattr(module, param_name).data
    rank, size = get_tp_rank(), get_tp_size()
    dim, key, limit = None, rank, None  # dim None: replicated (rank 0's copy is the weight)
    if isinstance(module, QKVParallelLinear) and shard is not None:
        offsets = {"q": (0, module.q_size), "k": (module.q_size, module.kv_size),
                   "v": (module.q_size + module.kv_size, module.kv_size)}
        offset, rows = offsets[str(shard)]
        data = data.narrow(0, offset, rows)
        dim = 0
        # K/V heads replicated over groups of ranks: one part per group.
        key = rank if shard == "q" else rank // module.num_kv_head_replicas
    elif isinstance(module, MergedColumnParallelLinear) and shard is not None:
        offset = sum(module.output_sizes[: int(shard)]) // size
        data = data.narrow(0, offset, module.output_sizes[int(shard)] // size)
        dim = 0
    elif isinstance(module, StackedExpertWeight) and shard is not None:
        experts = model.get_submodule(module_name.rpartition(".")[0])
        assert isinstance(experts, FusedMoE)  # a stacked expert weight is a FusedMoE's child
        data, dim, key = experts.checkpoint_piece(data, str(shard))
    elif isinstance(module, (ColumnParallelLinear, LatentExpansion)):  # LatentExpansion: split by heads
        dim = 0
    elif isinstance(module, RowParallelLinear):
        dim = 1 if param_name == "weight" else None
    elif isinstance(module, VocabParallelEmbedding):
        dim, limit = 0, module.num_embeddings  # the padding rows are not part of the weight
    if size == 1:
        dim = None
    return {"data": data[:truncate_size].detach().to("cpu", copy=True), "dim": dim, "key": key, "limit": limit}


def assemble(pieces: List[Optional[Dict[str, Any]]]) -> Optional[torch.Tensor]:
    if not pieces or pieces[0] is None:
        return None
    first = pieces[0]
    if first["dim"] is None:
        return first["data"]
    parts, seen = [], set()
    for piece in pieces:
        assert piece is not None  # every rank routes a name alike: all parts exist when the first does
        if piece["key"] not in seen:
            seen.add(piece["key"])
            parts.append(piece["data"])
    full = torch.cat(parts, dim=first["dim"])
    return full if first["limit"] is None else full[: first["limit"]]
