"""The named tensors of one update_weights_from_tensor payload (one TP rank's entry).

Two encodings:
- safetensors (always accepted): the file's bytes, tensor name -> full tensor. Data only: nothing
  in it runs. A trainer writes it with `safetensors.torch.save(dict(named_tensors))`.
- SGLang's `MultiprocessingSerializer` output (a ForkingPickler pickle of the tensors, or of a
  `flattened_bucket`), only with --enable-pickled-weight-updates. Such a pickle carries handles
  to memory of the sending process (CUDA IPC handles; names of shared-memory files for CPU
  tensors under torch's "file_system" sharing strategy), which is how colocated trainers hand
  over their weights without a copy. Unpickling is code execution by design, so it goes through
  `WeightUnpickler`: only the callables torch's tensor reductions emit (and SGLang's few payload
  classes, mapped onto ours) resolve; any other global refuses the payload. That shuts out the
  known gadgets (os.system, builtins.eval, getattr chains), but the payload still makes the
  server open memory by handle, so the flag stays an opt-in for trusted clients
  (docs/security.md).

Both give [(checkpoint name, tensor)]; the tensors are full (unsharded), each rank cuts its shard.
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

NamedTensors = List[Tuple[str, torch.Tensor]]
LOAD_FORMATS = (None, "direct", "flattened_bucket")
PICKLE_NEEDS_FLAG = ("serialized_named_tensors is not a safetensors payload; SGLang's pickled tensors "
                     "(MultiprocessingSerializer) are decoded only by a server started with "
                     "--enable-pickled-weight-updates (unpickling runs code: see docs/security.md). "
                     "Send safetensors.torch.save(dict(named_tensors)) instead.")


class PayloadError(ValueError):
    """A payload that does not decode to named tensors (the message says why)."""


@dataclass
class FlattenedTensorMetadata:
    """SGLang's weight_sync.tensor_bucket.FlattenedTensorMetadata: where one tensor lies in a
    flattened bucket (element indices of the flat tensor, or byte indices of a uint8 one)."""

    name: str = ""
    shape: Tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    start_idx: int = 0
    end_idx: int = 0
    numel: int = 0


@dataclass
class LocalSerializedTensor:
    """SGLang's utils.LocalSerializedTensor: one pickled tensor per TP rank (each rank's own GPU)."""

    values: List[bytes] = field(default_factory=list)


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's patched CUDA rebuild (patch_torch.monkey_patch_torch_reductions): the device is
    sent as its UUID, so that processes with different CUDA_VISIBLE_DEVICES agree on it."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device_index = 6  # rebuild_cuda_tensor's `storage_device` argument
    device = args[device_index]
    if isinstance(device, str):
        matches = [i for i in range(torch.cuda.device_count())
                   if str(torch.cuda.get_device_properties(i).uuid) == device]
        if not matches:
            raise PayloadError(f"No local CUDA device has the UUID {device} the payload names.")
        args = (*args[:device_index], matches[0], *args[device_index + 1:])
    return rebuild_cuda_tensor(*args)


class _ClassArgument:
    """A class a pickle passes as an argument (torch.Tensor, torch.UntypedStorage): its attributes
    and equality are the class's, but the payload may not call it with arguments (that would let
    it allocate any amount of memory)."""

    def __init__(self, cls: type) -> None:
        self._cls = cls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cls, name)

    def __eq__(self, other: object) -> bool:
        return self._cls == other

    def __hash__(self) -> int:
        return hash(self._cls)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            raise PayloadError(f"the pickled payload calls {self._cls.__name__} with arguments")
        return self._cls()


def _allowed_globals() -> Dict[Tuple[str, str], Any]:
    from torch.multiprocessing import reductions

    allowed: Dict[Tuple[str, str], Any] = {
        ("torch.multiprocessing.reductions", name): getattr(reductions, name)
        for name in ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_storage_filename",
                     "rebuild_storage_empty")
    }
    tensor, storage = _ClassArgument(torch.Tensor), _ClassArgument(torch.UntypedStorage)
    allowed.update({
        ("torch", "Tensor"): tensor,
        ("torch._tensor", "Tensor"): tensor,
        ("torch", "UntypedStorage"): storage,
        ("torch.storage", "UntypedStorage"): storage,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch", "Size"): torch.Size,
        ("torch", "device"): torch.device,
    })
    allowed.update({("torch", name): value for name in dir(torch)
                    if isinstance(value := getattr(torch, name), torch.dtype)})
    # SGLang's payload classes (and ours) and patched CUDA rebuild, under each module path they have had.
    for module in ("sglang.srt.weight_sync.tensor_bucket", __name__):
        allowed[(module, "FlattenedTensorMetadata")] = FlattenedTensorMetadata
    for module in ("sglang.srt.utils", "sglang.srt.utils.common", "sglang.srt.model_executor.model_runner", __name__):
        allowed[(module, "LocalSerializedTensor")] = LocalSerializedTensor
    for module in ("sglang.srt.patch_torch", "sglang.srt.utils.patch_torch"):
        allowed[(module, "_rebuild_cuda_tensor_modified")] = _rebuild_cuda_tensor_by_uuid
    return allowed


class WeightUnpickler(pickle.Unpickler):
    """An unpickler that resolves only the globals a pickle of tensors needs (see the module doc).

    Not allowed, among others: multiprocessing.resource_sharer.DupFd (torch's default
    "file_descriptor" strategy for CPU tensors; it would make the server connect to an address
    named in the payload), and every builtins / os / functools global.
    """

    _allowed: Optional[Dict[Tuple[str, str], Any]] = None

    def find_class(self, module: str, name: str) -> Any:
        if WeightUnpickler._allowed is None:
            WeightUnpickler._allowed = _allowed_globals()
        found = WeightUnpickler._allowed.get((module, name))
        if found is None:
            raise PayloadError(f"the pickled payload refers to {module}.{name}, which a weight payload may not "
                               "(only torch's tensor reductions and SGLang's payload classes are allowed)")
        return found


def is_safetensors(data: bytes) -> bool:
    """Whether `data` starts like a safetensors file: an 8-byte little-endian header length that
    fits, then a JSON object."""
    if len(data) < 10:
        return False
    (header_len,) = struct.unpack("<Q", data[:8])
    return 2 <= header_len <= len(data) - 8 and data[8:9] == b"{"


def decode_payload(data: bytes, tp_rank: int, allow_pickle: bool, load_format: Optional[str]) -> NamedTensors:
    """The named tensors of one payload; PayloadError if it is neither encoding (or pickled
    without the flag)."""
    if load_format not in LOAD_FORMATS:
        raise PayloadError(f"load_format {load_format!r} is not one of {', '.join(map(str, LOAD_FORMATS))}.")
    if is_safetensors(data):
        if load_format == "flattened_bucket":
            raise PayloadError("load_format 'flattened_bucket' takes SGLang's pickled bucket; a safetensors "
                               "payload is sent with load_format null.")
        from safetensors.torch import load as load_safetensors

        try:
            return list(load_safetensors(data).items())
        except Exception as e:  # noqa: BLE001 - the payload is the caller's
            raise PayloadError(f"serialized_named_tensors is not a valid safetensors payload: {e}") from None
    if not allow_pickle:
        raise PayloadError(PICKLE_NEEDS_FLAG)
    obj = _unpickle(data)
    if load_format == "flattened_bucket":
        return _unflatten(obj)
    return _named_tensors(obj, tp_rank)


def _unpickle(data: bytes) -> Any:
    try:
        return WeightUnpickler(io.BytesIO(data)).load()
    except PayloadError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated pickle, a handle that does not open, ...
        raise PayloadError(f"The pickled payload does not load: {type(e).__name__}: {e}") from None


def _named_tensors(obj: Any, tp_rank: int) -> NamedTensors:
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        raise PayloadError(f"The pickled payload is a {type(obj).__name__}, not (name, tensor) pairs.")
    named: NamedTensors = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise PayloadError("The pickled payload must hold (name, tensor) pairs.")
        name, value = item
        named.append((name, _tensor_of(name, value, tp_rank)))
    return named


def _tensor_of(name: str, value: Any, tp_rank: int) -> torch.Tensor:
    if isinstance(value, LocalSerializedTensor):  # its value for this rank is a pickled tensor (no nesting)
        if not 0 <= tp_rank < len(value.values):
            raise PayloadError(f"{name!r}: its LocalSerializedTensor has {len(value.values)} value(s), none for "
                               f"TP rank {tp_rank}.")
        value = _unpickle(value.values[tp_rank])
    if not isinstance(value, torch.Tensor):
        raise PayloadError(f"{name!r} is a {type(value).__name__}, not a tensor.")
    return value.detach()


def _unflatten(obj: Any) -> NamedTensors:
    """A flattened bucket ({"flattened_tensor", "metadata"}) as named tensors."""
    if not (isinstance(obj, dict) and isinstance(obj.get("flattened_tensor"), torch.Tensor)
            and isinstance(obj.get("metadata"), list)):
        raise PayloadError("A flattened_bucket payload is {'flattened_tensor': tensor, 'metadata': [...]}.")
    flat: torch.Tensor = obj["flattened_tensor"]
    named: NamedTensors = []
    for meta in obj["metadata"]:
        if not isinstance(meta, FlattenedTensorMetadata):
            raise PayloadError("The flattened bucket's metadata must be FlattenedTensorMetadata entries.")
        if not 0 <= meta.start_idx <= meta.end_idx <= flat.numel():
            raise PayloadError(f"{meta.name!r} lies outside the flattened tensor "
                               f"([{meta.start_idx}, {meta.end_idx}) of {flat.numel()}).")
        piece = flat[meta.start_idx:meta.end_idx]
        try:
            # Newer SGLang flattens raw bytes (uint8) and views them back; older ones kept the dtype.
            if flat.dtype == torch.uint8 and meta.dtype != torch.uint8:
                piece = piece.view(meta.dtype)
            named.append((meta.name, piece.reshape(tuple(meta.shape)).to(meta.dtype)))
        except (RuntimeError, TypeError) as e:
            raise PayloadError(f"{meta.name!r} does not fit its metadata: {e}") from None
    return named
