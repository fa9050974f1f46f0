"""One switch per kernel family (ENGINE_CPU_KERNEL_<FAMILY>=0), the old names still honoured, and each
family's accessor honouring its switch alone; the layers take their torch paths where it is off."""

from __future__ import annotations

import os
import shutil
from typing import Dict

import pytest
import torch

from engine.kernels import attention as attention_kernels
from engine.kernels import library
from engine.kernels import ops as kernel_ops
from engine.kernels.library import Family

ALL_VARS = [f"ENGINE_CPU_KERNEL_{f.value}" for f in Family] + ["ENGINE_CPU_DECODE_KERNEL", "ENGINE_CPU_FUSED_OPS"]
HAS_CC = bool(os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc"))


def _switches_with(monkeypatch, **env: str) -> Dict[Family, bool]:
    for name in ALL_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(library, "_switches", None)  # read the environment again, as a new process
    return dict(library.switches())


def _off(switches: Dict[Family, bool]) -> set:
    return {f for f, on in switches.items() if not on}


def test_each_variable_turns_off_its_family_and_the_old_names_cover_theirs(monkeypatch):
    assert _off(_switches_with(monkeypatch)) == set()
    for family in Family:
        assert _off(_switches_with(monkeypatch, **{f"ENGINE_CPU_KERNEL_{family.value}": "0"})) == {family}
    assert _off(_switches_with(monkeypatch, ENGINE_CPU_KERNEL_OPS="1")) == set()  # only "0" turns off
    assert _off(_switches_with(monkeypatch, ENGINE_CPU_DECODE_KERNEL="0")) == set(Family)
    assert _off(_switches_with(monkeypatch, ENGINE_CPU_FUSED_OPS="0")) == {Family.OPS, Family.LINEAR,
                                                                         Family.DECODER_LAYERS}
    # A new name cannot turn back on what an old one turned off.
    assert _off(_switches_with(monkeypatch, ENGINE_CPU_FUSED_OPS="0", ENGINE_CPU_KERNEL_OPS="1")) == {
        Family.OPS, Family.LINEAR, Family.DECODER_LAYERS}


def test_every_family_off_builds_nothing(monkeypatch):
    _switches_with(monkeypatch, ENGINE_CPU_DECODE_KERNEL="0")
    monkeypatch.setattr(library, "_kernel", library._UNSET)

    def no_build():
        raise AssertionError("built with every family off")

    monkeypatch.setattr(library, "_build", no_build)
    assert library.load() is False
    assert (library.ops(), library.linear(), library.attention(), library.lora(), library.decoder_layers()) == \
        (None,) * 5


@pytest.mark.skipif(not HAS_CC, reason="no C compiler: every accessor is None anyway")
@pytest.mark.parametrize("family", list(Family))
def test_a_family_off_leaves_the_others_on(monkeypatch, family):
    assert library.load(), "a C compiler is present but the kernels did not build (see the log)"
    monkeypatch.setitem(library.switches(), family, False)
    accessors = {Family.OPS: library.ops, Family.LINEAR: library.linear, Family.ATTENTION: library.attention,
                 Family.LORA: library.lora, Family.DECODER_LAYERS: library.decoder_layers}
    for other, accessor in accessors.items():
        # the one call needs every family whose work it does on (not LoRA's: its batches have no adapter rows)
        if other is family or (other is Family.DECODER_LAYERS and family is not Family.LORA):
            assert accessor() is None, other
        else:
            assert accessor() is not None, other
    assert library.library_info() is not None  # not a family: what the build holds


@pytest.mark.skipif(not HAS_CC, reason="no C compiler")
def test_the_layers_take_their_torch_paths_where_a_family_is_off(monkeypatch):
    from engine.layers.layernorm import RMSNorm

    assert library.load()
    calls = []
    real = kernel_ops.rms_norm
    monkeypatch.setattr(kernel_ops, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))
    norm = RMSNorm(64)
    x = torch.randn(3, 64)
    q, k_buf = torch.randn(2, 64), torch.randn(8, 1, 64)
    fused = norm(x)
    assert calls == [1] and attention_kernels.supports(q, k_buf)
    monkeypatch.setitem(library.switches(), Family.OPS, False)
    reference = norm(x)
    assert calls == [1], "the ops family is off: RMSNorm must not call the kernel"
    assert torch.allclose(fused, reference, atol=1e-5)
    assert attention_kernels.supports(q, k_buf), "the ops switch must leave attention on"
    monkeypatch.setitem(library.switches(), Family.ATTENTION, False)
    assert not attention_kernels.supports(q, k_buf) and not attention_kernels.extend_supported()
