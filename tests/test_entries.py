"""Entries take a job object: every function a command's `main` (a `@cli.entry` CLI: `python -m
fedtune.<stage>`, the core CLIs, the tools) calls in fedtune takes at most four parameters. A command's
paths and per-job facts travel as one frozen dataclass (TrainJob, EvalJob, AggregateJob,
AdapterAggregateJob, ShardJob, ...), its settings as the stage's options (docs/design.md, "Entries take
a job object"). Read from the source (ast): nothing is imported, so no torch."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fedtune"
MOST = 4
# The parser's own helpers (cli.add_list, ...) build the command line; they run no stage.
MACHINERY = {"fedtune.core.cli"}


def module_path(module: str) -> Path | None:
    """The file of a dotted fedtune module (a package's __init__ too), or None."""
    base = PACKAGE.parent.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def top_functions(path: Path) -> dict[str, ast.FunctionDef]:
    tree = parse(path)
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def parameters(function: ast.FunctionDef) -> int:
    a = function.args
    return (
        len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    )


def is_entry(function: ast.FunctionDef) -> bool:
    """Decorated with `@cli.entry(...)` (or `@entry(...)`)."""
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (isinstance(target, ast.Attribute) and target.attr == "entry") or (
            isinstance(target, ast.Name) and target.id == "entry"
        ):
            return True
    return False


def imported_names(tree: ast.Module, module: str) -> tuple[dict[str, str], dict[str, str]]:
    """({name: the fedtune module it is imported from}, {alias: the fedtune module it names}), at the top
    or inside a function."""
    names, modules = {}, {}
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                source = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [source])
                source = source.rstrip(".")
            if not source.startswith("fedtune"):
                continue
            for alias in node.names:
                if module_path(f"{source}.{alias.name}") is not None:
                    modules[alias.asname or alias.name] = f"{source}.{alias.name}"
                else:
                    names[alias.asname or alias.name] = source
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("fedtune.") and alias.asname:
                    modules[alias.asname] = alias.name
    return names, modules


def called_by_main(module: str, path: Path) -> list[tuple[str, int]]:
    """(function, its parameter count) for each fedtune function the module's entry `main` calls."""
    tree = parse(path)
    own = top_functions(path)
    main = own.get("main")
    if main is None or not is_entry(main):
        return []
    names, modules = imported_names(tree, module)
    found = {}
    for node in ast.walk(main):
        if not isinstance(node, ast.Call):
            continue
        where, name = None, None
        if isinstance(node.func, ast.Name):
            name = node.func.id
            where = module if name in own else names.get(name)
        elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name):
            name, where = node.func.attr, modules.get(node.func.value.id)
        source = module_path(where) if where else None
        if source is None or name == "main" or where in MACHINERY:
            continue
        function = top_functions(source).get(name)
        if function is not None:  # a class (a job object, an options class) is no entry
            found[f"{where}.{name}"] = parameters(function)
    return sorted(found.items())


def entries() -> dict[str, list[tuple[str, int]]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        calls = called_by_main(module, path)
        if calls:
            found[module] = calls
    return found


def test_the_entries_are_found():
    found = entries()
    # The stages' commands and the functions they run, as docs/design.md's table names them.
    for module, function in [
        ("fedtune.tokenize.shards", "fedtune.tokenize.shards.tokenize_shard"),
        ("fedtune.train.loop", "fedtune.train.loop.train_or_restore"),
        ("fedtune.aggregate.merge", "fedtune.aggregate.merge.aggregate"),
        ("fedtune.aggregate.adapters", "fedtune.aggregate.adapters.aggregate_adapters"),
        ("fedtune.evaluate.scores", "fedtune.evaluate.scores.evaluate"),
        ("fedtune.evaluate.downstream", "fedtune.evaluate.downstream.run_tasks"),
        ("fedtune.report.build", "fedtune.report.build.report"),
        ("fedtune.report.cost", "fedtune.report.cost.cost_report"),
        ("fedtune.core.transfer", "fedtune.core.transfer.fetch"),
        ("fedtune.core.updates", "fedtune.core.updates.compress"),
        ("fedtune.core.tracking", "fedtune.core.tracking.log_aggregate"),
        ("fedtune.evaluate.scores", "fedtune.core.tracking.log_evaluation"),
    ]:
        assert function in dict(found.get(module, [])), (module, function, found.get(module))


def test_every_entry_takes_at_most_four_parameters():
    wide = [
        f"{function}: {count} parameters (main of {module})"
        for module, calls in entries().items()
        for function, count in calls
        if count > MOST
    ]
    assert not wide, (
        "give these a job object (a frozen dataclass of the paths), as train(TrainJob, ...):\n"
        + ("\n".join(wide))
    )


def test_the_check_sees_a_wide_entry(tmp_path, monkeypatch):
    # The check is only worth something if it would fail: a module whose main calls a 5-parameter function.
    package = tmp_path / "fedtune" / "wide"
    package.mkdir(parents=True)
    (package / "cmd.py").write_text(
        "from fedtune.core import cli\n\n\n"
        "def run(a, b, c, *, d=None, e=None):\n    return a\n\n\n"
        '@cli.entry("fedtune.wide.cmd")\ndef main(argv=None):\n    run(1, 2, 3)\n'
    )
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "fedtune")
    assert called_by_main("fedtune.wide.cmd", package / "cmd.py") == [("fedtune.wide.cmd.run", 5)]
