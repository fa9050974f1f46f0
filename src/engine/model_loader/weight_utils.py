"""Reading checkpoint tensors and routing them into (tensor-parallel, fused) parameters."""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

logger = logging.getLogger(__name__)

ShardId = Union[str, int, None]
# loader(param, checkpoint_tensor[, shard_id]): copies (this rank's piece of) the tensor into param.
WeightLoader = Callable[..., None]


def safetensors_weights_iterator(model_path: str, prefix: Optional[str] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from `model.safetensors` or the shards named by its index file; with `prefix`
    only the tensors whose names start with it (the others are not read: a draft that is one layer of
    its target's checkpoint, models/deepseek_nextn.py)."""
    from safetensors import safe_open

    index_path = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path, encoding="utf-8") as f:
            weight_map: Dict[str, str] = json.load(f)["weight_map"]
        files = [os.path.join(model_path, name) for name in sorted({shard for name, shard in weight_map.items()
                                                                    if prefix is None or name.startswith(prefix)})]
    else:
        files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_path!r}")
    from tqdm import tqdm

    from engine.distributed.parallel_state import get_tp_rank

    # A progress bar a person can follow, over the tensors of all shards; one per server (TP rank 0).
    with tqdm(desc="Loading weights", unit="tensor", disable=get_tp_rank() != 0) as bar:
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                names = [name for name in f.keys() if prefix is None or name.startswith(prefix)]
                bar.total = (bar.total or 0) + len(names)
                bar.refresh()
                for name in names:
                    yield name, f.get_tensor(name)
                    bar.update(1)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None) -> None:
    """A replicated parameter: the checkpoint tensor as is."""
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def clear_packed_weights(model: nn.Module) -> None:
    """Drop every layer's packed copy of its weight (layers/linear.py packs them for the CPU
    kernels): a copy of old weights would be stale once new ones load."""
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            # torch types Module.__setattr__ for tensors and modules only; None is a valid value.
            module.packed_weight = None  # type: ignore[assignment]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    """Attach the loader that load_weights_into calls for `param` (torch declares no such attribute)."""
    setattr(param, "weight_loader", loader)


def weight_loader_of(param: nn.Parameter) -> WeightLoader:
    """The loader set_weight_loader attached, default_weight_loader for a plain parameter."""
    return getattr(param, "weight_loader", default_weight_loader)


def route_weight_names(
    model: nn.Module,
    names: Iterable[str],
    stacked_params: Sequence[Tuple[str, str, ShardId]],
    skip_substrings: Sequence[str] = (),
) -> Dict[str, Tuple[str, ShardId]]:
    """checkpoint name -> (our parameter name, shard id) for every name, skipped ones left out;
    ValueError naming the names no parameter takes (checked before anything is loaded)."""
    params = dict(model.named_parameters())
    routes: Dict[str, Tuple[str, ShardId]] = {}
    unknown = []
    for name in names:
        if any(s in name for s in skip_substrings):
            continue
        target, shard_id = _route(name, stacked_params, params)
        if target is None:
            unknown.append(name)
        else:
            routes[name] = (target, shard_id)
    if unknown:
        raise ValueError(f"no parameter of the model takes weight(s) {', '.join(sorted(unknown)[:20])}")
    return routes


def load_weights_into(
    model: nn.Module,
    weights: Iterable[Tuple[str, torch.Tensor]],
    stacked_params: Sequence[Tuple[str, str, ShardId]],
    skip_substrings: Sequence[str] = (),
    require_all: bool = True,
) -> None:
    """Load checkpoint weights into `model`, each parameter (or fused shard) exactly once.

    `stacked_params` maps a checkpoint name piece to our fused parameter's piece and shard id
    (e.g. ("q_proj", "qkv_proj", "q")). Raises ValueError on a weight loaded twice and, with
    `require_all` (a whole checkpoint), on a parameter (or shard) the weights do not provide;
    without it (an update of some weights) only the given ones change.
    """
    clear_packed_weights(model)  # packed copies of the old weights would be stale
    params = dict(model.named_parameters())  # tied parameters appear once, under their first name
    shards_of: Dict[str, Set[ShardId]] = {}
    for _, fused, shard_id in stacked_params:
        shards_of.setdefault(fused, set()).add(shard_id)
    loaded: Set[Tuple[str, ShardId]] = set()

    from engine.model_loader.kv_scales import kv_scale_target

    for name, tensor in weights:
        if any(s in name for s in skip_substrings):
            continue
        if kv_scale_target(name) is not None:
            continue  # the fp8 KV cache's scales: the KV pool reads them (model_loader/kv_scales.py)
        target, shard_id = _route(name, stacked_params, params)
        if target is None:
            logger.warning("checkpoint weight %s has no matching parameter; ignored", name)
            continue
        key = (target, shard_id)
        if key in loaded:
            raise ValueError(f"weight {name} loaded twice (parameter {target}, shard {shard_id})")
        param = params[target]
        loader = weight_loader_of(param)
        try:
            with torch.no_grad():
                if shard_id is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, shard_id)
        except ValueError as e:  # say which checkpoint tensor did not fit
            raise ValueError(f"checkpoint weight {name}: {e}") from e
        loaded.add(key)

    if not require_all:
        return
    missing: List[str] = []
    for pname in params:
        owner = next((f for f in shards_of if f"{f}." in pname), None)
        expected = shards_of[owner] if owner else {None}
        missing += [f"{pname}[{s}]" if s is not None else pname for s in expected if (pname, s) not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weight(s): {', '.join(sorted(missing)[:20])}")


def _route(
    name: str, stacked_params: Sequence[Tuple[str, str, ShardId]], params: Dict[str, nn.Parameter]
) -> Tuple[Union[str, None], ShardId]:
    for ckpt_piece, fused_piece, shard_id in stacked_params:
        if f".{ckpt_piece}." in name:
            fused_name = name.replace(f".{ckpt_piece}.", f".{fused_piece}.")
            if fused_name in params:
                return fused_name, shard_id
    if name in params:
        return name, None
    return None, None
