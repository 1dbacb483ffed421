"""Layers that only point down: formats -> models -> kernels and transforms -> decoding -> analysis ->
integrations, training, CLI. A module may import its own layer and those below it, never one above,
and no two modules import each other (directly or round a longer loop, lazy imports included: an
import inside a function is how a cycle hides). Read from the source, so a test fails on the line
that adds the wrong import, not on some later import-order accident.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO

PACKAGE = REPO / "workbench"
# (layer, the modules and packages in it), bottom first. Formats: what files and engines' configs
# say (no model code); `cache` is the KV cache's data structure, which the models write into.
LAYERS = [
    ("formats", ["workbench.config", "workbench.checkpoint", "workbench.tokenizer", "workbench.machine",
                 "workbench.cache", "workbench.batch_schedule", "workbench.engine_readings", "workbench.jsonl"]),
    ("models", ["workbench.models"]),
    ("kernels and transforms", ["workbench.kernels", "workbench.variants", "workbench.compiled", "workbench.fast",
                                "workbench.pair"]),
    ("decoding", ["workbench.decoding"]),
    ("analysis", ["workbench.analysis"]),
    ("integrations, training, CLI", ["workbench.integrations", "workbench.training", "workbench.cli", "workbench"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) of every workbench import in `path`, top-level or inside a function."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "workbench":
            for alias in node.names:  # `from workbench.x import y` is an import of module x.y when it is one
                sub = f"{node.module}.{alias.name}"
                out.append((node.lineno, sub if sub in known else node.module))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "workbench"]
    return out


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if (module == m or module.startswith(m + ".")) and len(m) > best_len:
                best, best_len = i, len(m)
    assert best is not None, f"{module}: in no layer; add it to LAYERS in tests/test_layers.py"
    return best


def graph() -> dict[str, list[tuple[int, str]]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    return {module_name(p): imports(p, known) for p in paths}


def test_every_import_points_down():
    bad = []
    for module, deps in graph().items():
        here = layer_of(module)
        for line, dep in deps:
            if layer_of(dep) > here:
                bad.append(f"{module}:{line} imports {dep} ({LAYERS[layer_of(dep)][0]}) from {LAYERS[here][0]}")
    assert not bad, "imports that point up:\n" + "\n".join(bad)


def test_only_the_cli_imports_the_package_face():
    """`import workbench` runs __init__, which imports every layer: below the top it is a cycle."""
    bad = [f"{m}:{line}" for m, deps in graph().items() for line, dep in deps
           if dep == "workbench" and m not in ("workbench.cli", "workbench")]
    assert not bad, "modules importing the package face `workbench`: " + ", ".join(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    g = graph()
    # A package's __init__ re-exports its modules: an edge to it is an edge to what it re-exports,
    # so `workbench.models` -> `workbench.models.draft` is the package's own, not a cycle.
    edges = {m: {d for _, d in deps if d != m and not m.startswith(d + ".")} for m, deps in g.items()}
    assert cycles(edges) == []


def test_the_checks_catch_what_they_are_for():
    """Not vacuous: an upward import, the face imported below the top, and a loop are each caught."""
    assert layer_of("workbench.decoding.engine") < layer_of("workbench.analysis.degeneracy")
    assert layer_of("workbench.models.mla") < layer_of("workbench.kernels.cpu") < layer_of("workbench.decoding.batch")
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
