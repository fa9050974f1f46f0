"""What the PD server suites share: benchmarks/pd_cluster.py (starting the router in PD mode)
and the skip marker for machines without sglang-router."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest


def _load_pd_cluster() -> Any:
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "pd_cluster.py")
    spec = importlib.util.spec_from_file_location("pd_cluster", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["pd_cluster"] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


pd_cluster = _load_pd_cluster()

try:
    import sglang_router  # noqa: F401

    HAVE_ROUTER = True
except ImportError:
    HAVE_ROUTER = False

needs_router = pytest.mark.skipif(not HAVE_ROUTER,
                                  reason="sglang-router is not installed (pip install -e '.[router]')")
