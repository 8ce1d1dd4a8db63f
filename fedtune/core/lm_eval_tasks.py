"""What the download stage and the evaluate stage share about lm-evaluation-harness tasks (the optional
extra `[downstream]`): the layout of the run's tasks folder, its error, datasets' cache, lm-eval's task
manager. Here, below both stages, so that download (which fills the folder on the login node) never
imports the evaluate stage that reads it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fedtune.core.config import UserError

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
