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
