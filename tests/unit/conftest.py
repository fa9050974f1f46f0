"""Fixtures shared by the unit tests."""

from __future__ import annotations

from typing import Callable, Iterator, List

import pytest

from pd_utils import PDPair


@pytest.fixture
def make_pair() -> Iterator[Callable[..., PDPair]]:
    """A factory of in-process PD pairs (pd_utils.PDPair); each is shut down after the test."""
    pairs: List[PDPair] = []

    def make(**kwargs) -> PDPair:
        pairs.append(PDPair(**kwargs))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


@pytest.fixture(scope="session")
def portable_kernels():
    """The kernel library built with the portable flags (ENGINE_CPU_KERNEL_PORTABLE's build: no
    AVX-512, no AMX code, whatever this CPU has), loaded beside the process's own."""
    import os
    import shutil

    from engine.kernels import library

    if not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):
        pytest.skip("no C compiler: no kernel library to build")
    kernels = library.build(portable=True)
    assert kernels is not None, "a C compiler is present but the portable kernel build failed (see the log)"
    assert kernels.library.engine_kernels_isa() == 0, "the portable build holds AVX-512 or AMX code"
    return kernels


@pytest.fixture(params=["native-build", "portable-build"])
def kernel_build(request, monkeypatch) -> Iterator[str]:
    """Runs a kernel parity test on the library built for this CPU and on the portable build: an
    AVX-512 machine's own build leaves the generic paths out, so CI there covers them this way."""
    from engine.kernels import library

    if request.param == "portable-build":
        monkeypatch.setattr(library, "_kernel", request.getfixturevalue("portable_kernels"))
    yield request.param


@pytest.fixture(params=["amx", "avx512"])
def cpu_isa(request) -> Iterator[str]:
    """Runs a bf16 kernel test on AMX tiles (where the CPU has them) and on AVX512-BF16."""
    from engine.kernels import library

    lib, linears = library.library_info(), library.linear()
    if lib is None or linears is None or not linears.linear_bf16_available():
        pytest.skip("no AVX512-BF16 on this CPU: the bf16 kernels are not used")
    if request.param == "amx" and not lib.amx_active():
        pytest.skip("no AMX on this CPU (or Linux refused the process its tiles): AVX512-BF16 runs")
    before = lib.amx_active()
    lib.amx_set(int(request.param == "amx"))
    yield request.param
    lib.amx_set(before)


@pytest.fixture(params=["amx", "vector"])
def int8_isa(request) -> Iterator[str]:
    """Runs an int8 kernel test on AMX-INT8 tiles (where the CPU has them) and on the vector paths (AVX512-VNNI or
    AVX2); after kernel_build where both are used, so that the portable build is the one switched."""
    from engine.kernels import library

    lib = library.library_info()
    if lib is None:
        pytest.skip("no kernel library on this machine")
    if request.param == "amx" and not (lib.engine_kernels_isa() & 16 and lib.amx_active()):
        pytest.skip("no AMX-INT8 on this CPU (or Linux refused the process its tiles): the vector paths run")
    before = lib.amx_active()
    lib.amx_set(int(request.param == "amx"))
    yield request.param
    lib.amx_set(before)
