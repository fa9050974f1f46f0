"""Loading pre-quantized checkpoints (layers/quant_config.py says which) into the TP linear layers.

Three steps around the model's own `load_weights`:

1. `prepare(model, quant)`, before loading: every column- and row-parallel linear the checkpoint
   quantized gets parameters for the checkpoint's tensors instead of its float weight: `weight` (int8 /
   float8 e4m3) and `weight_scale` [out] for 8-bit compressed-tensors; `qweight` (4-bit codes, one per
   byte while loading), `qzeros`, `scales` [out, groups] (and `g_idx` [in] with act-order) for AWQ / GPTQ,
   the same under compressed-tensors' names (weight_packed, weight_zero_point, weight_scale,
   weight_g_idx) for its 4-bit pack-quantized format.
   Each is output-major like a float weight, so the layer's own weight_loader cuts this rank's piece
   (column-parallel: output rows; row-parallel: input columns, and the groups of those columns for
   scales and zeros, which is why a row-parallel shard must hold whole groups). A GPTQ checkpoint with
   `lm_head: true` gives the LM head the same 4-bit parameters, cut by vocabulary rows as its float weight.
2. `canonical_weights(...)` wraps the checkpoint iterator: it brings each format's tensors to that
   output-major form (AWQ's and GPTQ's int32 words unpacked in their own nibble orders, scales and
   zeros transposed, GPTQ's stored zero - 1 undone, a [out, 1] scale made [out]), and refuses a
   quantized tensor of a module we do not quantize (mixture-of-experts weights, an LM head the config
   does not say is quantized).
3. `finish(model, plan)`, after loading: each layer's parameters become its `packed_weight`, a
   QuantizedWeight (8-bit: the --quantization path's kernels) or an Int4Weight (layers/int4.py), and
   the parameters are released.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, List, Optional, Protocol, Sequence, Set, Tuple, Union, runtime_checkable

import torch
from torch import nn

from engine.layers.int4 import Int4Weight, pack_int4
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.quant_config import CheckpointQuantization
from engine.layers.quantization import QuantizedWeight
from engine.layers.vocab_parallel_embedding import ParallelLMHead
from engine.model_loader.weight_utils import ShardId, WeightLoader, set_weight_loader

logger = logging.getLogger(__name__)

Linear = Union[ColumnParallelLinear, RowParallelLinear]
QuantizedModule = Union[ColumnParallelLinear, RowParallelLinear, ParallelLMHead]
# AutoAWQ packs the 8 outputs of an int32 word in this order: nibble i holds output AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.int32)


@dataclass
class LoadPlan:
    """Which linears hold quantized parameters, by our module name and by the checkpoint's names."""

    quant: CheckpointQuantization
    modules: Dict[str, QuantizedModule] = field(default_factory=dict)
    checkpoint_modules: Set[str] = field(default_factory=set)
    skipped: List[str] = field(default_factory=list)


def checkpoint_names(module_name: str, stacked: Sequence[Tuple[str, str, ShardId]]) -> List[str]:
    """The checkpoint's module names a (fused) module of ours loads from: qkv_proj <- q/k/v_proj."""
    head, _, last = module_name.rpartition(".")
    pieces = [ckpt for ckpt, fused, _ in stacked if fused == last]
    return [f"{head}.{p}" if head else p for p in pieces] or [module_name]


@runtime_checkable
class FusesCheckpointLinears(Protocol):
    """A model whose fused linears load from several checkpoint linears (qkv_proj <- q/k/v_proj)."""

    stacked_params: Sequence[Tuple[str, str, ShardId]]


def prepare(model: nn.Module, quant: CheckpointQuantization) -> LoadPlan:
    """Give every linear the checkpoint quantized its quantized parameters (step 1 above)."""
    stacked = model.stacked_params if isinstance(model, FusesCheckpointLinears) else ()
    plan = LoadPlan(quant)
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        names = checkpoint_names(name, stacked)
        ignored = [quant.ignores(n) for n in names]
        if all(ignored):
            plan.skipped.append(name)
            continue
        if any(ignored):
            raise ValueError(f"the checkpoint quantizes some of {', '.join(names)} but not all; they are one fused "
                             f"layer ({name}) here: not supported")
        if quant.weights == "int4":
            _add_int4_params(module, name, quant)
        else:
            _add_8bit_params(module, quant)
        plan.modules[name] = module
        plan.checkpoint_modules.update(names)
    if quant.lm_head:
        _add_lm_head(model, plan)
    if not plan.modules:
        raise ValueError(f"the checkpoint is {quant.method}-quantized but no linear layer of the model is")
    return plan


def _add_lm_head(model: nn.Module, plan: LoadPlan) -> None:
    """GPTQ's lm_head: the head loads 4-bit codes, zeros and scales (one row each per token, so the head's
    own vocabulary-row loader cuts them) instead of its float weight. A head tied to the embedding is untied
    here: the embedding keeps the float matrix, the head the checkpoint's quantized one (what the config says
    the model was quantized with)."""
    heads = [(name, m) for name, m in model.named_modules() if isinstance(m, ParallelLMHead)]
    if len(heads) != 1:
        raise ValueError(f"the checkpoint's quantization_config quantizes the LM head (lm_head), but the model has "
                         f"{len(heads)} LM heads")
    name, head = heads[0]
    quant = plan.quant
    k = head.embedding_dim
    if quant.group_size != -1 and k % quant.group_size != 0:
        raise ValueError(f"{name}: its {k} inputs are not whole groups of {quant.group_size}")
    groups = 1 if quant.group_size == -1 else k // quant.group_size
    n = head.num_embeddings_per_partition
    head.register_parameter("weight", None)  # a tied head lets go of the embedding's matrix, which stays float
    names = quant.int4_names
    set_weight_loader(_param(head, names.codes, (n, k), torch.uint8), head.load_vocab_rows)
    for pname in (names.zeros, names.scales):
        set_weight_loader(_param(head, pname, (n, groups), torch.float32), head.load_vocab_rows)
    if quant.desc_act:
        set_weight_loader(_param(head, names.g_idx, (k,), torch.int64), _copy_whole)
    plan.modules[name] = head
    plan.checkpoint_modules.add(name)


def _shape(module: Linear) -> Tuple[int, int]:
    """This rank's [out, in] of the layer's weight."""
    if isinstance(module, RowParallelLinear):
        return module.output_size, module.input_size_per_partition
    return module.output_size_per_partition, module.input_size


def _param(module: QuantizedModule, name: str, shape: Tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    module.register_parameter(name, param)
    return param


def _add_8bit_params(module: Linear, quant: CheckpointQuantization) -> None:
    n, k = _shape(module)
    dtype = torch.float8_e4m3fn if quant.weights == "fp8" else torch.int8
    set_weight_loader(_param(module, "weight", (n, k), dtype), module.weight_loader)
    total_out = module.output_size

    def load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        # A per-tensor scale (of one fused shard) stands for the same scale on each of its output rows: a
        # view as long as any shard, which the layer's loader narrows like a per-channel one.
        if loaded.numel() == 1:
            loaded = loaded.reshape(1).expand(total_out)
        if shard_id is None:
            module.weight_loader(param, loaded)
        else:
            module.weight_loader(param, loaded, shard_id)

    set_weight_loader(_param(module, "weight_scale", (n,), torch.float32), load_scale)


def _add_int4_params(module: Linear, name: str, quant: CheckpointQuantization) -> None:
    n, k = _shape(module)
    row_parallel = isinstance(module, RowParallelLinear)
    sharded_inputs = row_parallel and module.tp_size > 1
    if quant.group_size == -1:
        groups = 1
    else:
        if k % quant.group_size != 0:
            raise ValueError(f"{name}: {k} inputs per rank are not whole groups of {quant.group_size}; a row-parallel "
                             "shard must hold whole groups (use a tensor-parallel size that divides the groups)")
        groups = k // quant.group_size
    if quant.desc_act and sharded_inputs:
        raise ValueError(f"{name}: a GPTQ act-order (desc_act) checkpoint cannot be split by input columns across "
                         f"{module.tp_size} ranks (its groups are scattered over the inputs); serve it with --tp-size 1")
    names = quant.int4_names
    module.register_parameter("weight", None)  # the codes replace it (finish() puts back an empty one)
    set_weight_loader(_param(module, names.codes, (n, k), torch.uint8), module.weight_loader)
    # A symmetric compressed-tensors scheme stores no zero points (each is 8).
    for pname in (names.scales,) if quant.symmetric else (names.zeros, names.scales):
        param = _param(module, pname, (n, groups), torch.float32)
        if quant.group_size == -1 and sharded_inputs:
            # One group per row: every rank's input columns share it, so the [out, 1] tensor is not cut.
            set_weight_loader(param, _copy_whole)
        else:
            set_weight_loader(param, module.weight_loader)
    if quant.desc_act:
        set_weight_loader(_param(module, names.g_idx, (k,), torch.int64), _shared_loader())


def _copy_whole(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


def _shared_loader() -> WeightLoader:
    """g_idx of a column-parallel layer: all of its inputs, whichever shard; the fused projections share
    their input, so their g_idx must agree (one act-order)."""
    loaded_once: List[bool] = []

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId = None) -> None:
        if not loaded_once:
            _copy_whole(param, loaded)
            loaded_once.append(True)
        elif param.shape != loaded.shape or not torch.equal(param.data, loaded.to(param.dtype)):
            raise ValueError(f"the g_idx of fused shard {shard_id} differs from another shard's: the fused "
                             "projections of one input must share their act-order")

    return load


# ------------------------------------------------------------------------------ checkpoint tensors
def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., w] -> their 8 nibbles [..., w, 8], nibble i = bits 4i..4i+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AWQ qweight [in, out / 8] or qzeros [groups, out / 8] -> [in or groups, out] codes."""
    nib = _nibbles(words)
    inverse = [AWQ_ORDER.index(j) for j in range(8)]  # output j of a word is nibble inverse[j]
    return nib[..., inverse].reshape(words.shape[0], -1)


def unpack_gptq_rows(words: torch.Tensor) -> torch.Tensor:
    """GPTQ qweight [in / 8, out] (8 consecutive inputs per word, in order) -> [in, out] codes."""
    return _nibbles(words).permute(0, 2, 1).reshape(-1, words.shape[1])


def unpack_gptq_cols(words: torch.Tensor) -> torch.Tensor:
    """GPTQ qzeros [groups, out / 8] (8 consecutive outputs per word, in order) -> [groups, out]."""
    return _nibbles(words).reshape(words.shape[0], -1)


def _expect_dtype(name: str, tensor: torch.Tensor, dtypes: Tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in dtypes:
        raise ValueError(f"checkpoint tensor {name} is {str(tensor.dtype).replace('torch.', '')}; this "
                         f"{'/'.join(str(d).replace('torch.', '') for d in dtypes)} tensor is what the "
                         "checkpoint's quantization_config promises")


def _g_idx(name: str, tensor: torch.Tensor, quant: CheckpointQuantization) -> Optional[torch.Tensor]:
    g_idx = tensor.to(torch.int64)
    if quant.desc_act:
        return g_idx
    group = quant.group_size if quant.group_size > 0 else max(int(g_idx.numel()), 1)
    if not torch.equal(g_idx, torch.arange(g_idx.numel()) // group):
        raise ValueError(f"{name} assigns inputs to groups out of order but the checkpoint says there is no "
                         "act-order (desc_act / actorder)")
    return None  # the plain order: nothing to keep


def _convert_compressed_int4(name: str, suffix: str, tensor: torch.Tensor,
                             quant: CheckpointQuantization) -> Optional[torch.Tensor]:
    """compressed-tensors pack-quantized: weight_packed [out, in / 8] and weight_zero_point [out / 8,
    groups], int32 words of 8 consecutive codes in nibble order, stored as the signed value + 8."""
    if suffix in ("weight_packed", "weight_zero_point"):
        _expect_dtype(name, tensor, (torch.int32,))
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(tensor.shape)}")
    if suffix == "weight_packed":
        return unpack_gptq_cols(tensor)
    if suffix == "weight_zero_point":
        return None if quant.symmetric else unpack_gptq_rows(tensor).float()
    if suffix == "weight_scale":
        return tensor.float()
    if suffix == "weight_shape":
        return None  # the unpacked codes' shape is checked against the layer's
    if suffix == "weight_g_idx":
        return _g_idx(name, tensor, quant)
    return tensor


def _convert(name: str, suffix: str, tensor: torch.Tensor, quant: CheckpointQuantization) -> Optional[torch.Tensor]:
    """One tensor of a quantized module in output-major form; None drops it."""
    if quant.method == "compressed-tensors" and quant.weights == "int4":
        return _convert_compressed_int4(name, suffix, tensor, quant)
    if quant.method == "compressed-tensors":
        if suffix == "weight":
            _expect_dtype(name, tensor, (torch.float8_e4m3fn,) if quant.weights == "fp8" else (torch.int8,))
            return tensor
        if suffix == "weight_scale":
            if quant.per_tensor and tensor.numel() != 1:
                raise ValueError(f"{name}: the scheme's strategy is tensor, so one scale, got shape {tuple(tensor.shape)}")
            if tensor.numel() == 1:
                return tensor.reshape(1).float()
            if tensor.dim() == 2 and tensor.shape[1] == 1:
                return tensor[:, 0].float()
            if tensor.dim() == 1:
                return tensor.float()
            raise ValueError(f"{name}: a per-channel scale is [out, 1] or [out], got shape {tuple(tensor.shape)}")
        if suffix == "input_scale":  # a static activation scale: checked, not applied (quant_config.py)
            if tensor.numel() != 1 or not bool(torch.isfinite(tensor).all()) or float(tensor.float().reshape(())) <= 0:
                raise ValueError(f"{name}: a static per-tensor activation scale is one positive finite value, got "
                                 f"shape {tuple(tensor.shape)}")
            return None
        if suffix == "weight_zero_point":  # some writers store the zeros of a symmetric scheme
            if bool((tensor != 0).any()):
                raise ValueError(f"{name} has non-zero zero points, but the scheme is symmetric")
            return None
        return tensor
    if suffix in ("qweight", "qzeros"):
        _expect_dtype(name, tensor, (torch.int32,))
        if tensor.dim() != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(tensor.shape)}")
    if quant.method == "awq":
        if suffix in ("qweight", "qzeros"):
            return unpack_awq(tensor).t()
        if suffix == "scales":
            return tensor.float().t()
        return tensor
    if suffix == "qweight":
        return unpack_gptq_rows(tensor).t()
    if suffix == "qzeros":
        return unpack_gptq_cols(tensor).t().float() + quant.zero_offset
    if suffix == "scales":
        return tensor.float().t()
    if suffix == "g_idx":
        return _g_idx(name, tensor, quant)
    return tensor


def canonical_weights(weights: Iterable[Tuple[str, torch.Tensor]], plan: LoadPlan) -> Iterator[Tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with those of quantized modules in output-major form (step 2 above)."""
    quant = plan.quant
    quantized_suffixes = set(quant.suffixes) - {"weight"}
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if module in plan.checkpoint_modules:
            converted = _convert(name, suffix, tensor, quant)
            if converted is not None:
                yield name, converted
            continue
        if suffix in quantized_suffixes or (suffix == "weight" and tensor.dtype in QUANTIZED_DTYPES):
            raise ValueError(f"checkpoint tensor {name} is quantized, but {module or name} is not a linear layer we "
                             f"load quantized (the attention and MLP projections of dense models are, and the LM head "
                             f"where a GPTQ config says lm_head true; mixture-of-experts weights are not)")
        yield name, tensor


# ---------------------------------------------------------------------------------------- finish
def finish(plan: LoadPlan, dtype: torch.dtype) -> None:
    """Each quantized layer's loaded parameters become its packed weight (step 3 above)."""
    for name, module in plan.modules.items():
        params = dict(module.named_parameters(recurse=False))
        if plan.quant.weights == "int4":
            module.packed_weight = _int4_weight(name, params, plan.quant)
            n = plan.quant.int4_names
            for pname in (n.codes, n.zeros, n.scales, n.g_idx):
                if pname in params:
                    delattr(module, pname)
        else:
            module.packed_weight = QuantizedWeight(plan.quant.weights, params["weight"].data.contiguous(),
                                                   params["weight_scale"].data.contiguous())
            delattr(module, "weight_scale")
            delattr(module, "weight")
        # As after --quantization: an empty float weight where the layer kept one (nothing reads it).
        module.weight = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)


def _int4_weight(name: str, params: Dict[str, nn.Parameter], quant: CheckpointQuantization) -> Int4Weight:
    names = quant.int4_names
    codes, scales = params[names.codes].data, params[names.scales].data
    zeros = params[names.zeros].data if names.zeros in params else torch.full_like(scales, 8.0)
    k = int(codes.shape[1])
    group = quant.group_size if quant.group_size > 0 else k
    if int(codes.max()) > 15 or float(zeros.min()) < 0 or float(zeros.max()) > 16:
        raise ValueError(f"{name}: 4-bit codes or zero points out of range")
    perm: Optional[torch.Tensor] = None
    if names.g_idx in params:
        g_idx = params[names.g_idx].data
        groups = k // group
        counts = torch.bincount(g_idx.clamp(0, groups), minlength=groups + 1)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups or not bool((counts[:groups] == group).all()):
            raise ValueError(f"{name}: g_idx must put exactly {group} inputs in each of the {groups} groups")
        order = torch.argsort(g_idx, stable=True)
        if not torch.equal(order, torch.arange(k)):
            perm = order
            codes = codes[:, order]
    return pack_int4(codes, scales, zeros, group, perm)
