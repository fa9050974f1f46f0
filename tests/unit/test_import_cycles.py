"""The import graph of src/engine: no cycle through the scheduler's package, and no new cycle anywhere.

Every import counts, the ones under `if TYPE_CHECKING:` and inside functions included: a type-only
cycle still ties the modules together (each must be read to understand the other).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

SRC = Path(__file__).resolve().parents[2] / "src"

# Cycles outside the scheduler that are known and left for later; the test fails when a new one
# appears, and when one of these is gone (so the list only shrinks).
KNOWN_CYCLES: Set[frozenset] = {
    # ForwardBatch carries its attention backend, whose methods take the ForwardBatch and the layer.
    frozenset({"engine.layers.attention.base_attn_backend", "engine.layers.radix_attention",
               "engine.model_executor.forward_batch_info"}),
    # The model runner picks a backend by name (layers.attention), the Triton backend sizes its
    # buffers from the runner, the CUDA-graph runner replays the runner's forward.
    frozenset({"engine.layers.attention", "engine.layers.attention.triton_backend",
               "engine.model_executor.cuda_graph_runner", "engine.model_executor.model_runner"}),
    # The one-call native decoder layers read Llama's module tree; Llama runs its layers through them.
    frozenset({"engine.kernels.decoder_layers", "engine.models.llama"}),
}


def _modules() -> Dict[str, Path]:
    modules = {}
    for path in (SRC / "engine").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _graph(modules: Dict[str, Path]) -> Dict[str, Set[str]]:
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        deps: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)  # `from pkg import mod` runs pkg/__init__ too
                deps.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                deps.update(alias.name for alias in node.names)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[frozenset]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[frozenset] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [frozenset({"a", "b", "c"})]


def test_no_import_cycle_goes_through_the_scheduler():
    cycles = _cycles(_graph(_modules()))
    through_scheduler = [sorted(c) for c in cycles if any(m.startswith("engine.scheduler") for m in c)]
    assert through_scheduler == []


def test_no_new_import_cycle():
    cycles = set(_cycles(_graph(_modules())))
    assert sorted(map(sorted, cycles - KNOWN_CYCLES)) == [], "a new import cycle"
    assert sorted(map(sorted, KNOWN_CYCLES - cycles)) == [], "a known cycle is gone: drop it from KNOWN_CYCLES"
