"""Imports of the loss layer flow one way: no cycle through ``fastdistill.loss`` or ``fastdistill.logit_head``,
function-level (lazy) imports included, and nothing there imports ``fastdistill.train``."""

from __future__ import annotations

import ast
from pathlib import Path

import fastdistill

PACKAGE = Path(fastdistill.__file__).parent
CHECKED = ("fastdistill.loss", "fastdistill.logit_head")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """Every fastdistill module ``path`` imports anywhere in its body (top level or inside functions)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule when there is one, else a name of pkg
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = list(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imported_modules(p, modules) for p in paths}


def cycles_through(graph: dict[str, set[str]], start: str) -> list[list[str]]:
    """Simple cycles that start and end at ``start`` (depth-first, each listed once per path)."""
    found, stack = [], [(start, [start])]
    while stack:
        node, path = stack.pop()
        for target in graph.get(node, ()):
            if target == start:
                found.append(path + [start])
            elif target not in path:
                stack.append((target, path + [target]))
    return found


def is_checked(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in CHECKED)


def test_no_import_cycle_through_the_loss_layer():
    graph = import_graph()
    checked = [m for m in graph if is_checked(m)]
    assert "fastdistill.loss.api" in checked and "fastdistill.logit_head" in checked
    cycles = [cycle for module in checked for cycle in cycles_through(graph, module)]
    assert not cycles, "import cycles (lazy imports included):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_loss_layer_does_not_import_train():
    graph = import_graph()
    bad = {m: sorted(t for t in targets if t.startswith("fastdistill.train")) for m, targets in graph.items()
           if is_checked(m)}
    assert not any(bad.values()), bad


def test_the_graph_sees_lazy_and_relative_imports():
    """The checker itself: the dense loss's lazy import of the reference and its relative imports are edges."""
    graph = import_graph()
    assert "fastdistill.loss.reference" in graph["fastdistill.loss.dense"]
    assert "fastdistill.loss.outputs" in graph["fastdistill.loss.reference"]
    assert cycles_through({"a": {"b"}, "b": {"a"}}, "a") == [["a", "b", "a"]]
