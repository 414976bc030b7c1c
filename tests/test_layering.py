"""The pipeline's layering, checked on the source: measure <- plan <- apply <- verify <- report <- cli.

Every import statement counts, those inside functions and under ``TYPE_CHECKING`` included (an
import on use is still a dependency), and a fresh interpreter importing the lower layers' modules
one by one must not load a higher layer's.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import remat

SRC = Path(remat.__file__).resolve().parent.parent
HIGHER = ("remat.plan", "remat.apply", "remat.verify", "remat.report", "remat.cli", "remat.estimate")
BOTTOM = ("remat.checkpointing", "remat._diskio", "remat._files", "remat._units")
"""Below every stage: they import nothing of remat but each other."""
RULES = {
    "remat.head": ("remat.measure", *HIGHER),  # the head part's loss, chunking and strategies: below measure
    "remat.measure": HIGHER,
    "remat.memory": HIGHER,
    "remat.models": HIGHER,
    "remat.plan": ("remat.apply", "remat.verify", "remat.report", "remat.cli"),
}
"""Layer -> what its modules must not import."""


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "remat").rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """remat modules named by every import statement of ``path``; ``from pkg import sub`` names
    the submodule, not the package."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{alias.name}" for alias in node.names}
            out |= subs & set(modules)
            if not subs <= set(modules):
                out.add(node.module)
    return {name for name in out if name.startswith("remat")}


def _layer_of(name: str) -> str | None:
    return next((layer for layer in (*BOTTOM, *RULES) if _within(name, (layer,))), None)


def _forbidden(layer: str) -> tuple[str, ...]:
    """Packages a module of ``layer`` must not import (for the bottom: all of remat but itself)."""
    if layer in BOTTOM:
        return ("remat.measure", "remat.memory", "remat.models", *HIGHER)
    return RULES[layer]


def _breaks(name: str, imported: str) -> bool:
    layer = _layer_of(name)
    if layer is None:
        return False
    if layer in BOTTOM:
        return imported != "remat" and not _within(imported, BOTTOM)
    return _within(imported, RULES[layer])


def test_no_module_imports_a_layer_above_it_even_on_use():
    modules = _modules()
    wrong = sorted((name, imported) for name, path in modules.items() for imported in _imports(path, modules)
                   if _breaks(name, imported))
    assert wrong == []


def test_the_rules_catch_what_they_forbid():
    assert _breaks("remat.measure.overhead", "remat.apply.runtime")
    assert _breaks("remat.measure.overhead", "remat.plan")
    assert _breaks("remat.plan.costs", "remat.apply.selective")
    assert _breaks("remat.checkpointing.region", "remat.measure.storage")
    assert not _breaks("remat.checkpointing.selective", "remat.checkpointing.cacheable")
    assert not _breaks("remat.plan.policies", "remat.checkpointing.cacheable")
    assert not _breaks("remat.apply.strategies", "remat.plan.types")
    assert _breaks("remat.head.site", "remat.measure.types") and not _breaks("remat.measure.head", "remat.head.site")


def test_no_import_circle():
    """Strongly connected components of the import graph (every import statement) are single modules."""
    modules = _modules()
    graph = {name: _imports(path, modules) & set(modules) - {name} for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan 1972
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert circles == []


_FRESH = """
import importlib, json, sys
found, seen = {}, set()
for name, forbidden in json.loads(sys.argv[1]):
    importlib.import_module(name)
    loaded = {m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in forbidden)} - seen
    if loaded:
        found[name] = sorted(loaded)
        seen |= loaded
print(json.dumps(found))
"""


def test_a_fresh_interpreter_importing_the_lower_layers_loads_no_higher_one():
    """One interpreter imports every module of the bottom layer, measure, memory and models, then of
    plan, checking after each import what got loaded (the module that pulls a higher layer in is
    named)."""
    names = sorted(_modules(), key=lambda n: (_layer_of(n) == "remat.plan", n))
    pairs = [(name, _forbidden(_layer_of(name))) for name in names if _layer_of(name) is not None]
    result = subprocess.run([sys.executable, "-c", _FRESH, json.dumps(pairs)], capture_output=True, text=True,
                            check=True, env={"PYTHONPATH": str(SRC), "PATH": "", "OMP_NUM_THREADS": "1"})
    assert json.loads(result.stdout) == {}
    assert len(pairs) > 40  # every module of those layers was imported


def test_the_package_reaches_its_subpackages_by_attribute_and_keeps_its_functions():
    """``remat.models.build`` with only ``import remat`` (the README's and users' way); the
    functions named like submodules stay functions; an unknown name is an AttributeError."""
    code = ("import remat, types; print(remat.models.build.__name__, type(remat.plan).__name__, "
            "type(remat.verify).__name__, type(remat.distributed).__name__); import remat.plan; "
            "print(type(remat.plan).__name__)\n"
            "try:\n    remat.no_such_thing\nexcept AttributeError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:3] == ["build function function module", "function", "module 'remat' has no attribute 'no_such_thing'"]
