"""update_weights_from_tensor payloads (model_executor/tensor_payload.py), decoded in-process.

Oracle: the tensors that were encoded. SGLang's payloads are made as its MultiprocessingSerializer
makes them (ForkingPickler; CPU tensors under torch's "file_system" sharing strategy), with its
class names stood in for by modules of those names.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any, List

import pytest
import torch

from engine.model_executor.tensor_payload import PayloadError, decode_payload, is_safetensors

NAMED = [("model.norm.weight", torch.arange(4, dtype=torch.float32)),
         ("lm_head.weight", torch.ones(2, 3, dtype=torch.bfloat16))]


@pytest.fixture
def file_system_sharing():
    import torch.multiprocessing as mp

    before = mp.get_sharing_strategy()
    mp.set_sharing_strategy("file_system")
    yield
    mp.set_sharing_strategy(before)


def forking_pickle(obj: Any) -> bytes:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def assert_named_equal(got: List, want: List) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_safetensors_needs_no_flag():
    from safetensors.torch import save

    data = save(dict(NAMED))
    assert is_safetensors(data)
    assert_named_equal(sorted(decode_payload(data, 0, allow_pickle=False, load_format=None)), sorted(NAMED))


def test_a_pickle_needs_the_flag(file_system_sharing):
    data = forking_pickle(NAMED)
    assert not is_safetensors(data)
    with pytest.raises(PayloadError, match="--enable-pickled-weight-updates"):
        decode_payload(data, 0, allow_pickle=False, load_format=None)
    assert_named_equal(decode_payload(data, 0, allow_pickle=True, load_format=None), NAMED)


class _System:
    def __reduce__(self):
        return (os.system, ("echo this must not run",))


class _Allocate:
    def __reduce__(self):
        return (torch.UntypedStorage, (1 << 40,))


class _Getattr:
    def __reduce__(self):
        return (getattr, ("text", "upper"))  # the first step of a getattr gadget chain


@pytest.mark.parametrize("gadget, message", [(_System(), "posix.system"), (_Getattr(), "builtins.getattr"),
                                             (_Allocate(), "calls UntypedStorage with arguments")])
def test_only_tensor_reductions_resolve(gadget, message):
    with pytest.raises(PayloadError, match=message):
        decode_payload(pickle.dumps([("x", gadget)]), 0, allow_pickle=True, load_format=None)


def _sglang_class(monkeypatch, module_name: str, name: str, fields: List[str]) -> type:
    """A data class pickled under SGLang's module and class name."""
    parts = module_name.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    module = types.ModuleType(module_name)
    cls = dataclasses.make_dataclass(name, fields)
    cls.__module__, cls.__qualname__ = module_name, name
    setattr(module, name, cls)
    monkeypatch.setitem(sys.modules, module_name, module)
    return cls


def test_local_serialized_tensor_gives_each_rank_its_own(monkeypatch, file_system_sharing):
    """verl's layout: one LocalSerializedTensor per name, holding one pickled tensor per TP rank."""
    local = _sglang_class(monkeypatch, "sglang.srt.utils", "LocalSerializedTensor", ["values"])
    per_rank = [torch.full((3,), float(rank)) for rank in range(2)]
    data = forking_pickle([("model.norm.weight", local(values=[forking_pickle(t) for t in per_rank]))])
    for rank in range(2):
        (name, tensor), = decode_payload(data, rank, allow_pickle=True, load_format=None)
        assert name == "model.norm.weight" and torch.equal(tensor, per_rank[rank])
    with pytest.raises(PayloadError, match="none for TP rank 2"):
        decode_payload(data, 2, allow_pickle=True, load_format=None)


@pytest.mark.parametrize("as_bytes", [True, False])
def test_flattened_bucket_of_either_sglang_layout(monkeypatch, file_system_sharing, as_bytes):
    """Newer SGLang flattens raw bytes (uint8, byte offsets); older kept one dtype (element offsets)."""
    meta_cls = _sglang_class(monkeypatch, "sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata",
                             ["name", "shape", "dtype", "start_idx", "end_idx", "numel"])
    named = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(4))]
    flat, metadata, start = [], [], 0
    for name, tensor in named:
        piece = tensor.flatten().view(torch.uint8) if as_bytes else tensor.flatten()
        metadata.append(meta_cls(name, tensor.shape, tensor.dtype, start, start + piece.numel(), tensor.numel()))
        flat.append(piece)
        start += piece.numel()
    data = forking_pickle({"flattened_tensor": torch.cat(flat), "metadata": metadata})
    assert_named_equal(decode_payload(data, 0, allow_pickle=True, load_format="flattened_bucket"), named)
    metadata[1].end_idx = start + 1
    bad = forking_pickle({"flattened_tensor": torch.cat(flat), "metadata": metadata})
    with pytest.raises(PayloadError, match="lies outside the flattened tensor"):
        decode_payload(bad, 0, allow_pickle=True, load_format="flattened_bucket")


@pytest.mark.parametrize("data, load_format, message", [
    (b"\x80\x04garbage", None, "does not load"),
    (b"", "tensor_parallel", "is not one of"),
])
def test_bad_payloads_are_refused(data, load_format, message):
    with pytest.raises(PayloadError, match=message):
        decode_payload(data, 0, allow_pickle=True, load_format=load_format)
