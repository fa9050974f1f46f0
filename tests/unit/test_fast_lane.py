"""The fast lane's premise: tests/integration/conftest.py skips collecting the integration modules
under `-m "not slow"` without importing them, which is only sound while each of them is marked slow
as a whole module (a module-level `pytestmark` that holds `pytest.mark.slow`)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import List

INTEGRATION = Path(__file__).resolve().parent.parent / "integration"


def module_marks(path: Path) -> List[str]:
    """The dotted names in the module's top-level `pytestmark = ...` (a mark or a list of them)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            return [ast.unparse(v) for v in values]
    return []


def test_every_integration_module_is_marked_slow():
    modules = sorted(INTEGRATION.glob("test_*.py"))
    assert len(modules) > 10, modules
    unmarked = [m.name for m in modules if "pytest.mark.slow" not in module_marks(m)]
    assert not unmarked, f"integration modules the fast lane would skip without running: {unmarked}"

