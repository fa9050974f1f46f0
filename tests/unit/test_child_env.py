"""Spawned children start with passive OpenMP waits unless the user chose a wait policy."""

from __future__ import annotations

import os

import pytest

from engine.launch.children import ChildProcesses


def _report_environment(writer) -> None:
    writer.send({"status": "ready", "omp": os.environ.get("OMP_WAIT_POLICY")})
    writer.close()


def _spawn_and_read(name: str) -> dict:
    children = ChildProcesses()
    try:
        children.start(name, _report_environment, ())
        return children.wait_ready(timeout=120)[name]
    finally:
        children.shutdown()


@pytest.mark.parametrize("user_setting", [None, "ACTIVE"])
def test_children_wait_passively_unless_told_otherwise(monkeypatch, user_setting):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    if user_setting is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user_setting)
    info = _spawn_and_read("probe")
    assert info["omp"] == (user_setting or "PASSIVE")
    # the parent's own environment is left as it was
    assert os.environ.get("OMP_WAIT_POLICY") == user_setting
