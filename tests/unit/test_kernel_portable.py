"""The portable build of the kernel library (ENGINE_CPU_KERNEL_PORTABLE=1, library.build(portable=True)):
the generic C paths only, whatever the CPU, so that a machine with AVX-512 or AMX still compiles and
tests them (the parity tests run on it through conftest's kernel_build and decode_path fixtures)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from typing import List, Set

import pytest

from engine.kernels import library

CC = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def test_the_portable_build_holds_no_avx512_or_amx_code(portable_kernels):
    assert portable_kernels.library.engine_kernels_isa() == 0
    own = library.library_info()
    assert own is not None
    # Both load side by side in one process; on a CPU without AVX-512 they hold the same paths.
    assert own.engine_kernels_isa() & ~0b11111 == 0


def test_the_environment_variable_selects_the_portable_build(monkeypatch):
    seen: List[List[str]] = []

    def fake_build(flags: List[str]) -> None:
        seen.append(flags)
        return None  # no library: the accessors are None, as without a compiler

    monkeypatch.setattr(library, "_build", fake_build)
    for value in ("1", "0"):
        monkeypatch.setenv("ENGINE_CPU_KERNEL_PORTABLE", value)
        monkeypatch.setattr(library, "_kernel", library._UNSET)
        assert library.ops() is None
    portable, native = seen
    assert native == library._FLAGS and portable[:len(native)] == native
    assert set(portable[len(native):]) == set(library._PORTABLE_FLAGS)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or CC is None, reason="x86 compilers only")
def test_the_portable_flags_leave_out_avx512_and_amx_on_a_cpu_that_has_them():
    """What this machine's CPU cannot show: compiling for a Sapphire Rapids Xeon (AVX-512, AVX512-BF16,
    AMX), the portable flags leave every macro the kernels' ISA paths sit behind undefined."""
    def macros(flags: List[str]) -> Set[str]:
        proc = subprocess.run([CC, "-march=sapphirerapids", *flags, "-dM", "-E", "-x", "c", os.devnull],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            pytest.skip(f"{CC} does not know -march=sapphirerapids: {proc.stderr[-200:]}")
        return {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("#define ")}

    isa = {"__AVX512F__", "__AVX512BF16__", "__AVX512VNNI__", "__AMX_TILE__", "__AMX_BF16__", "__AMX_INT8__"}
    assert isa <= macros([])
    assert not isa & macros(library._PORTABLE_FLAGS)
