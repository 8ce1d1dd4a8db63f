"""The download stage of evaluate.tasks (`python -m fedtune.download tasks`, on the login node): each task
YAML and its local data files copied into the run folder, every task loaded once, which fetches its hub
data set into the folder's datasets cache, and tasks.json. The scoring step
(fedtune.evaluate.downstream) then reads only that folder, offline."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from fedtune.core.atomic import atomic_dir, write_json, write_text
from fedtune.core.lm_eval_tasks import (
    DATA,
    DATASETS_CACHE,
    INCLUDE,
    RECORD,
    DownstreamError,
    check_downstream_installed,
    check_known,
    downstream_task,
    lm_eval_version,
    resolve_path,
    task_manager,
    use_datasets_cache,
)


class _Tagged(str):
    """A YAML scalar with a tag (lm-eval's `!function utils.process_docs`), written back as it was."""

    tag = ""


def _tagged(loader, suffix, node):
    value = _Tagged(loader.construct_scalar(node))
    value.tag = "!" + suffix
    return value


class _KeepTags(yaml.SafeLoader):
    pass


class _WriteTags(yaml.SafeDumper):
    pass


_KeepTags.add_multi_constructor("!", _tagged)
_WriteTags.add_representer(_Tagged, lambda dumper, value: dumper.represent_scalar(value.tag, str(value)))


def _rewrite_data_files(files, copy):
    """data_files in the shape lm-eval was given (a path, a list, or a mapping by split), each local path
    replaced by copy(split, index, path)."""
    if isinstance(files, Mapping):
        return {split: _rewrite_data_files_list(value, split, copy) for split, value in files.items()}
    return _rewrite_data_files_list(files, "train", copy)


def _rewrite_data_files_list(value, split, copy):
    if isinstance(value, str):
        return copy(split, 0, value)
    return [copy(split, i, path) for i, path in enumerate(value)]


def _copy_task_yaml(source: Path, folder: Path, data: Path, final_data: Path, base_dir: Path) -> None:
    """One task YAML into `folder`, its local data files into `data` (the YAML names them by their place
    after the rename, `final_data`), and what it refers to beside it: the files it includes and the
    Python modules of its `!function`s (both found next to the YAML, as lm-eval looks for them)."""
    with open(source, encoding="utf-8") as f:
        document = yaml.load(f, Loader=_KeepTags)  # noqa: S506 - a SafeLoader that keeps tags
    kwargs = document.get("dataset_kwargs") or {}
    if kwargs.get("data_files") is not None:

        def copy(split, index, path):
            if "://" in path:
                return path
            target = data / str(split) / f"{index}-{Path(path).name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(resolve_path(path, base_dir), target)
            return str(final_data / str(split) / target.name)

        kwargs["data_files"] = _rewrite_data_files(kwargs["data_files"], copy)
    includes = document.get("include")
    if includes is not None:
        names = []
        for include in [includes] if isinstance(includes, str) else includes:
            path = source.parent / include
            if not path.is_file():
                raise DownstreamError(f"{source}: include: {include} not found beside it")
            _copy_task_yaml(
                path, folder, data / Path(include).stem, final_data / Path(include).stem, base_dir
            )
            names.append(path.name)
        document["include"] = names if isinstance(includes, list) else names[0]
    folder.mkdir(parents=True, exist_ok=True)
    for module in source.parent.glob("*.py"):
        shutil.copy2(module, folder / module.name)
    text = yaml.dump(document, Dumper=_WriteTags, sort_keys=False, allow_unicode=True)
    write_text(folder / source.name, f"# Copied from {source} by fedtune.download.fetch tasks.\n" + text)


def _documents(task) -> dict[str, int]:
    dataset = getattr(task, "dataset", None)
    if not isinstance(dataset, Mapping):
        return {}
    return {str(split): len(rows) for split, rows in dataset.items()}


def prepare(entries: Sequence[str], out: str | Path, *, base_dir: str | Path = ".") -> dict:
    """The download stage of evaluate.tasks: copies and fetched data sets in `out`, and tasks.json.

    The copies are written into a temporary folder and renamed; the tasks are then loaded from their
    final place, so that datasets' cache holds them under the paths the evaluate jobs will read.
    tasks.json is written last and marks the folder complete; a failure removes the folder."""
    check_downstream_installed("--tasks")
    base_dir = Path(base_dir)
    out = Path(out)
    tasks = [downstream_task(entry, base_dir=base_dir, where=f"--tasks {entry}") for entry in entries]
    with atomic_dir(out) as tmp:
        (tmp / INCLUDE).mkdir()
        for task in tasks:
            if task.yaml is not None:
                _copy_task_yaml(
                    task.yaml, tmp / INCLUDE / task.name, tmp / DATA / task.name, out / DATA / task.name,
                    base_dir,
                )  # fmt: skip
    previous_cache = os.environ.get("HF_DATASETS_CACHE")
    previous_config = sys.modules["datasets"].config.HF_DATASETS_CACHE if "datasets" in sys.modules else None
    try:
        use_datasets_cache(out / DATASETS_CACHE)
        manager = task_manager([out / INCLUDE], registry=any(t.yaml is None for t in tasks))
        check_known(manager, [t.name for t in tasks])
        record = {"tasks": [], "lm_eval": lm_eval_version()}
        for task in tasks:
            # Loading a task downloads its data set (hub) or reads its files, through datasets' cache.
            try:
                loaded = manager.load([task.name])
            except Exception as e:
                raise DownstreamError(
                    f"--tasks {task.entry}: lm-eval cannot load task {task.name}: {type(e).__name__}: {e}"
                ) from e
            record["tasks"].append(
                {
                    "entry": task.entry,
                    "name": task.name,
                    "yaml": None if task.yaml is None else str(task.yaml),
                    "subtasks": sorted(loaded["tasks"]),
                    "documents": {name: _documents(t) for name, t in sorted(loaded["tasks"].items())},
                }
            )
        write_json(out / RECORD, record)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        # The caller's cache again (a test, or a process that loads other data sets after this).
        use_datasets_cache(previous_cache)
        if previous_config is not None:
            sys.modules["datasets"].config.HF_DATASETS_CACHE = previous_config
    return record
