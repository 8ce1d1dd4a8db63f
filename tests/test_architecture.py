"""The package's shape: fedtune.core.options is a leaf that every options module builds on, each stage's
options module imports only it and never torch, and no import circle exists among
fedtune's modules (counting the imports inside functions too, which a circle would otherwise hide in)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fedtune"


def imported_fedtune_modules(path: Path) -> set[str]:
    """Every fedtune module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "fedtune" or node.module.startswith("fedtune."):
                # `from fedtune.core import cli` names a module; `from fedtune.run.config import X` a name
                # (import_graph keeps only what is a module).
                found.add(node.module)
                found |= {f"{node.module}.{alias.name}" for alias in node.names}
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


def options_modules() -> list[str]:
    """The stages' options modules (fedtune/<stage>/options.py), which run.config composes."""
    return sorted(m for m in package_modules() if m.endswith(".options") and m != "fedtune.core.options")


def loaded_modules(*modules: str) -> list[str]:
    """The modules a fresh interpreter holds after importing `modules`."""
    code = f"import sys; import {', '.join(modules)}; print('\\n'.join(sorted(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=PACKAGE.parent
    )
    return result.stdout.split()


def test_options_machinery_imports_nothing_from_fedtune():
    assert import_graph()["fedtune.core.options"] == set()


def test_options_modules_import_only_core_options_and_never_torch():
    graph = import_graph()
    stages = options_modules()
    required = {
        "fedtune.download.options",
        "fedtune.tokenize.options",
        "fedtune.train.options",
        "fedtune.aggregate.options",
        "fedtune.evaluate.options",
    }
    assert required <= set(stages)
    for module in stages:
        # Besides: download's dataset check reads a local data file for the dry run (core.data_files, a leaf).
        data_files = {"fedtune.core.data_files"} if module == "fedtune.download.options" else set()
        allowed = {"fedtune.core.options", *data_files}
        assert graph[module] == allowed, (module, graph[module])
    assert graph["fedtune.core.data_files"] == set()
    # run.config composes them, above the stages; what it reads besides is core's settings that no stage
    # owns, and the run's sweep and pooled trainings. None of it loads torch.
    assert set(stages) <= graph["fedtune.run.config"]
    loaded = loaded_modules("fedtune.run.config", *stages)
    assert "torch" not in loaded and "transformers" not in loaded
    fedtune = [m for m in loaded if m.split(".")[0] == "fedtune"]
    packages = {m.rsplit(".", 1)[0] for m in stages}
    core = ["options", "data_files", "config_files", "durations", "exchange_options", "lm_eval_tasks"]
    core += ["participation", "remotes", "residency", "smoke", "tracking_options"]
    assert set(fedtune) == {
        "fedtune",
        "fedtune.core",
        *(f"fedtune.core.{name}" for name in core),
        "fedtune.run",
        "fedtune.run.config",
        "fedtune.run.pooled",
        "fedtune.run.sweep",
        *stages,
        *packages,
    }


def test_no_import_circle_among_fedtune_modules():
    graph = import_graph()
    assert len(graph) > 15  # the walk found the package
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_circle():
    # The check above is only worth something if a circle would be found.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


DESIGN = PACKAGE.parent / "docs" / "design.md"
MAP_START, MAP_END = "<!-- module map: begin -->", "<!-- module map: end -->"


def short(module: str) -> str:
    return module.removeprefix("fedtune.")


def module_map_rows() -> list[str]:
    """The table docs/design.md must hold: every module and the fedtune modules it imports."""
    graph = import_graph()
    rows = ["| module | imports from fedtune (inside functions too) |", "|---|---|"]
    for name in sorted(graph):
        imports = ", ".join(short(m) for m in sorted(graph[name])) or "nothing"
        rows.append(f"| `{short(name)}` | {imports} |")
    return rows


def test_design_module_map_matches_the_imports():
    text = DESIGN.read_text(encoding="utf-8")
    assert MAP_START in text and MAP_END in text, f"docs/design.md lost its module map markers ({MAP_START})"
    written = text.split(MAP_START)[1].split(MAP_END)[0].strip().splitlines()
    expected = module_map_rows()
    assert written == expected, "docs/design.md's module map is stale; write:\n" + "\n".join(expected)


def test_no_rule_reads_the_raw_config():
    # Settings reach rules only as fedtune.run.config's objects (RUN); common.smk builds RUN from `config`.
    rules = PACKAGE.parent / "workflow" / "rules"
    for path in [PACKAGE.parent / "Snakefile", *sorted(rules.glob("*.smk"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = re.sub(r'"[^"]*"|\'[^\']*\'', '""', line.split("#")[0])  # strings are no reads
            if "build_run_config(" in code or (path.name == "common.smk" and code.strip() == "config,"):
                continue
            assert not re.search(r"(?<![\w.])config\s*[\[.(]|to_json\(config\)", code), (
                f"{path.name}:{number}: {line}"
            )


STAGE_ORDER = re.compile(r"^Stage order: (.+)\.$", re.MULTILINE)


def stage_order() -> list[str]:
    """The order docs/design.md states, lowest first: a package may import itself and those before it."""
    found = STAGE_ORDER.findall(DESIGN.read_text(encoding="utf-8"))
    assert len(found) == 1, "docs/design.md must state the order once, as 'Stage order: core, download, ....'"
    return [name.strip().strip("`") for name in found[0].split(",")]


def backward_imports(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """Each import from a package to one later in `order` (fedtune.<package>.<module>)."""
    rank = {package: i for i, package in enumerate(order)}
    found = []
    for module, targets in sorted(graph.items()):
        for target in sorted(targets):
            source, dest = module.split(".")[1], target.split(".")[1]
            if rank[dest] > rank[source]:
                found.append(f"{short(module)} imports {short(target)} ({source} comes before {dest})")
    return found


def test_no_stage_imports_a_later_stage():
    order = stage_order()
    graph = import_graph()
    packages = {module.split(".")[1] for module in graph}
    assert packages == set(order), f"packages {sorted(packages)} against the stated order {order}"
    assert backward_imports(graph, order) == []


def test_the_stage_order_check_sees_a_backward_import():
    # The import that download had before the lm-eval task preparation moved into it.
    graph = {"fedtune.download.fetch": {"fedtune.evaluate.downstream"}, "fedtune.evaluate.downstream": set()}
    assert backward_imports(graph, stage_order()) == [
        "download.fetch imports evaluate.downstream (download comes before evaluate)"
    ]
    # The run config composes the stages' options from above them (run.config); core may not.
    graph = {
        "fedtune.core.config": {"fedtune.train.options"},
        "fedtune.run.config": {"fedtune.train.options"},
    }
    assert backward_imports(graph, stage_order()) == [
        "core.config imports train.options (core comes before train)"
    ]


if __name__ == "__main__":
    print("\n".join(module_map_rows()))
