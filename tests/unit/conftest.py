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
