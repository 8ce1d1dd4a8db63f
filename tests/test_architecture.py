"""The package's shape: fedtune.core.config is a leaf every stage may import, and no import circle exists among
fedtune's modules (counting the imports inside functions too, which a circle would otherwise hide in)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fedtune"


def imported_fedtune_modules(path: Path) -> set[str]:
    """Every fedtune module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "fedtune":
                found |= {f"fedtune.{alias.name}" for alias in node.names}
            elif node.module.startswith("fedtune."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("fedtune.")}
    return found


def package_modules() -> dict[str, Path]:
    """Every module of the package by dotted name (sub-packages included, their __init__ and __main__ not)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem in ("__init__", "__main__"):
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts)] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_fedtune_modules(path) & set(modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return stack[stack.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_config_imports_nothing_from_fedtune():
    assert import_graph()["fedtune.core.config"] == set()
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, fedtune.core.config; print(sorted(m for m in sys.modules if m.split('.')[0] == 'fedtune'))"],
        capture_output=True, text=True, check=True, cwd=PACKAGE.parent,
    ).stdout  # fmt: skip
    assert loaded.strip() == "['fedtune', 'fedtune.core', 'fedtune.core.config']"


def test_no_import_circle_among_fedtune_modules():
    graph = import_graph()
    assert len(graph) > 15  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_circle():
    # The check above is only worth something if a circle would be found.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
