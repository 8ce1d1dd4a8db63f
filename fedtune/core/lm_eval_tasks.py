"""What the download stage and the evaluate stage share about lm-evaluation-harness tasks (the optional
extra `[downstream]`): the layout of the run's tasks folder, its error, datasets' cache, lm-eval's task
manager; and the entries of evaluate.tasks resolved (a task YAML, checked with its local data files, or a
name of lm-eval's registry), without lm-eval, so that a missing file fails when Snakemake starts. Here,
below both stages, so that download (which fills the folder on the login node) never imports the evaluate
stage that reads it."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from fedtune.core.options import CAUSAL_LM, ConfigError, UserError

# The folder the download stage fills (results/<run>/tasks/).
RECORD = "tasks.json"
INCLUDE = "include"  # a copy of each task YAML (data_files rewritten), one folder per task
DATA = "data"  # the task YAMLs' local data files
DATASETS_CACHE = "hf-datasets"  # datasets' cache: the hub data sets, read offline by the evaluate jobs


class DownstreamError(UserError):
    """A task, folder or model that cannot be scored: the message names it."""


def use_datasets_cache(folder: str | Path | None) -> str | None:
    """Point datasets' cache at `folder` (None: unset) and return the previous setting. The variable is
    read when datasets is imported, so an imported module is told too (download's progress set-up
    imports it first). Absolute: a later change of directory must not move the cache."""
    previous = os.environ.get("HF_DATASETS_CACHE")
    if folder is None:
        os.environ.pop("HF_DATASETS_CACHE", None)
    else:
        os.environ["HF_DATASETS_CACHE"] = str(Path(folder).resolve())
    if "datasets" in sys.modules and folder is not None:
        import datasets

        datasets.config.HF_DATASETS_CACHE = Path(folder).resolve()
    return previous


def task_manager(include_path: Sequence[str | Path], registry: bool):
    from lm_eval.tasks import TaskManager

    for folder in include_path:
        if not Path(folder).is_dir():
            raise DownstreamError(f"--include-path: {folder} is not a folder of task YAMLs")
    # Indexing lm-eval's own thousands of tasks takes seconds: only when a registry name is asked for.
    return TaskManager(include_path=[str(p) for p in include_path] or None, include_defaults=registry)


def check_known(manager, names: Sequence[str]) -> None:
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        raise DownstreamError(
            f"--tasks: unknown to lm-eval (and the --include-path folders): {', '.join(unknown)}"
        )


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


# ---------------------------------------------------------------------------------------------------
# Downstream tasks (evaluate.tasks): which entry is a task YAML and which a name of lm-eval's registry.
# The run config resolves them when Snakemake starts; download resolves the same entries with the same
# functions when it copies them into the run's tasks folder.

# The checkout (a run started from the repository finds workflow/tasks and data/ from any directory).
PROJECT_DIR = Path(__file__).resolve().parents[2]
PROJECT_TASKS_DIR = PROJECT_DIR / "workflow" / "tasks"
TASK_YAML_SUFFIXES = (".yaml", ".yml")
DOWNSTREAM_EXTRA = "pip install -e '.[downstream]'"


class _TaskYamlLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs for their keys: tags such as `!function utils.process_docs` load as None
    (lm-eval resolves them itself)."""


_TaskYamlLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


@dataclass(frozen=True)
class DownstreamTask:
    """One entry of evaluate.tasks: its lm-eval name, and for a task YAML the file it is defined in."""

    entry: str
    name: str
    yaml: Path | None  # None: a task or group of lm-eval's registry


def resolve_path(path: str | Path, base_dir: Path) -> Path:
    """A relative path of a task entry or of a task's data file: against the working directory, else
    against the project (so that workflow/tasks/... and the demo data work from any working directory).
    The working directory's path when neither exists."""
    path = Path(path)
    if path.is_absolute():
        return path
    here = Path(base_dir) / path
    if here.exists() or not (PROJECT_DIR / path).exists():
        return here
    return PROJECT_DIR / path


def read_task_yaml(path: Path, where: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            document = yaml.load(f, Loader=_TaskYamlLoader)
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{where}: {path}: not a readable YAML file: {e}") from None
    if not isinstance(document, dict) or not isinstance(document.get("task"), str):
        raise ConfigError(
            f"{where}: {path}: not an lm-eval task YAML (no `task: <name>` key); a group of tasks is "
            "named by its registry name instead"
        )
    return document


def task_data_files(document: Mapping) -> dict[str, list[str]]:
    """A task YAML's local files (dataset_kwargs.data_files) by split, as written."""
    files = (document.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return {}
    if isinstance(files, Mapping):
        return {str(split): _as_list(value) for split, value in files.items()}
    return {"train": _as_list(files)}


def downstream_task(entry: str, *, base_dir: Path, where: str) -> DownstreamTask:
    """An entry of evaluate.tasks, checked: a task YAML that exists, holds a task and whose local data
    files exist; a task shipped in workflow/tasks by name; else a registry name (checked by lm-eval in
    the download stage)."""
    if entry.endswith(TASK_YAML_SUFFIXES):
        path = resolve_path(entry, base_dir)
        if not path.is_file():
            raise ConfigError(f"{where}: task YAML not found: {entry} (relative to the working directory)")
    elif (PROJECT_TASKS_DIR / f"{entry}.yaml").is_file():
        path = PROJECT_TASKS_DIR / f"{entry}.yaml"
    else:
        return DownstreamTask(entry, entry, None)
    document = read_task_yaml(path, where)
    for split, files in task_data_files(document).items():
        for file in files:
            if "://" not in file and not resolve_path(file, base_dir).is_file():
                raise ConfigError(
                    f"{where}: {path}: dataset_kwargs.data_files.{split}: file not found: {file} "
                    "(relative to the working directory)"
                )
    return DownstreamTask(entry, document["task"], path)


def check_downstream_installed(where: str) -> None:
    """lm-eval is an optional extra: say how to install it before any job needs it."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            f"{where}: downstream tasks need lm-evaluation-harness, which is not installed: "
            f"{DOWNSTREAM_EXTRA} (the downstream extra)"
        )


def downstream_tasks(options, task: str, *, base_dir: Path, source: str):
    """evaluate.tasks (`options`: an EvaluateOptions) resolved and checked (none when the list is empty)."""
    if not options.tasks:
        return ()
    if task != CAUSAL_LM:
        raise ConfigError(f"{source}: evaluate.tasks: downstream tasks score language models; task is {task}")
    check_downstream_installed(f"{source}: evaluate.tasks")
    resolved = [
        downstream_task(entry, base_dir=base_dir, where=f"{source}: evaluate.tasks[{i}]")
        for i, entry in enumerate(options.tasks)
    ]
    names = [t.name for t in resolved]
    for i, t in enumerate(resolved):
        if names.index(t.name) != i:
            raise ConfigError(
                f"{source}: evaluate.tasks[{i}]: {t.entry} defines task {t.name}, as an earlier entry does"
            )
    return tuple(resolved)


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)
