"""Benchmark modules the server suites reuse (benchmarks/ is not a package), and the skip marker
for machines without sglang-router."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")


def load_benchmark_module(name: str) -> Any:
    """benchmarks/<name>.py as a module (loaded once; its own imports find their neighbours)."""
    if name in sys.modules:
        return sys.modules[name]
    if BENCH_DIR not in sys.path:
        sys.path.insert(0, BENCH_DIR)
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH_DIR, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


try:
    import sglang_router  # noqa: F401

    HAVE_ROUTER = True
except ImportError:
    HAVE_ROUTER = False

needs_router = pytest.mark.skipif(not HAVE_ROUTER,
                                  reason="sglang-router is not installed (pip install -e '.[router]')")
