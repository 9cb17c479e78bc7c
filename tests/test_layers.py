"""The package's import structure: every import (function-local ones included) points down the layer
order written in docs/design.md, and no modules or subpackages import each other in a cycle."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import networkx as nx
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hspmd"
DESIGN = ROOT / "docs" / "design.md"


def layer_order(heading: str = "## Layers") -> list[set[str]]:
    """The layers of the ```text block under `heading` in docs/design.md, bottom first as the doc
    lists them: each line is `name[, name ...]  description` (continuation lines are indented)."""
    text = DESIGN.read_text()
    section = text.split(f"\n{heading}\n", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, f"docs/design.md: the `{heading}` section has no ```text block"
    layers = []
    for line in block.group(1).splitlines():
        if not line.strip() or line.startswith(" "):
            continue
        names = re.match(r"([\w.]+(?:, [\w.]+)*)", line).group(1)
        layers.append({n.strip() for n in names.split(",")})
    return layers


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every hspmd module `module` imports, anywhere in its body (also inside functions)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target for alias in node.names]
        else:
            continue
        found.update(name for name in names if name == "hspmd" or name.startswith("hspmd."))
    return found


def layer_of(module: str, layers: list[set[str]], depth: int = 1) -> int:
    """`hspmd.X.y` is in layer X (`depth` 1; `hspmd.runtime.X.y` is in runtime's sub-layer X at
    depth 2); the package (or the parent package) itself, its public facade, is above every layer."""
    parts = module.split(".")
    if len(parts) <= depth:
        return len(layers)
    name = parts[depth]
    for index, names in enumerate(layers):
        if name in names:
            return index
    raise AssertionError(f"{module}: `{name}` is in no layer of docs/design.md's `## Layers`")


def graph() -> nx.DiGraph:
    known = modules()
    edges = nx.DiGraph()
    edges.add_nodes_from(known)
    for module, path in known.items():
        for target in imports(module, path, known):
            assert target in known, f"{module} imports {target}, which is not a module of hspmd"
            if target != module:
                edges.add_edge(module, target)
    return edges


def test_imports_point_down_the_layers():
    layers = layer_order()
    wrong = [
        f"{a} imports {b}"
        for a, b in graph().edges
        if layer_of(b, layers) > layer_of(a, layers)
    ]
    assert not wrong, "imports against the layer order of docs/design.md:\n  " + "\n  ".join(sorted(wrong))


def test_runtime_sub_layers_point_down():
    """Inside hspmd.runtime, imports point down the sub-layer order of design.md's `### runtime`."""
    layers = layer_order("### runtime")
    inside = [(a, b) for a, b in graph().edges if a.startswith("hspmd.runtime.") and b.startswith("hspmd.runtime.")]
    assert inside, "no import inside hspmd.runtime: the check would pass vacuously"
    wrong = [f"{a} imports {b}" for a, b in inside if layer_of(b, layers, depth=2) > layer_of(a, layers, depth=2)]
    assert not wrong, "imports against the runtime sub-layer order of docs/design.md:\n  " + "\n  ".join(sorted(wrong))


def test_no_module_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph()) if len(c) > 1]
    assert not cycles, f"modules importing each other: {cycles}"


def test_no_subpackage_cycles():
    edges = graph()
    packages = nx.DiGraph()
    for a, b in edges.edges:
        pa, pb = ".".join(a.split(".")[:2]), ".".join(b.split(".")[:2])
        if pa != pb and "hspmd" not in (a, b):
            packages.add_edge(pa, pb)
    cycles = [sorted(c) for c in nx.strongly_connected_components(packages) if len(c) > 1]
    assert not cycles, f"subpackages importing each other: {cycles}"


def test_one_name_one_thing():
    """No package attribute hides a subpackage or module of the same name
    (`from hspmd.specialize import ...` must reach the subpackage)."""
    hidden = []
    for module in sorted(modules()):
        if "." in module:
            parent, name = module.rsplit(".", 1)
            importlib.import_module(module)
            attribute = getattr(importlib.import_module(parent), name)
            if getattr(attribute, "__name__", None) != module:
                hidden.append(f"{parent}.{name} is {attribute!r}, not the module {module}")
    assert not hidden, "\n".join(hidden)


@pytest.mark.parametrize("broken", ["cycle", "upward", "runtime-upward"])
def test_the_checks_catch_what_they_should(broken, monkeypatch):
    """The checks themselves fail on a cycle and on an upward import (guards against a vacuous test)."""
    real = graph()
    fake = real.copy()
    if broken == "cycle":
        fake.add_edge("hspmd.annotations.geometry", "hspmd.annotations.states")
        fake.add_edge("hspmd.annotations.states", "hspmd.annotations.geometry")
        check = test_no_module_cycles
    elif broken == "upward":
        fake.add_edge("hspmd.annotations.geometry", "hspmd.runtime.execution.run")
        check = test_imports_point_down_the_layers
    else:
        fake.add_edge("hspmd.runtime.execution.run", "hspmd.runtime.training.trainer")
        check = test_runtime_sub_layers_point_down
    monkeypatch.setitem(globals(), "graph", lambda: fake)
    with pytest.raises(AssertionError):
        check()
