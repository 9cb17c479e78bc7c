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


def layer_order() -> list[set[str]]:
    """The layers of docs/design.md's `## Layers` block, bottom first as the doc lists them: each
    line is `name[, name ...]  description` (continuation lines are indented)."""
    text = DESIGN.read_text()
    section = text.split("## Layers", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block, "docs/design.md: the `## Layers` section has no ```text block"
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


def layer_of(module: str, layers: list[set[str]]) -> int:
    """`hspmd.X.y` is in layer X; the package itself (its public facade) is above every layer."""
    if module == "hspmd":
        return len(layers)
    name = module.split(".")[1]
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


@pytest.mark.parametrize("broken", ["cycle", "upward"])
def test_the_checks_catch_what_they_should(broken, monkeypatch):
    """The checks themselves fail on a cycle and on an upward import (guards against a vacuous test)."""
    real = graph()
    fake = real.copy()
    if broken == "cycle":
        fake.add_edge("hspmd.annotations.geometry", "hspmd.annotations.states")
        fake.add_edge("hspmd.annotations.states", "hspmd.annotations.geometry")
        check = test_no_module_cycles
    else:
        fake.add_edge("hspmd.annotations.geometry", "hspmd.runtime.run")
        check = test_imports_point_down_the_layers
    monkeypatch.setitem(globals(), "graph", lambda: fake)
    with pytest.raises(AssertionError):
        check()
